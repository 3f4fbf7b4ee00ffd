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

``parallel.planner.options.cache_recat`` (``torchrec_ddp``) installs it for a run. Off by default: on the
H200's big config (2026-12-05, ``benchmarks/e2e_ab.py`` switch ``recat_cache``) it gave 1.003x over paired
steps (not resolved) and 1.011x over steady steps; with the loss read at the tables, 1.030x steady
against 1.018x without it, and 1.0 % device idle.
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

_installed: list[Callable[..., Any]] = []  # torchrec's own function while the cache is in front of it


def _dist_data() -> Any:
    from torchrec.distributed import dist_data

    return dist_data


def installed() -> bool:
    """Whether the cache is in front of torchrec's ``_get_recat`` now."""
    return bool(_installed)


def install() -> Callable[[], None]:
    """Put the cache in front of ``torchrec.distributed.dist_data._get_recat``; return the function that
    takes it out (a no-op if it was already installed: the first caller's undo takes it out).

    Raises ``RuntimeError`` if torchrec's function is not the one this cache was written for (its
    parameters differ), naming the torchrec version."""
    dist_data = _dist_data()
    if _installed:
        return lambda: None
    original = getattr(dist_data, "_get_recat", None)
    params = tuple(inspect.signature(original).parameters) if original is not None else None
    if params != EXPECTED_PARAMETERS:
        import torchrec

        raise RuntimeError(
            f"cache_recat: torchrec {getattr(torchrec, '__version__', '?')}'s dist_data._get_recat has parameters "
            f"{params}, expected {EXPECTED_PARAMETERS}; turn parallel.planner.options.cache_recat off"
        )
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
    _installed.append(original)

    def uninstall() -> None:
        if _installed and dist_data._get_recat is cached_recat:
            dist_data._get_recat = _installed.pop()

    return uninstall
