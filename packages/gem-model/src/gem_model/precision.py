"""Precision as a policy of the whole model.

A run has one *activation dtype* (:class:`PrecisionPolicy.activation_dtype`): the dtype in which
activations flow between the model's ops. ``precision.activation_dtype: auto`` takes the one the
run's scheme declares (:attr:`gem_model.components.PrecisionScheme.activation_dtype`: bfloat16 for
the bf16, fp8 and MX schemes, float32 for fp32). Around it:

- parameters stay float32 master weights, and the optimizers' state stays float32;
- the model casts the embedding tables' outputs (and the dense features) to the activation dtype
  once, where they enter (:meth:`gem_model.model.gem.GemModel.set_activation_dtype`);
- every linear, norm, gate and attention kernel receives activations in that dtype. A linear that
  a scheme converted computes however the scheme says (bf16 GEMM, fp8 rowwise, MX blocks) and its
  output is cast back to the activation dtype if the scheme returned another one. A linear kept out
  of the scheme (``min_dim``, ``exclude``, an ``fp32`` override) becomes a :class:`KeptLinear`: it
  computes in float32 inside and accepts and returns the activation dtype;
- the float32 islands: the losses (BCE, the sampled softmax's logits and logsumexp), layer-norm
  statistics (the norm kernels accumulate in float32 for 16-bit inputs) and the mean pooling of
  sequence outputs.

It maps onto FSDP2 as ``MixedPrecisionPolicy(param_dtype=None, reduce_dtype=float32,
output_dtype=activation_dtype)`` (:meth:`PrecisionPolicy.fsdp_mixed_precision`): FSDP keeps and
all-gathers the float32 masters (each scheme casts per GEMM, as it does without FSDP), gradients are
reduced in float32, and a wrapped module's outputs come out in the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gem_model.components import PrecisionScheme
from gem_model.config import PrecisionConfig
from gem_model.protocols import ShardableModel

ACTIVATION_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """What the run's precision config resolved to."""

    activation_dtype: torch.dtype
    scheme: str
    plan: dict[str, str | None] = field(default_factory=dict)
    """Dense linear name -> scheme name (None: kept, computed in float32)."""

    def fsdp_mixed_precision(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.distributed.fsdp.MixedPrecisionPolicy`` for this policy."""
        return {"param_dtype": None, "reduce_dtype": torch.float32, "output_dtype": self.activation_dtype}

    def describe(self) -> str:
        kept = sorted(name for name, scheme in self.plan.items() if scheme is None)
        return (
            f"activations {str(self.activation_dtype).removeprefix('torch.')}, scheme {self.scheme}, "
            f"{len(self.plan) - len(kept)} linears converted, kept in float32: {', '.join(kept) or 'none'}"
        )


def activation_dtype_of(config: PrecisionConfig, schemes: dict[str, PrecisionScheme]) -> torch.dtype:
    """``precision.activation_dtype``, with ``auto`` resolved through the run's scheme."""
    name = config.activation_dtype
    if name == "auto":
        scheme = schemes[config.scheme.name]
        name = scheme.activation_dtype
        if name not in ACTIVATION_DTYPES:
            raise ValueError(
                f"precision.scheme {scheme.name!r} declares activation_dtype {name!r}; a scheme may declare "
                f"one of {sorted(ACTIVATION_DTYPES)}"
            )
    return ACTIVATION_DTYPES[name]


class KeptLinear(nn.Linear):
    """A linear left out of the scheme under a 16-bit activation dtype: float32 inside, the
    activation dtype outside. It takes over the original's Parameters, so names are unchanged."""

    def __init__(self, linear: nn.Linear, activation_dtype: torch.dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.activation_dtype = activation_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(self.activation_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kept in {self.weight.dtype} (activations {self.activation_dtype})"


def _cast_output(dtype: torch.dtype):
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def set_submodule(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def precision_plan(model: nn.Module, config: PrecisionConfig) -> dict[str, str | None]:
    """Module name -> scheme name (None: left as is) for every dense linear of the model (those
    outside its table modules, :meth:`gem_model.protocols.ShardableModel.table_modules`)."""
    tables = tuple(f"{name}." for name in model.table_modules()) if isinstance(model, ShardableModel) else ()
    plan: dict[str, str | None] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or (tables and fqn.startswith(tables)):
            continue
        override = next((name for pat, name in config.overrides.items() if fnmatchcase(fqn, pat)), None)
        if override is not None:
            plan[fqn] = override
        elif any(fnmatchcase(fqn, pat) for pat in config.exclude):
            plan[fqn] = None
        elif min(module.in_features, module.out_features) < config.min_dim:
            plan[fqn] = None
        else:
            plan[fqn] = config.scheme.name
    return plan


def apply_precision(
    model: nn.Module,
    config: PrecisionConfig,
    schemes: dict[str, PrecisionScheme],
    device: torch.device | None = None,
) -> PrecisionPolicy:
    """Convert the model's dense linears and set its activation dtype; returns the policy.

    With ``device``, each scheme checks its converted modules can run there
    (:meth:`PrecisionScheme.check_module`), so a run that cannot is refused before training."""
    dtype = activation_dtype_of(config, schemes)
    plan = precision_plan(model, config)
    for fqn, scheme_name in plan.items():
        linear = model.get_submodule(fqn)
        converted = linear if scheme_name is None else schemes[scheme_name].convert_linear(linear, fqn)
        if device is not None and scheme_name is not None:
            try:
                schemes[scheme_name].check_module(converted, fqn, device)
            except (ValueError, RuntimeError) as exc:
                raise ValueError(f"precision: {fqn} under scheme {scheme_name!r} cannot run on {device}: {exc}") from None
        if type(converted) is nn.Linear:  # kept (or an fp32 scheme that returns it unchanged)
            if dtype != converted.weight.dtype:
                converted = KeptLinear(converted, dtype)
        else:  # a scheme's own module: whatever dtype it returns, the model continues in `dtype`
            converted.register_forward_hook(_cast_output(dtype))
        if converted is not linear:
            set_submodule(model, fqn, converted)
    set_dtype = getattr(model, "set_activation_dtype", None)
    if set_dtype is not None:
        set_dtype(dtype)
    elif dtype != torch.float32:
        raise ValueError(
            f"precision: activation dtype {dtype} needs a model with set_activation_dtype(); "
            f"{type(model).__name__} has none"
        )
    return PrecisionPolicy(activation_dtype=dtype, scheme=config.scheme.name, plan=plan)
