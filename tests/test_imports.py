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


def top_level_names(module: Path) -> set[str]:
    """What `from <module> import NAME` can take: its top-level definitions, assignments and imports."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Try, ast.If)):
            names |= {a.asname or a.name for n in ast.walk(node) if isinstance(n, ast.ImportFrom) for a in n.names}
    return names


def unresolved_imports(path: Path, root: Path = REPO) -> list[str]:
    """Each `from cifar_wrn[.x] import NAME` or `import cifar_wrn.x` in `path` whose module or name the package
    in `root` lacks: a module moved or a name renamed without its users."""
    package, problems = root / "cifar_wrn", []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "cifar_wrn":
            where = Path(package.parent, *node.module.split("."))
            module = where / "__init__.py" if where.is_dir() else where.with_suffix(".py")
            if not module.is_file():
                problems.append(f"{path.name}:{node.lineno}: no module {node.module}")
                continue
            for alias in node.names:
                if alias.name not in top_level_names(module) and not (where / f"{alias.name}.py").is_file():
                    problems.append(f"{path.name}:{node.lineno}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cifar_wrn."):
                    where = Path(package.parent, *alias.name.split("."))
                    if not (where.with_suffix(".py").is_file() or where.is_dir()):
                        problems.append(f"{path.name}:{node.lineno}: no module {alias.name}")
    return problems


def test_every_import_of_the_package_resolves():
    """The trainers, course/, bench/ and tests/ (their sitecustomize folders included, whose failed imports Python
    only prints) import only what the package has; tests that start processes would find it late, or never."""
    files = [*REPO.glob("*.py"), *(REPO / "course").glob("*.py"), *(REPO / "bench").glob("*.py")]
    files += [*(REPO / "tests").glob("*.py"), *(REPO / "tests").glob("*/sitecustomize.py")]
    assert [problem for path in files for problem in unresolved_imports(path)] == []


def test_the_import_check_sees_a_moved_module_and_a_renamed_name(tmp_path):
    (tmp_path / "cifar_wrn").mkdir()
    (tmp_path / "cifar_wrn" / "__init__.py").write_text("")
    (tmp_path / "cifar_wrn" / "cli.py").write_text("from .launchers import free_port\n\ndef parse():\n    pass\n")
    user = tmp_path / "user.py"
    user.write_text(
        "from cifar_wrn.cli import parse, free_port, gone\nfrom cifar_wrn import cli, data\nimport cifar_wrn.pipeline\n"
    )
    assert unresolved_imports(user, tmp_path) == [
        "user.py:1: cifar_wrn.cli has no gone",
        "user.py:2: cifar_wrn has no data",
        "user.py:3: no module cifar_wrn.pipeline",
    ]
