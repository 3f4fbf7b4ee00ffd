"""Why the tune search skips a candidate without running it: what the device or the profile says
before any training run. A precision scheme whose GEMMs run in more bits than the configured one's
cannot be faster on a GPU (:func:`wider_gemms`); one the profile's ``numerics`` section measured
emulated or slower on this device cannot either (:func:`slower_here`); and no activation policy
can win while the configured one fits the memory budget (:func:`pruned`). Each returns the reason
recorded as the candidate's ``skipped``, or None. Used by :mod:`gem_model.tune.search`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gem_model.components import GEMM_BITS

if TYPE_CHECKING:
    from gem_model.config import RunConfig
    from gem_model.plugins import GemPluginManager
    from gem_model.profiling.report import ProfileReport


def wider_gemms(config: RunConfig, overrides: dict[str, Any], pm: GemPluginManager, device: torch.device) -> str | None:
    """Why a ``precision.scheme`` candidate cannot be faster on ``device``, or None: on a GPU, GEMMs in
    more bits than the configured scheme's run at a lower tensor-core rate (fp32: no tensor cores, and
    fp32 activations double every activation's bytes). On a CPU nothing is assumed."""
    name = overrides.get("precision.scheme")
    if name is None or device.type != "cuda":
        return None
    bits = GEMM_BITS
    mine = pm.precision_schemes.get(config.precision.scheme.name).cls.gemm_dtype
    theirs = pm.precision_schemes.get(name).cls.gemm_dtype
    if bits.get(theirs, 0) <= bits.get(mine, 0):
        return None
    return (f"not measured: {name}'s GEMMs run in {theirs}, more bits than {config.precision.scheme.name}'s "
            f"{mine}; on a GPU that cannot be faster")


def slower_here(
    config: RunConfig, overrides: dict[str, Any], profile: ProfileReport | None, device: torch.device
) -> str | None:
    """Why the profile's ``numerics`` section says a ``precision.scheme`` candidate cannot be faster on
    ``device``, or None: only a profile taken on this device, from the same configured scheme."""
    name = overrides.get("precision.scheme")
    if name is None or profile is None or not profile.has("numerics"):
        return None
    numerics = profile.section("numerics").summary
    measured = numerics.get("rates", {}).get("schemes", {}).get(name)
    here = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    profiled = (profile.config.get("precision") or {}).get("scheme", {}).get("name")
    if measured is None or profile.device != here or profiled != config.precision.scheme.name:
        return None
    if measured.get("emulated"):
        return f"not measured: {name} runs emulated on this device (the profile's numerics section: {measured.get('why')})"
    gain = numerics.get("scheme_gain_s_per_step", {}).get(name)
    if gain is None or gain > 0:
        return None
    return (f"not measured: the profile's numerics section measured {name}'s linears slower here than "
            f"{profiled}'s ({-1e3 * gain:.2f} ms a step more)")  # fmt: skip


def pruned(dimension: str, config: RunConfig, profile: ProfileReport | None, memory_gb: float | None) -> str | None:
    """Why the profile says no candidate of ``dimension`` can win, or None."""
    if dimension != "activation policy" or memory_gb is None or profile is None or not profile.has("memory"):
        return None
    memory = profile.section("memory").summary
    if memory.get("status") is not None:  # the memory section was cut off or failed
        return None
    saved = memory.get("activations", {}).get(config.activation.policy.name, {}).get("saved")
    if saved is None:
        return None
    measured = memory.get("measured_peak")
    need = measured if measured is not None else memory["parameters"] + memory["gradients"] + memory["optimizer"] + saved
    if need / 1e9 > memory_gb:
        return None
    what = "measured peak" if measured is not None else "estimated static + saved activations"
    return (f"not measured: activation.policy {config.activation.policy.name} fits --memory-gb {memory_gb:g} "
            f"({what} {need / 1e9:.1f} GB, profile's memory section); another policy only trades speed for memory")
