"""gem-precision's plugin: registers its precision schemes and activation policies.

Hook implementations only; importing this module imports neither Triton nor anything CUDA-specific.
"""

from __future__ import annotations

from gem_model import hookimpl
from gem_model.components import ActivationPolicy, PrecisionScheme


@hookimpl
def gem_register_precision_schemes() -> list[type[PrecisionScheme]]:
    from gem_precision.schemes import SCHEMES

    return list(SCHEMES)


@hookimpl
def gem_register_activation_policies() -> list[type[ActivationPolicy]]:
    from gem_precision.activation import POLICIES

    return list(POLICIES)
