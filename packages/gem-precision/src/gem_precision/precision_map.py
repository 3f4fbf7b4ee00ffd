"""The ``precision:`` block a per-linear recommendation becomes: one default scheme, exact module names
for the others, ``exclude`` for the linears no scheme passed (:func:`recommended_precision`)."""

from __future__ import annotations

import re
from collections import Counter

from gem_model.api import ComponentRef, PrecisionConfig


def literal_pattern(fqn: str) -> str:
    """An fnmatch pattern that matches exactly ``fqn`` (module names rarely hold ``*?[``, but may)."""
    return re.sub(r"([*?[])", r"[\1]", fqn)


def recommended_precision(
    recommendations: dict[str, str | None], order: list[str], current: PrecisionConfig
) -> PrecisionConfig:
    """``scheme`` = the most common recommendation (ties: the cheaper), ``overrides`` = exact module
    names for the others, ``exclude`` = modules no scheme passed. ``min_dim`` is 0 so the map decides
    every module; the configured scheme keeps its options when it stays the default, and the
    configured ``activation_dtype`` stays."""
    counts = Counter(s for s in recommendations.values() if s is not None)
    rank = {name: i for i, name in enumerate(order)}
    if counts:
        main = min(counts, key=lambda s: (-counts[s], rank.get(s, len(rank))))
    else:
        main = current.scheme.name
    scheme = current.scheme if current.scheme.name == main else ComponentRef(name=main)
    return PrecisionConfig(
        scheme=scheme,
        overrides={literal_pattern(f): s for f, s in recommendations.items() if s is not None and s != main},
        exclude=[literal_pattern(f) for f, s in recommendations.items() if s is None],
        min_dim=0,
        activation_dtype=current.activation_dtype,
    )
