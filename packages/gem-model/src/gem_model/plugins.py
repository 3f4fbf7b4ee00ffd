"""The plugin manager: loads plugins, checks their hooks, and builds the registries.

Built-in components (in :mod:`gem_model.builtin`) go through the same hooks as third-party ones.
Installed plugin packages are found through the entry-point group ``gem`` unless the environment
variable ``GEM_DISABLE_PLUGIN_AUTOLOAD`` is set to a non-empty value other than ``0``; then only
plugins registered explicitly (``GemPluginManager(plugins=...)`` or :meth:`register`) are used.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from types import TracebackType
from typing import Any

import pluggy

from gem_model import hookspecs
from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    Component,
    DataSource,
    Kernel,
    LoadBalancer,
    ParallelPlanner,
    PrecisionScheme,
)
from gem_model.errors import PluginError
from gem_model.lifecycle import Callback, TrainPipeline
from gem_model.markers import ENTRY_POINT_GROUP, PROJECT_NAME
from gem_model.registry import Provider, Registry

AUTOLOAD_ENV = "GEM_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "GEM_PLUGINS"  # comma-separated plugin modules to register by import path
BUILTIN_PLUGIN = "model"  # also the name of gem-model's own entry point


@dataclass(frozen=True)
class RegistrySpec:
    hook: str
    kind: str
    config_path: str
    base: type[Component]


# attribute name on GemPluginManager -> how it is filled
REGISTRY_SPECS: dict[str, RegistrySpec] = {
    "precision_schemes": RegistrySpec(
        "gem_register_precision_schemes", "precision scheme", "precision.scheme", PrecisionScheme
    ),
    "activation_policies": RegistrySpec(
        "gem_register_activation_policies", "activation policy", "activation.policy", ActivationPolicy
    ),
    "comm_strategies": RegistrySpec(
        "gem_register_comm_strategies", "comm strategy", "comm.strategy", CommStrategy
    ),
    "parallel_planners": RegistrySpec(
        "gem_register_parallel_planners", "parallel planner", "parallel.planner", ParallelPlanner
    ),
    "data_sources": RegistrySpec("gem_register_data_sources", "data source", "data.source", DataSource),
    "load_balancers": RegistrySpec(
        "gem_register_load_balancers", "load balancer", "data.balancer", LoadBalancer
    ),
    "train_pipelines": RegistrySpec(
        "gem_register_train_pipelines", "train pipeline", "trainer.pipeline", TrainPipeline
    ),
    "callbacks": RegistrySpec("gem_register_callbacks", "callback", "callbacks", Callback),
}
KERNEL_HOOK = "gem_register_kernels"
# Hooks that act on a run. An installed plugin module may not implement them directly: it would
# run in every run without being asked; a Callback class the config names does it instead.
LIFECYCLE_HOOKS = ("gem_run_started", "gem_train_step", "gem_run_finished", "gem_report_sections")


def autoload_enabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "") in ("", "0")


class GemPluginManager:
    """A pluggy manager for project ``gem`` plus the registries built from its plugins."""

    def __init__(self, *, autoload: bool | None = None, plugins: Iterable[object] = ()):
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._providers: dict[str, Provider] = {}
        self._registries: dict[str, Any] | None = None
        from gem_model import __about__, builtin

        self.register(builtin, name=BUILTIN_PLUGIN, distribution=("gem-model", __about__.__version__))
        if autoload_enabled() if autoload is None else autoload:
            self._load_entry_points()
        self._load_env_plugins()
        for plugin in plugins:
            self.register(plugin)
        self.pm.check_pending()

    # ------------------------------------------------------------------------------------ loading

    def register(
        self, plugin: object, name: str | None = None, distribution: tuple[str, str] | None = None
    ) -> str:
        """Register a plugin object (module or instance). Returns the name pluggy knows it by."""
        registered = self.pm.register(plugin, name=name)
        if registered is None:
            raise PluginError(f"plugin {name or plugin!r} is blocked or already registered")
        dist, version = distribution or ("<inline>", "-")
        self._providers[registered] = Provider(registered, dist, version)
        self._registries = None
        self.pm.check_pending()
        return registered

    def _load_entry_points(self) -> None:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown distribution>"
            version = dist.version if dist is not None else "-"
            if self.pm.get_plugin(ep.name) is not None or self.pm.is_blocked(ep.name):
                continue  # gem-model's own entry point: its built-ins are registered already
            try:
                module = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} of distribution {dist_name} {version} failed to import "
                    f"({ep.value}): {type(exc).__name__}: {exc}"
                ) from exc
            _refuse_lifecycle_hooks(module, f"plugin {ep.name!r} of distribution {dist_name} {version}")
            self.register(module, name=ep.name, distribution=(dist_name, version))

    def _load_env_plugins(self) -> None:
        """Plugins named in ``GEM_PLUGINS`` (for code on ``PYTHONPATH`` that pip never installed)."""
        for module_name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                top = module_name.split(".")[0]
                owners = metadata.packages_distributions().get(top, [])  # as for a module that imports
                raise PluginError(
                    f"plugin module {module_name!r} of distribution {owners[0] if owners else f'{top} ({PLUGINS_ENV})'} "
                    f"named in {PLUGINS_ENV} failed to import: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if self.pm.is_registered(module):
                continue
            top = module_name.split(".")[0]
            dists = metadata.packages_distributions().get(top, [])
            dist = dists[0] if dists else f"{top} ({PLUGINS_ENV})"
            version = getattr(importlib.import_module(top), "__version__", "-")
            _refuse_lifecycle_hooks(module, f"plugin module {module_name!r} named in {PLUGINS_ENV}")
            self.register(module, name=module_name, distribution=(dist, str(version)))

    # ---------------------------------------------------------------------------------- inspection

    def provider(self, plugin_name: str) -> Provider:
        return self._providers[plugin_name]

    def hooks_by_plugin(self) -> dict[str, list[str]]:
        """Plugin name -> the hooks it implements (``gem-train plugins`` shows them)."""
        out: dict[str, list[str]] = {name: [] for name in self._providers}
        for hook_name in sorted(vars(self.pm.hook)):
            caller = getattr(self.pm.hook, hook_name)
            if not hook_name.startswith("gem_") or not hasattr(caller, "get_hookimpls"):
                continue
            for impl in caller.get_hookimpls():
                out.setdefault(impl.plugin_name, []).append(hook_name)
        return out

    @contextlib.contextmanager
    def callbacks_registered(self, callbacks: dict[str, Callback]) -> Iterator[None]:
        """Register the run's callback instances (by their config name) for the duration of a run."""
        names = []
        try:
            for name, callback in callbacks.items():
                provider = self.callbacks.get(name).provider
                names.append(self.register(callback, name=f"callback:{name}", distribution=(provider.distribution, provider.version)))
            yield
        finally:
            for name in names:
                self.pm.unregister(name=name)
                self._providers.pop(name, None)

    def distributions(self) -> dict[tuple[str, str], list[str]]:
        """(distribution, version) -> names of its registered plugins."""
        out: dict[tuple[str, str], list[str]] = {}
        for p in self._providers.values():
            out.setdefault((p.distribution, p.version), []).append(p.plugin)
        return dict(sorted(out.items()))

    # ---------------------------------------------------------------------------------- registries

    def implementers(self, hook_name: str) -> list[str]:
        """The plugins implementing ``hook_name``, in pluggy's call order."""
        return [impl.plugin_name for impl in getattr(self.pm.hook, hook_name).get_hookimpls()]

    def call_plugin(self, hook_name: str, plugin_name: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of ``hook_name`` on its own (the caller then knows who
        returned what, and may time or skip each), with the ``kwargs`` it names; an exception becomes
        a :class:`PluginError` naming the plugin, its distribution and the hook."""
        impl = next(i for i in getattr(self.pm.hook, hook_name).get_hookimpls() if i.plugin_name == plugin_name)
        try:
            return impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
        except Exception as exc:
            provider = self._providers[plugin_name]
            raise PluginError(
                f"plugin {plugin_name!r} from distribution {provider.distribution} "
                f"{provider.version} raised in hook {hook_name}: {type(exc).__name__}: {exc}"
            ) from exc

    def _collect(self, hook_name: str) -> list[tuple[type, Provider]]:
        """Call every implementation of a registration hook on its own, to know who returned what."""
        return [
            (cls, self._providers[name])
            for name in self.implementers(hook_name)
            for cls in self.call_plugin(hook_name, name) or ()
        ]

    def _build(self) -> dict[str, Any]:
        regs: dict[str, Any] = {}
        for attr, spec in REGISTRY_SPECS.items():
            registry: Registry = Registry(spec.kind, spec.config_path)
            for cls, provider in self._collect(spec.hook):
                _check_class(cls, spec.base, spec.hook, provider)
                registry.add(cls, provider)
            regs[attr] = registry
        kernels: dict[str, Registry] = {}
        for cls, provider in self._collect(KERNEL_HOOK):
            _check_class(cls, Kernel, KERNEL_HOOK, provider)
            op = cls.op
            if op not in kernels:
                kernels[op] = Registry(f"kernel {op}", f"kernels.{op}")
            kernels[op].add(cls, provider)
        regs["kernels"] = kernels
        return regs

    @property
    def registries(self) -> dict[str, Any]:
        if self._registries is None:
            self._registries = self._build()
        return self._registries

    def __getattr__(self, attr: str) -> Any:
        if attr in REGISTRY_SPECS or attr == "kernels":
            return self.registries[attr]
        raise AttributeError(attr)

    def kernel_registry(self, op: str) -> Registry:
        """The registry of kernels for ``op`` (empty when nobody registered one)."""
        return self.registries["kernels"].get(op) or Registry(f"kernel {op}", f"kernels.{op}")

    # ------------------------------------------------------------------------------- calling hooks

    def call(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a lifecycle hook; an exception from a plugin becomes a :class:`PluginError`, except a device
        out of memory: the plugin that asked last is rarely the one that holds the memory."""
        hook = getattr(self.pm.hook, hook_name)
        try:
            return hook(**kwargs)
        except Exception as exc:
            torch = sys.modules.get("torch")  # imported by whatever allocated; not imported here for it
            if torch is not None and isinstance(exc, torch.OutOfMemoryError):
                raise
            culprit = self._culprit(hook_name, exc.__traceback__)
            if culprit is None:
                raise
            raise PluginError(
                f"plugin {culprit.plugin!r} from distribution {culprit.distribution} "
                f"{culprit.version} raised in hook {hook_name}: {type(exc).__name__}: {exc}"
            ) from exc

    def _culprit(self, hook_name: str, tb: TracebackType | None) -> Provider | None:
        codes: dict[object, str] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            codes[impl.function.__code__] = impl.plugin_name
        culprit = None
        while tb is not None:
            try:
                name = codes.get(tb.tb_frame.f_code)
            except TypeError:  # code that torch.compile generates can hold unhashable constants
                name = None
            if name is not None:
                culprit = name  # the innermost hook implementation on the stack raised
            tb = tb.tb_next
        if culprit is None or culprit == BUILTIN_PLUGIN:
            return None  # the core's own error: it needs no re-labelling
        return self._providers[culprit]


def _refuse_lifecycle_hooks(module: object, who: str) -> None:
    found = [h for h in LIFECYCLE_HOOKS if callable(getattr(module, h, None)) and hasattr(getattr(module, h), "gem_impl")]
    if found:
        raise PluginError(
            f"{who} implements the lifecycle hook(s) {', '.join(found)} at module level, so it would run in "
            "every run without being asked; move them onto a gem_model.lifecycle.Callback subclass returned "
            "from gem_register_callbacks, and name it in the run config's `callbacks` list"
        )


def _check_class(cls: object, base: type, hook: str, provider: Provider) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(
            f"plugin {provider.plugin!r} from distribution {provider.distribution} returned "
            f"{cls!r} from {hook}; expected a subclass of {base.__module__}.{base.__qualname__}"
        )

