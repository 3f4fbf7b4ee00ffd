"""bfloat16 copies of float32 master parameters, made once per change of the parameters and all at once.

The ``bf16`` scheme's linear casts its float32 weight and bias at every call: two small kernels per
linear per forward (72 on the H200's big config), each launched while the host walks the model. Where
the host falls behind the device, each of them is a point where the device waits (``aten::copy_`` in
the forward is 2 ms of idle a step in e2e_ab's profile of 2026-12-04). With a :class:`CastCache`,
every linear of a model shares one set of copies: the first linear that finds its parameter changed
(the optimizer stepped, a checkpoint was loaded, the model moved) remakes every stale copy on that
device in one ``torch._foreach_copy_``; until the parameters change again each call just reads them.

A parameter counts as changed when any optimizer has stepped since its copy was made (a global
post-step hook: torch's fused AdamW, the one the trainer uses on a GPU, updates parameters without
bumping their version counters), or when its version counter (in-place updates through autograd's view
of it: ``load_state_dict``'s copies, ``torch.no_grad()`` arithmetic) or its storage (``module.to``,
``param.data = ...``) differs from what the copy was made from. What none of these sees is an in-place
change through ``param.data`` outside an optimizer step; code that does that between two forwards
must turn :data:`gem_precision.bf16_linear.CAST_ONCE` off. A copy is remade in place, so a graph that
saved it before the parameter changed would see autograd's "modified by an inplace operation" error
rather than wrong gradients.

A parameter is looked up as the registered object, or through the alias that
:func:`gem_model.api.bias_grad_elsewhere` lends a linear in its bias's place (``lent_from``: same
storage, so always the parameter's value); the copy read is the parameter's, and so is its staleness.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from gem_model.api import lent_from

_optimizer_steps = 0
_hook: Any = None


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizers() -> None:
    """Count every optimizer step of the process (registered once, by the first cache)."""
    global _hook
    if _hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook = register_optimizer_step_post_hook(_count_step)


class CastCache:
    """Copies of registered parameters in ``dtype``, remade together when any of them is stale."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self._params: list[torch.Tensor] = []
        self._copies: list[torch.Tensor | None] = []
        self._made_from: list[tuple[int, int, int] | None] = []  # (optimizer steps, address, version) at the copy
        self._slot: dict[int, int] = {}
        self.refreshes = 0
        """How many times copies were remade (each time, every stale one at once)."""
        _watch_optimizers()

    def add(self, param: torch.Tensor | None) -> None:
        """Register ``param`` (idempotent; None is ignored)."""
        if param is None or id(param) in self._slot:
            return
        self._slot[id(param)] = len(self._params)
        self._params.append(param)
        self._copies.append(None)
        self._made_from.append(None)

    def find(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param`` in ``dtype``, as of its current value (no autograd history: a constant of the graph),
        where ``param`` is a registered parameter or the alias lent in its place (module docstring); else None."""
        slot = self._slot.get(id(lent_from(param)))
        if slot is None:
            return None
        if self._stale(slot):
            self._refresh(self._params[slot].device)
        copy = self._copies[slot]
        assert copy is not None
        return copy

    def get(self, param: torch.Tensor) -> torch.Tensor:
        """:meth:`find`, raising ``KeyError`` for a tensor that is neither a registered parameter nor an alias of one."""
        copy = self.find(param)
        if copy is None:
            raise KeyError(f"CastCache.get: a parameter of shape {tuple(param.shape)} was never added")
        return copy

    def _stale(self, slot: int) -> bool:
        p = self._params[slot]
        return self._made_from[slot] != (_optimizer_steps, p.data_ptr(), p._version)

    def _refresh(self, device: torch.device) -> None:
        """Remake every stale copy of a parameter on ``device`` (one foreach copy per source dtype)."""
        groups: dict[torch.dtype, list[int]] = defaultdict(list)
        for slot, p in enumerate(self._params):
            if p.device == device and self._stale(slot):
                groups[p.dtype].append(slot)
        with torch.no_grad():
            for slots in groups.values():
                for slot in slots:
                    p, copy = self._params[slot], self._copies[slot]
                    if copy is None or copy.shape != p.shape or copy.device != p.device:
                        self._copies[slot] = torch.empty(p.shape, dtype=self.dtype, device=p.device)
                sources = [self._params[s].detach() for s in slots]
                torch._foreach_copy_([self._copies[s] for s in slots], sources)  # type: ignore[misc]
                for slot in slots:
                    p = self._params[slot]
                    self._made_from[slot] = (_optimizer_steps, p.data_ptr(), p._version)
        self.refreshes += 1
