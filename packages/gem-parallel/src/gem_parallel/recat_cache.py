"""torchrec's input distribution without its host syncs: the feature permutation made once per shape.

Every forward, each sharded embedding module sends its ``KeyedJaggedTensor`` through torchrec's
``KJTAllToAll``, whose awaitable builds the permutation that puts the received features in order:
``torchrec.distributed.dist_data._get_recat(local_split, num_splits, stagger, device,
batch_size_per_rank)``. It is a function of those arguments alone, and it returns
``torch.tensor(a_python_list, device=cuda)``: a copy from pageable host memory, before which CUDA
synchronizes the stream. The host then waits for every kernel queued before it (on the big config,
the previous step's backward and optimizer step), and the device idles while the host launches what
comes next. ``torch.cuda.set_sync_debug_mode`` found two of them a step on the big config, one for
each sharded module; they are the only host syncs in its forward
(``benchmarks/results/e2e_ab.md``).

:func:`install` puts a cache in front of ``_get_recat``: the first call with given arguments makes the
tensor as torchrec does, later calls return that tensor. The permutation is read only (fbgemm's
permute operators take it as an index), and the cache holds it, so its memory is never handed to
another tensor. With variable batch sizes per rank (``batch_size_per_rank``) the shapes may not repeat:
the cache keeps the :data:`MAX_ENTRIES` used last. :func:`install` returns the function that takes the
cache out again.

``parallel.planner.options.cache_recat`` (``torchrec_ddp``) installs it for the process when the planner
applies its plan. On by default (None: wherever :func:`incompatibility` finds torchrec's function the one
this cache was written for; elsewhere the run goes on without it, with a warning; ``true`` makes that an
error, ``false`` turns it off). Measured with ``benchmarks/e2e_ab.py`` (switch ``recat_cache``) on the big
config: over steady steps (12 in a row, as a run trains) 1.011x (H200, seed 317), 1.011x (H200, seed
359; every round 1.008-1.013x), 1.009x (H200, seed 367; 1.005-1.011x), 1.010x (H100, seed 341); the device's
idle 2.5 % -> 1.5 % (H200) and 2.7 % -> 1.3 % (H100). Over paired steps, which restart from a device sync
each step and so cannot see what a host sync costs, 0.999-1.003x.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

MAX_ENTRIES = 256
"""Permutations kept (the least recently used goes first)."""
EXPECTED_PARAMETERS = ("local_split", "num_splits", "stagger", "device", "batch_size_per_rank")
"""``_get_recat``'s parameters, as torchrec 1.6 to 1.8 define them."""

_installed: list[tuple[Callable[..., Any], Callable[..., Any]]] = []
"""(torchrec's own function, the cache in front of it) while the cache is installed."""


def _dist_data() -> Any:
    from torchrec.distributed import dist_data

    return dist_data


def installed() -> bool:
    """Whether the cache is in front of torchrec's ``_get_recat`` now."""
    return bool(_installed)


def incompatibility() -> str | None:
    """Why the cache cannot go in front of this torchrec's ``dist_data._get_recat`` (it is missing, or its
    parameters differ from :data:`EXPECTED_PARAMETERS`), naming the torchrec version; None where it can."""
    if _installed:
        return None
    original = getattr(_dist_data(), "_get_recat", None)
    params = tuple(inspect.signature(original).parameters) if original is not None else None
    if params == EXPECTED_PARAMETERS:
        return None
    import torchrec

    return (f"cache_recat: torchrec {getattr(torchrec, '__version__', '?')}'s dist_data._get_recat has parameters "
            f"{params}, expected {EXPECTED_PARAMETERS}")  # fmt: skip


def install() -> Callable[[], None]:
    """Put the cache in front of ``torchrec.distributed.dist_data._get_recat``; return the function that
    takes it out (a no-op if it was already installed: the first caller's undo takes it out).

    Raises ``RuntimeError`` if torchrec's function is not the one this cache was written for
    (:func:`incompatibility`)."""
    dist_data = _dist_data()
    if _installed:
        return lambda: None
    reason = incompatibility()
    if reason is not None:
        raise RuntimeError(f"{reason}; turn parallel.planner.options.cache_recat off")
    original = dist_data._get_recat
    cache: OrderedDict[tuple, torch.Tensor | None] = OrderedDict()

    def cached_recat(local_split: int, num_splits: int, stagger: int = 1, device: torch.device | None = None,
                     batch_size_per_rank: list[int] | None = None) -> torch.Tensor | None:  # fmt: skip
        key = (local_split, num_splits, stagger, None if device is None else str(torch.device(device)),
               None if batch_size_per_rank is None else tuple(batch_size_per_rank))  # fmt: skip
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        cache[key] = made = original(local_split, num_splits, stagger, device, batch_size_per_rank)
        if len(cache) > MAX_ENTRIES:
            cache.popitem(last=False)
        return made

    cached_recat.cache = cache  # type: ignore[attr-defined]  # what the tests and a debugger read
    dist_data._get_recat = cached_recat
    _installed.append((original, cached_recat))

    def undo() -> None:
        if _installed and _installed[-1][1] is cached_recat:
            uninstall()

    return undo


def uninstall() -> Callable[[], None]:
    """Take the installed cache out, whoever put it in (the planner puts it in for the process); return
    the function that puts a new one back. A no-op pair where none is installed."""
    if not _installed:
        return lambda: None
    original, cached = _installed.pop()
    dist_data = _dist_data()
    if dist_data._get_recat is cached:
        dist_data._get_recat = original

    def reinstall() -> None:
        if not _installed:
            install()

    return reinstall
