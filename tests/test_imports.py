"""The modules of cifar_wrn/ import each other without a circle: errors.py is the ground floor,
and no module imports one that imports it back, directly or through others. Read from the source with ast,
imports inside functions included (a deferred import hides a circle, it does not remove it)."""

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "cifar_wrn"


def module_name(path: Path) -> str:
    """The module's name inside the package: "data", "report" (report/__init__.py), "report.pdf"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set) -> set:
    """The package's modules that `path` imports: `from . import x`, `from .x import y`, `from ..x import y`,
    `import cifar_wrn.x`, `from cifar_wrn.x import y`, `from cifar_wrn import x`."""
    name = module_name(path) if path.is_relative_to(PACKAGE) else path.stem
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {
                alias.name.removeprefix("cifar_wrn.") for alias in node.names if alias.name.startswith("cifar_wrn.")
            }
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("cifar_wrn"):
                continue
            if node.level == 0:
                base = (node.module or "").removeprefix("cifar_wrn").lstrip(".")
            else:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}".lstrip(".") for alias in node.names] + [base]
            found |= {next((m for m in (t, t.split(".")[0]) if m in modules), None) for t in targets if t}
    return (found & modules) - {name}


def import_graph() -> dict:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def find_cycle(graph: dict) -> list | None:
    """One import circle as [a, b, ..., a], or None (depth-first search)."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return stack[stack.index(other) :] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_circle_in_cifar_wrn():
    graph = import_graph()
    assert "resilience" in graph["bars"] and "errors" in graph["resilience"]  # the graph is read at all
    assert "report.pdf" in graph["report.cli"]  # the report lays its PDF out through report/pdf.py, never the reverse
    # pdf.py reads only content.py and columns.py of the report (and the package, a docstring, as any submodule)
    assert graph["report.pdf"] == {"errors", "report", "report.columns", "report.content"}
    assert graph["report"] == graph["report.content"] == graph["report.columns"] == set()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_errors_is_the_ground_floor():
    assert import_graph()["errors"] == set()


def test_the_cycle_finder_finds_circles(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    (tmp_path / "m.py").write_text(
        "def f():\n    from .progress import close_all\nimport cifar_wrn.data\n"
        "from cifar_wrn import model, os\nfrom os import path\n"
    )
    assert imported_modules(tmp_path / "m.py", {"progress", "data", "model", "m"}) == {"progress", "data", "model"}
