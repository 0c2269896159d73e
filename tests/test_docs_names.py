"""Every function and class the docs name is where they say (after checkpoint.py, checksums.py and trainers.py
became checkpoints.py, raw_side.py and accel_side.py, the docs still named the old places).

The documents are the ones a student reads (README.md, docs/*.md); docs/record/ is history, docs/runs/ and
docs/report-example/ are generated. Outside fenced code, three checks:

- Files. A `.py` file the docs name, in backticks or not, exists: a path from the repository root, or a bare
  name somewhere in the tree.
- Names with their module, as the docs write them: `` `name` in `x.py` `` (or in x.py), `` `x.py`'s `name` ``,
  `` `x.py` (`name` `` and `` `name` (`x.py`) ``, `` `x.py` `name` ``, `` `x.name` `` and `` `cifar_wrn.x.name` ``
  (x a module of the package, an entry point, a course, bench or test script), `` `tests/x.py::test` ``. The
  module must define the name (read with ast): at its top level (a def, a class, an assignment), or as a member of
  one of its classes; `Class.member` must be a member of that class. A dotted `x.name` whose x is no module but
  whose name is a function or class of the package, or a method with a specific name (one with an underscore),
  is reported too: the form a moved function leaves behind (`trainers.save_and_stop`).
- Names alone. A backticked call (`name()`, `name(args)`) or CamelCase name (`Launcher`, `Checkpointer.resume`)
  is defined somewhere in raw_ddp.py, accel_train.py, cifar_wrn/, course/, bench/, tests/ or a slurm/ script,
  imported there from a library, a builtin, or in EXTERNAL; `Class.member` of a class of ours is its member.

Each checker takes the repository root and returns its problems, one line each; the last tests give it planted
wrong references in a small copy."""

import ast
import builtins
import re
from functools import cache
from pathlib import Path

from helpers import REPO
from test_docs import OTHER_PROJECTS, cited_paths, code_spans, file_names, prose_lines, read_docs, report

# Names the docs use that the code neither defines nor imports by name (it reaches them through their module, as
# nn.AvgPool2d, or not at all): library APIs, a Slurm setting, a field of `pip show`.
EXTERNAL = {
    "AvgPool2d", "ChildFailedError", "destroy_process_group", "state_dict",  # torch
    "PartialState", "SeedableRandomSampler",  # accelerate's classes that docs/accelerate.md points to
    "SafetensorError", "CalledProcessError", "Popen", "KillWait", "Location",
}  # fmt: skip
# The first part of a dotted name that is a library or an object (`recipe.seed`, `model.module`), not our module.
OBJECTS = {
    "torch", "dist", "accelerate", "accelerator", "os", "sys", "numpy", "multiprocessing", "model", "recipe",
    "sampler", "train_sampler", "train_loader",
}  # fmt: skip
STUDENT_FILES = {"my_cifar10.py"}  # the student's own script, which README.md's checklist has them write
FILE_ENDINGS = {"py", "log", "jsonl", "json", "txt", "pt", "pkl", "md", "yaml", "yml", "sh", "sbatch", "toml", "pdf"}
CODE_FOLDERS = ("cifar_wrn", "course", "bench", "tests")
SPAN = r"`([^`\n]+)`"
PY_FILE = r"[\w./-]*\w\.py"
FILE = rf"(?:`(?P<file>{PY_FILE})`|(?<![\w./`-])(?P<bare>{PY_FILE})(?![\w`]))"
# The forms that name a function or class with its module (group file or bare: the module; the other: the name).
WITH_MODULE = [
    re.compile(rf"{SPAN},? (?:in|inside|from) (?:the )?{FILE}"),  # `name` in `x.py`, `name` in x.py
    re.compile(rf"{FILE}['’]s {SPAN}"),  # `x.py`'s `name`, x.py's `name`
    re.compile(rf"{FILE} \({SPAN}"),  # `x.py` (`name`, ...)
    re.compile(rf"{SPAN} \({FILE}\)"),  # `name` (`x.py`)
    re.compile(rf"`(?P<file>{PY_FILE})` {SPAN}"),  # `x.py` `name`
]
CALL_OR_NAME = re.compile(r"^([A-Za-z_]\w*(?:\.\w+)*)(\(.*\))?$")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)*$")


class Module:
    """What one Python file defines: its top-level names, and each class's members (methods, class-level
    assignments, self.<name> assignments in its methods)."""

    def __init__(self, path: Path, relative: str):
        self.path = relative
        tree = ast.parse(path.read_text(), str(path))
        self.top: set[str] = set()
        self.classes: dict[str, set[str]] = {}
        for node in self._statements(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.top.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.top.add(node.name)
                self.classes[node.name] = members(node)
            else:
                self.top.update(assigned(node))

    @staticmethod
    def _statements(body):
        for node in body:
            yield node
            if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    yield from Module._statements(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    yield from Module._statements(handler.body)

    def defines(self, name: str) -> bool:
        """`f`, `Class`, `Class.member` (or deeper: only the first two parts are checked), or a class member."""
        first, _, rest = name.partition(".")
        if first in self.top:
            return first not in self.classes or not rest or rest.split(".")[0] in self.classes[first]
        return not rest and any(first in found for found in self.classes.values())


def assigned(node) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def members(cls: ast.ClassDef) -> set[str]:
    found = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
            for inner in ast.walk(node):
                for target in getattr(inner, "targets", [getattr(inner, "target", None)]):
                    if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                        found.add(target.attr)
        else:
            found.update(assigned(node))
    return found


@cache
def by_path(root: Path) -> dict[str, Module]:
    """The Python files of the code, by their path from the root (sitecustomize hooks left out)."""
    paths = [root / "raw_ddp.py", root / "accel_train.py"]
    paths += [p for folder in CODE_FOLDERS for p in sorted((root / folder).glob("**/*.py"))]
    return {
        str(p.relative_to(root)): Module(p, str(p.relative_to(root)))
        for p in paths
        if p.is_file() and p.name != "sitecustomize.py"
    }


@cache
def modules(root: Path) -> dict[str, list[Module]]:
    """Every way the docs name a module, each with the modules it may mean: the path (cifar_wrn/report/logs.py),
    the file name (logs.py), the stem (logs), the dotted name (cifar_wrn.report.logs, report.logs); a package
    (cifar_wrn.report) by its __init__.py."""
    found: dict[str, list[Module]] = {}
    for relative, module in by_path(root).items():
        path = Path(relative)
        parts = list(path.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names = {relative, path.name, parts[-1], ".".join(parts), ".".join(parts[1:]), "/".join(path.parts[1:])}
        for name in names - {"", "__init__.py"}:
            found.setdefault(name, []).append(module)
    return found


def defined_in(root: Path, name: str, folders=("",)) -> list[str]:
    """The files that define `name` (under one of the folders)."""
    return [path for path, m in by_path(root).items() if path.startswith(folders) and m.defines(name)]


@cache
def everything_named(root: Path) -> set[str]:
    """Every name the code defines anywhere (nested too) or imports by name, and the slurm/ scripts' functions."""
    names = set(dir(builtins))
    for path in [root / "raw_ddp.py", root / "accel_train.py"] + [
        p for folder in CODE_FOLDERS for p in (root / folder).glob("**/*.py")
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(a.asname or a.name.split(".")[-1] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names.update(assigned(node))
    for script in (root / "slurm").glob("*"):
        names.update(re.findall(r"^\s*(?:function\s+)?(\w+)\s*\(\)", script.read_text(), re.M))
    return names


def name_of(span: str) -> str | None:
    """The name a code span names (`f`, `f()`, `f(a, b)`, `a.b`), or None (a flag, a value, a command)."""
    match = CALL_OR_NAME.match(span.strip())
    return match.group(1) if match and match.group(1).rpartition(".")[2] not in FILE_ENDINGS else None


def in_module(root: Path, module: str, name: str) -> str | None:
    """A problem with `name` said to be in `module`, or None (it is there, or the module is not ours)."""
    if module.startswith("tests/"):
        name = name.split("[")[0].replace("::", ".")  # tests/x.py::Class::test[id]
    candidates = modules(root).get(module)
    if candidates is None:
        return None  # not a module of this repository: the file checks report it if it should be
    if any(m.defines(name) for m in candidates):
        return None
    elsewhere = defined_in(root, name)
    return f"not in {', '.join(m.path for m in candidates)}" + (
        f" (it is in {', '.join(elsewhere)})" if elsewhere else " nor anywhere else"
    )


def dotted_problem(root: Path, name: str) -> str | None:
    """`x.name`, `cifar_wrn.x.name`: the longest module prefix must define the rest."""
    parts = name.split(".")
    if parts[0] in OBJECTS or len(parts) < 2 or name in modules(root):
        return None
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if module == "cifar_wrn":
            return f"no module cifar_wrn.{parts[1]}"
        if module in modules(root):
            return in_module(root, module, ".".join(parts[cut:]))
    if parts[0][0].isupper():
        return None  # a class: unknown_name_problems checks its member
    code = ("cifar_wrn/", "raw_ddp.py", "accel_train.py")
    elsewhere = [p for p in defined_in(root, parts[1], code) if "_" in parts[1] or parts[1] in by_path(root)[p].top]
    if elsewhere:
        return f"{parts[0]} is no module here ({parts[1]} is in {', '.join(elsewhere)})"
    return None


def prose_without_code(line: str) -> str:
    """The line's text outside code spans, link targets and web addresses."""
    line = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", " ", line)
    line = re.sub(r"\]\([^)]*\)", "]", line)
    return re.sub(r"\b[a-z]+://\S+", " ", line)


def file_problems(root: Path) -> list[str]:
    """`.py` files the docs name, in backticks or not, that are not in the tree."""
    problems, names = [], file_names(root)
    for doc in read_docs(root):
        for number, line in prose_lines(doc.read_text()):
            prose = re.findall(rf"(?<![\w./-])({PY_FILE})(?![\w-])", prose_without_code(line))
            for path in [p for p in cited_paths(line) if p.endswith(".py")] + [p.rstrip(".") for p in prose]:
                missing = (
                    not (root / path).exists() if "/" in path else path not in names | OTHER_PROJECTS | STUDENT_FILES
                )
                if missing:
                    problems.append(f"{doc.relative_to(root)}:{number}: {path}: no such file")
    return problems


def module_name_problems(root: Path) -> list[str]:
    """Names written with their module that the module does not define."""
    problems = []
    for doc in read_docs(root):
        for number, line in prose_lines(doc.read_text()):
            found = {}  # (module, name) -> (where in the line, problem)
            for pattern in WITH_MODULE:
                for match in pattern.finditer(line):
                    module = match.group("file") or match.group("bare")
                    name = name_of(next(g for g in match.groups() if g and g != module))
                    if name and (module, name) not in found:
                        found[module, name] = (match.start(), name, in_module(root, module, name))
            for span in re.finditer(SPAN, line):
                for token in span.group(1).split():
                    name = name_of(token)
                    if token.startswith("tests/") and "::" in token:
                        module, _, test = token.partition("::")
                        found[module, token] = (span.start(), token, in_module(root, module, test))
                    elif name and "." in name:
                        found[None, name] = (span.start(), name, dotted_problem(root, name))
            for _, name, problem in sorted(v for v in found.values() if v[2]):
                problems.append(f"{doc.relative_to(root)}:{number}: `{name}`: {problem}")
    return problems


def unknown_name_problems(root: Path) -> list[str]:
    """Backticked calls and CamelCase names that nothing here defines or imports."""
    problems, known = [], everything_named(root) | EXTERNAL
    classes = {}
    for module in by_path(root).values():
        for cls, found in module.classes.items():
            classes.setdefault(cls, set()).update(found)
    for doc in read_docs(root):
        for number, line in prose_lines(doc.read_text()):
            for span in code_spans(line):
                match = CALL_OR_NAME.match(span.strip())
                if not match:
                    continue
                name, call = match.groups()
                first, _, member = name.partition(".")
                where = f"{doc.relative_to(root)}:{number}: `{span}`"
                if member and first in classes and member.split(".")[0] not in classes[first]:
                    problems.append(f"{where}: {first} has no {member.split('.')[0]}")
                elif not member and (call or CAMEL.match(name)) and name not in known:
                    problems.append(f"{where}: defined nowhere in the code")
    return problems


CHECKS = [file_problems, module_name_problems, unknown_name_problems]


def test_every_name_the_docs_give_is_where_they_say():
    problems = [problem for check in CHECKS for problem in check(REPO)]
    assert not problems, report(problems)


# The checkers on a small copy with planted wrong references.

GOOD = """*Reader: a student. Answers: what is this?*

`Checkpointer.resume` (in `cifar_wrn/checkpoints.py`'s `Checkpointer`) and `resume_problem` in
`cifar_wrn/checkpoints.py`; `raw_side.py` (`RawCheckpointer`, `log_fields`); `save` in checkpoints.py;
`cifar_wrn/stopping.py` `criterion_met`, `refuse_overwrite` (`cifar_wrn/accel_side.py`),
`startup.allreduce_cost`, `cifar_wrn.run.Process`, `tests/test_x.py::test_one[a]`, `python -m cifar_wrn.report`,
`Launcher`, `warm_up()`, `DataLoader(shuffle=True)`, `torch.compile`, `model.module`, `recipe.precision`, raw_ddp.py.
```python
trainers.save_and_stop()  # code blocks are not read
```
"""

BAD = """*Reader: a student. Answers: what is this?*

`resume` in `cifar_wrn/checkpoint.py`; `save_and_stop` in trainers.py; `checksums.py`'s `digest_of`.
`cifar_wrn/raw_side.py`'s `resume_problem`; `cifar_wrn/raw_side.py` (`Tracker`); `allreduce_cost` in profiling.py.
`Checkpointer.resume_problem`, `profiling.allreduce_cost`, `cifar_wrn.checkpoint.resume`, `trainers.save_and_stop`.
`tests/test_x.py::test_two`, `Trainer`, `save_everything()`, `cifar_wrn/stopping.py` `rule`.
"""

CODE = {
    "cifar_wrn/__init__.py": "",
    "cifar_wrn/checkpoints.py": "KEYS = {}\nclass Checkpointer:\n    def resume(self): ...\n    def save(self): ...\n"
    "    def save_and_stop(self): self.done = True\ndef resume_problem(): ...\ndef digest_of(): ...\n",
    "cifar_wrn/raw_side.py": "class RawCheckpointer: ...\ndef log_fields(): ...\n",
    "cifar_wrn/accel_side.py": "class Tracker: ...\nclass AccelCheckpointer:\n    def refuse_overwrite(self): ...\n",
    "cifar_wrn/startup.py": "def warm_up(): ...\ndef allreduce_cost(): ...\n",
    "cifar_wrn/profiling.py": "PHASES = ()\n",
    "cifar_wrn/stopping.py": "if True:\n    def criterion_met(): ...\n",
    "cifar_wrn/run.py": "from dataclasses import dataclass\n@dataclass\nclass Process:\n    rank: int\n",
    "cifar_wrn/rendezvous.py": "class Launcher: ...\n",
    "cifar_wrn/report/__init__.py": "",
    "tests/test_x.py": "def test_one(): ...\n",
    "raw_ddp.py": "from torch.utils.data import DataLoader\n",
    "accel_train.py": "",
}


def code_copy(tmp_path: Path, doc: str) -> Path:
    for name, text in CODE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "slurm").mkdir()
    (tmp_path / "README.md").write_text(doc)
    return tmp_path


def test_sound_references_pass(tmp_path):
    root = code_copy(tmp_path, GOOD)
    assert [p for check in CHECKS for p in check(root)] == []


def test_planted_wrong_references_are_each_reported(tmp_path):
    root = code_copy(tmp_path, BAD)
    assert file_problems(root) == [
        "README.md:3: cifar_wrn/checkpoint.py: no such file",
        "README.md:3: checksums.py: no such file",
        "README.md:3: trainers.py: no such file",
    ]
    assert module_name_problems(root) == [
        "README.md:4: `resume_problem`: not in cifar_wrn/raw_side.py (it is in cifar_wrn/checkpoints.py)",
        "README.md:4: `Tracker`: not in cifar_wrn/raw_side.py (it is in cifar_wrn/accel_side.py)",
        "README.md:4: `allreduce_cost`: not in cifar_wrn/profiling.py (it is in cifar_wrn/startup.py)",
        "README.md:5: `profiling.allreduce_cost`: not in cifar_wrn/profiling.py (it is in cifar_wrn/startup.py)",
        "README.md:5: `cifar_wrn.checkpoint.resume`: no module cifar_wrn.checkpoint",
        "README.md:5: `trainers.save_and_stop`: trainers is no module here"
        " (save_and_stop is in cifar_wrn/checkpoints.py)",
        "README.md:6: `tests/test_x.py::test_two`: not in tests/test_x.py nor anywhere else",
        "README.md:6: `rule`: not in cifar_wrn/stopping.py nor anywhere else",
    ]
    assert unknown_name_problems(root) == [
        "README.md:5: `Checkpointer.resume_problem`: Checkpointer has no resume_problem",
        "README.md:6: `Trainer`: defined nowhere in the code",
        "README.md:6: `save_everything()`: defined nowhere in the code",
    ]
