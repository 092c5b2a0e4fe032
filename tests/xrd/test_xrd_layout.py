"""The XRD verifier's import graph: the offline library builder stays offline, and no module cycle."""

from __future__ import annotations

import ast
from pathlib import Path

XRD = Path(__file__).parents[2] / "verifiers" / "xrd"
PACKAGE = "labrl.verifiers.xrd."


def _xrd_imports() -> dict[str, set[str]]:
    """{module: the labrl.verifiers.xrd modules it imports (anywhere in the file)}."""
    graph = {}
    for path in XRD.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                found.add(node.module.removeprefix(PACKAGE))
            elif isinstance(node, ast.Import):
                found |= {a.name.removeprefix(PACKAGE) for a in node.names if a.name.startswith(PACKAGE)}
        graph[path.stem] = found
    return graph


def test_no_runtime_module_imports_the_offline_builder():
    graph = _xrd_imports()
    assert "build_library" in graph
    assert sorted(m for m, deps in graph.items() if "build_library" in deps) == []


def test_the_xrd_modules_import_each_other_without_a_cycle():
    graph = _xrd_imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
