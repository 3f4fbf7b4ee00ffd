"""gem-precision's plugin: registers its precision schemes and activation policies, and adds the
``precision`` profile subcommand and the ``numerics`` profile section.

Hook implementations only; importing this module imports neither Triton nor anything CUDA-specific.
"""

from __future__ import annotations

from gem_model.api import ActivationPolicy, PrecisionScheme, ProfileCommand, ProfileContext, ProfileSection, hookimpl


@hookimpl
def gem_register_precision_schemes() -> list[type[PrecisionScheme]]:
    from gem_precision.schemes import SCHEMES

    return list(SCHEMES)


@hookimpl
def gem_register_activation_policies() -> list[type[ActivationPolicy]]:
    from gem_precision.activation import POLICIES

    return list(POLICIES)


@hookimpl
def gem_profile_commands() -> list[ProfileCommand]:
    from gem_precision.profile import COMMAND

    return [COMMAND]


@hookimpl
def gem_profile_sections(profile: ProfileContext) -> list[ProfileSection]:
    from gem_precision.profile import numerics_section

    return [numerics_section(profile)] if profile.wants("numerics") else []


@hookimpl
def gem_profile_section_names() -> list[str]:
    return ["numerics"]
