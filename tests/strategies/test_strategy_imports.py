"""Imports inside ``strategies/`` go one way: no cycle, and none held open by an import inside a function."""

import ast
from pathlib import Path

STRATEGIES = Path(__file__).resolve().parents[2] / "strategies"


def relative_imports(tree: ast.Module) -> set[str]:
    """The sibling modules a module imports (``from .x import ...``, ``from . import x``), wherever the import is."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else (alias.name for alias in node.names))
    return found


def test_no_sibling_import_inside_a_function():
    inside = []
    for path in sorted(STRATEGIES.glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [f"{path.name}:{node.lineno}" for node in ast.walk(function) if isinstance(node, ast.ImportFrom) and node.level]
    assert not inside, f"imports inside functions: {inside}"


def test_the_import_graph_has_no_cycle():
    graph = {path.stem: relative_imports(ast.parse(path.read_text())) - {"__init__"} for path in STRATEGIES.glob("*.py") if path.stem != "__init__"}
    assert {"base", "checks", "capture", "probe", "layout", "payload"} <= set(graph)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
