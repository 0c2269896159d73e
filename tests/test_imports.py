"""The modules of cifar_wrn/ import each other without a circle (issue 28): errors.py is the ground floor,
and no module imports one that imports it back, directly or through others. Read from the source with ast,
imports inside functions included (a deferred import hides a circle, it does not remove it)."""

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "cifar_wrn"


def imported_modules(path: Path, modules: set) -> set:
    """The package's modules that `path` imports: `from . import x`, `from .x import y`, `import cifar_wrn.x`,
    `from cifar_wrn.x import y`, `from cifar_wrn import x`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("cifar_wrn.")]
            found |= {name.split(".")[1] for name in names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("cifar_wrn"):
                continue
            module = (node.module or "").removeprefix("cifar_wrn").lstrip(".") if node.level == 0 else node.module
            if module:
                found.add(module.split(".")[0])
            else:  # from . import x, y (or from cifar_wrn import x, y): x and y may be modules
                found |= {alias.name for alias in node.names}
    return (found & modules) - {path.stem}


def import_graph() -> dict:
    paths = sorted(PACKAGE.glob("*.py"))
    modules = {p.stem for p in paths}
    return {p.stem: imported_modules(p, modules) for p in paths}


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
    assert "resilience" in graph["progress"] and "errors" in graph["resilience"]  # the graph is read at all
    assert "report_pdf" in graph["report"]  # report.main lays its PDF out through report_pdf, never the reverse
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
