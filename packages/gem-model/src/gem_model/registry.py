"""String-keyed registries of component classes, with the provenance of every name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from gem_model.components import NAME_PATTERN, Component
from gem_model.errors import DuplicateNameError, UnknownNameError

C = TypeVar("C", bound=type[Component])

# Which of our plugin distributions provides each name, so that a run whose config names a component
# nobody installed can say what to install. Only a hint: the registries decide. The core cannot read
# the entry points of a package that is not installed, so the list is kept here and a test
# (tests/test_readme_packages.py) checks it against what the installed packages register. Names
# gem-model registers itself (kernel next_item_loss torch, data source synthetic, ...) are never
# missing, so they have no hint.
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    ("kernel jagged_attention", "torch"): "gem-kernels",
    ("kernel jagged_attention", "triton"): "gem-kernels",
    ("kernel norm_gate", "torch"): "gem-kernels",
    ("kernel norm_gate", "triton"): "gem-kernels",
    ("kernel next_item_loss", "triton"): "gem-kernels",
    ("kernel sequence_input", "triton"): "gem-kernels",
    ("kernel sequence_pool", "triton"): "gem-kernels",
    ("precision scheme", "fp32"): "gem-precision",
    ("precision scheme", "bf16"): "gem-precision",
    ("precision scheme", "fp8_tensorwise"): "gem-precision",
    ("precision scheme", "fp8_rowwise"): "gem-precision",
    ("precision scheme", "mxfp8"): "gem-precision",
    ("activation policy", "none"): "gem-precision",
    ("activation policy", "checkpoint_full"): "gem-precision",
    ("activation policy", "checkpoint_selective"): "gem-precision",
    ("activation policy", "fp8_saved"): "gem-precision",
    ("comm strategy", "default"): "gem-comm",
    ("comm strategy", "overlap"): "gem-comm",
    ("comm strategy", "quantized"): "gem-comm",
    ("comm strategy", "hierarchical"): "gem-comm",
    ("comm strategy", "sm_free"): "gem-comm",
    ("callback", "comm_report"): "gem-comm",
    ("train pipeline", "sparse_dist"): "gem-comm",
    ("parallel planner", "single"): "gem-parallel",
    ("parallel planner", "torchrec_ddp"): "gem-parallel",
    ("parallel planner", "fsdp"): "gem-parallel",
    ("parallel planner", "auto"): "gem-parallel",
    ("load balancer", "seq_balanced"): "gem-parallel",
}


@dataclass(frozen=True)
class Provider:
    """Who registered a name: the plugin (as pluggy knows it) and its distribution."""

    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.version} (plugin {self.plugin})"


@dataclass(frozen=True)
class Entry(Generic[C]):
    cls: C
    provider: Provider


class Registry(Generic[C]):
    """Names to classes for one kind of component (e.g. precision schemes)."""

    def __init__(self, kind: str, config_path: str):
        self.kind = kind
        self.config_path = config_path
        self._entries: dict[str, Entry[C]] = {}
        self._clashes: dict[str, list[Provider]] = {}

    def add(self, cls: C, provider: Provider) -> None:
        """Add ``cls`` under its ``name``. A name two plugins register is a clash: it is kept out
        of the registry and only a run that selects it fails (:meth:`get`), naming both."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise TypeError(
                f"{provider} registered {cls!r} as a {self.kind} with name {name!r}: "
                "a name must be a lowercase snake_case string"
            )
        if name in self._clashes:
            self._clashes[name].append(provider)
        elif name in self._entries:
            self._clashes[name] = [self._entries.pop(name).provider, provider]
        else:
            self._entries[name] = Entry(cls, provider)

    def names(self) -> list[str]:
        """The names a config may select (a clashing name is not among them)."""
        return sorted(self._entries)

    def entries(self) -> dict[str, Entry[C]]:
        return dict(sorted(self._entries.items()))

    def clashes(self) -> dict[str, list[Provider]]:
        """Names registered by more than one plugin, with every provider, in registration order."""
        return {k: list(v) for k, v in sorted(self._clashes.items())}

    def clash_message(self, name: str) -> str:
        by = " and by ".join(str(p) for p in self._clashes[name])
        return (
            f"{self.config_path}: {self.kind} {name!r} is registered twice: by {by}; "
            "uninstall one of the distributions or rename one"
        )

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> Entry[C]:
        if name in self._clashes:
            raise DuplicateNameError(self.clash_message(name))
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        lines = [f"{self.config_path}: unknown {self.kind} {name!r}."]
        hint = KNOWN_PROVIDERS.get((self.kind, name))
        if hint:
            lines.append(f"  {name!r} is provided by {hint}, which is not installed: pip install {hint}")
        if self._entries:
            lines.append("  available:")
            lines += [f"    {n}: from {e.provider}" for n, e in self.entries().items()]
        else:
            lines.append(f"  no {self.kind} is installed.")
        return "\n".join(lines)
