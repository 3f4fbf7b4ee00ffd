"""Each package stands on its own: the core imports no plugin package, a plugin no sibling but gem_model,
and of gem_model only its public door, ``gem_model.api`` (and ``gem_model.testing`` in tests)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"gem_model", "gem_kernels", "gem_precision", "gem_parallel", "gem_comm"}
PLUGINS = ("gem-kernels", "gem-precision", "gem-parallel", "gem-comm")
PUBLIC = {"gem_model.api", "gem_model.testing"}
PLUGIN_MODULES = sorted(
    [p for pkg in PLUGINS for p in (ROOT / "packages" / pkg / "src").rglob("*.py")]
    + list((ROOT / "examples" / "gem-plugin-example" / "src").rglob("*.py"))
)


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value.split(".")[0])
    return names


def offenders(package: str, allowed: set[str], where: str) -> list[str]:
    found = []
    for path in sorted((ROOT / "packages" / package / where).rglob("*.py")):
        bad = (imported_top_levels(path) & OURS) - allowed
        found += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(bad)]
    return found


def core_modules_imported(path: Path) -> set[str]:
    """Every ``gem_model`` module ``path`` imports (``from gem_model import x`` counts as ``gem_model``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return {n for n in names if n == "gem_model" or n.startswith("gem_model.")}


@pytest.mark.parametrize("path", PLUGIN_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugin_module_uses_only_the_public_api(path):
    assert core_modules_imported(path) - PUBLIC == set(), "import it from gem_model.api (docs/plugins.md)"


def test_the_public_api_scan_sees_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "from gem_model import hookimpl\nfrom gem_model.api import Layout\nimport gem_model.layout\n"
        "def f():\n    from gem_model.config import RunConfig\n"
    )
    assert core_modules_imported(sample) - PUBLIC == {"gem_model", "gem_model.layout", "gem_model.config"}
    assert len(PLUGIN_MODULES) > 40  # every module of the four packages and the example


def test_core_imports_no_plugin_package():
    assert offenders("gem-model", {"gem_model"}, "src") == []
    assert offenders("gem-model", {"gem_model"}, "tests") == []


@pytest.mark.parametrize("package", ["gem-kernels", "gem-precision", "gem-parallel", "gem-comm"])
def test_plugin_package_imports_only_itself_and_the_core(package):
    own = package.replace("-", "_")
    assert offenders(package, {own, "gem_model"}, "src") == []
    assert offenders(package, {own, "gem_model"}, "tests") == []


def test_the_scan_sees_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import gem_kernels.plugin\nfrom gem_comm import x\nimport importlib\nimportlib.import_module('gem_precision.mx')\n")
    assert imported_top_levels(sample) >= {"gem_kernels", "gem_comm", "gem_precision"}


def test_plugin_modules_hold_hookimpls_only():
    for package in ("gem-kernels", "gem-precision", "gem-parallel", "gem-comm"):
        tree = ast.parse((ROOT / "packages" / package / "src" / package.replace("-", "_") / "plugin.py").read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                assert any(d.startswith("hookimpl") for d in decorators), f"{package}: {node.name} is not a hookimpl"
            else:
                assert isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)), f"{package}: plugin.py holds {ast.dump(node)[:60]}"
