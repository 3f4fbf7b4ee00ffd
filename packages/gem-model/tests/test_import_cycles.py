"""No import cycles between modules, counting every import: at module level, under
``if TYPE_CHECKING:`` and inside functions. A deferred import still ties two modules together; it
only hides the cycle from the interpreter. Every package's sources are scanned together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def module_graph(roots: list[Path]) -> dict[str, set[str]]:
    files: dict[str, Path] = {}
    for root in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    roots = sorted((ROOT / "packages").glob("*/src"))
    graph = module_graph(roots)
    assert "gem_model.components" in graph and "gem_model.context" in graph
    assert cycles(graph) == []


def test_the_check_sees_a_cycle_hidden_by_type_checking(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import A\nB = 1\n")
    (pkg / "c.py").write_text("def f():\n    from p.d import D\n")
    (pkg / "d.py").write_text("import p.c\nD = 1\n")
    graph = module_graph([tmp_path])
    assert cycles(graph) == [["p.a", "p.b"], ["p.c", "p.d"]]  # a deferred import is an edge too
