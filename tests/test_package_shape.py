"""The package's shape: values in, each trainer's side in one module. Only the launch checks (cli.py and each
side's resolve function) read the argparse namespace, no module of cifar_wrn/ asks which trainer runs it, and only
accel_train.py's side imports accelerate: what differs sits in cifar_wrn/raw_side.py and cifar_wrn/accel_side.py,
chosen by each entry point. One job per module: each job-defining library (Accelerate, argparse's parser,
torch.save and torch.load, the folder lock's fcntl, the checksums' hashlib, TensorBoard, the PDF's fpdf, ...) is
used by the one module whose job it is (ONE_JOB), and every module's docstring starts by saying its job."""

import ast
import re
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "cifar_wrn"


def namespace_reads(path: Path) -> list[str]:
    """Every read of an argparse namespace: `args.x`, getattr(args, ...), a parameter `args` (not *args), or
    argparse.Namespace named."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            found.append(f"{where} args.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
                found.append(f"{where} {node.func.id}(args, ...)")
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [f"{where} parameter args" for param in params if param.arg == "args"]
        elif isinstance(node, ast.Attribute) and node.attr == "Namespace":
            found.append(f"{where} argparse.Namespace")
    return found


def trainer_branches(path: Path) -> list[str]:
    """Every condition on the accelerator itself (`if run.accelerator`, `... is None`), or on what a trainer's
    object has (hasattr): the ways the package asked which trainer runs it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            test = node.test
        elif isinstance(node, ast.BoolOp):
            test = node
        else:
            continue
        inner = {id(n.value) for n in ast.walk(test) if isinstance(n, ast.Attribute)}  # accelerator.device: a use
        asked = any(
            (getattr(n, "id", None) == "accelerator" or getattr(n, "attr", None) == "accelerator")
            and id(n) not in inner
            for n in ast.walk(test)
        )
        duck = any(  # a dunder is a protocol (a dataset's __getitems__), not a trainer's object
            isinstance(n, ast.Call) and getattr(n.func, "id", None) == "hasattr" and "'__" not in ast.unparse(n)
            for n in ast.walk(test)
        )
        if asked or duck:
            found.append(f"{path.name}:{node.lineno} {ast.unparse(test)}")
    return found


def accelerate_imports(path: Path) -> list[str]:
    """Every import of accelerate: a module that needs it knows which trainer runs it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found += [f"{path.name}:{node.lineno} {name}" for name in names if name.split(".")[0] == "accelerate"]
    return found


LAUNCH_CHECKS = ("cli.py", "raw_side.py", "accel_side.py")


def package_modules(but: tuple = ()) -> list[Path]:
    return [p for p in sorted(PACKAGE.glob("*.py")) if p.name not in but]


def test_only_the_launch_checks_read_the_command_line():
    """Besides the launch checks, only cifar-wrn-data's main (cifar_files.py) reads the two arguments it parses."""
    data_command = {"cifar_files.py args.action", "cifar_files.py args.dir"}
    reads = [read for path in package_modules(but=LAUNCH_CHECKS) for read in namespace_reads(path)]
    assert [read for read in reads if re.sub(r":\d+", "", read) not in data_command] == []


def test_no_package_module_asks_which_trainer_runs_it():
    assert [branch for path in package_modules() for branch in trainer_branches(path)] == []


def test_only_accel_train_s_side_imports_accelerate():
    assert [found for path in package_modules(but=("accel_side.py",)) for found in accelerate_imports(path)] == []


def test_the_checks_see_what_they_look_for(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f(args, *more, **options):\n"
        "    x = args.data_dir\n"
        "    y = getattr(args, 'node_id', 0)\n"
        "    if run.accelerator is None:\n"
        "        pass\n"
        "    z = 1 if hasattr(tracker, 'add_scalar') else 2\n"
        "    return x, y, z\n"
    )
    assert namespace_reads(module) == ["m.py:1 parameter args", "m.py:2 args.data_dir", "m.py:3 getattr(args, ...)"]
    assert trainer_branches(module) == ["m.py:4 run.accelerator is None", "m.py:6 hasattr(tracker, 'add_scalar')"]
    module.write_text("def f(*args):\n    from accelerate import skip_first_batches\n    return len(args)\n")
    assert accelerate_imports(module) == ["m.py:2 accelerate"]
    assert namespace_reads(module) == trainer_branches(module) == []


# ----------------------------------------------------------------------------- one job per module

# A job-defining library or call, and the only modules (of cifar_wrn/ and the entry points) that may use it: the
# module whose job it is. A name matches its entry and every name under it (torch.utils.tensorboard.SummaryWriter).
ONE_JOB = {
    "accelerate": {"accel_side.py", "accel_train.py"},  # Accelerate: accel_train.py's side only
    "argparse.ArgumentParser": {"cli.py", "cifar_files.py", "report/cli.py", "raw_ddp.py", "accel_train.py"},
    "torch.save": {"checkpoints.py", "accel_side.py", "raw_ddp.py", "accel_train.py"},  # checkpoints, --save
    "torch.load": {"checkpoints.py"},  # a checkpoint read with weights_only (accel_side: accelerate.utils.load)
    "pickle.Unpickler": {"cifar_files.py"},  # CIFAR-10's batch files, read as data only
    "fcntl": {"cli.py"},  # the output folder's lock
    "hashlib": {"checkpoints.py"},  # the checkpoint files' checksums
    "torch.utils.tensorboard": {"raw_side.py"},  # raw_ddp.py's TensorBoard (Accelerate's tracker writes its own)
    "torch.profiler": {"profiling.py"},  # --trace
    "torch.multiprocessing": {"rendezvous.py", "raw_ddp.py"},  # mp.spawn and its launcher
    "tqdm": {"bars.py"},
    "yaml": {"recipe.py", "report/notes.py"},  # recipes; the student's notes
    "fpdf": {"report/pdf.py"},  # the PDF report
    "matplotlib": {"report/figures.py", "report/topology.py"},
}


def dotted(node: ast.AST, aliases: dict) -> str | None:
    """`a.b.c` as the full name it stands for, through the module's imports (`import torch.utils as tu`); None
    where it does not start at an imported name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def used_names(path: Path) -> set[str]:
    """The full names `path` imports or uses (`torch.save(...)` after `import torch`, `SummaryWriter` from
    `torch.utils.tensorboard`), wherever in the file (an import inside a function counts)."""
    tree = ast.parse(path.read_text())
    aliases, names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                names.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                names.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and (name := dotted(node, aliases)):
            names.add(name)
    return names


def job_violations(files: dict[str, Path], rules: dict = ONE_JOB) -> list[str]:
    """`module: name`, for each use of a rule's name outside the modules the rule allows. `files`: by the name the
    rules use (cli.py, report/pdf.py)."""
    found = []
    for module, path in sorted(files.items()):
        for name in sorted(used_names(path)):
            for rule, allowed in rules.items():
                if (name == rule or name.startswith(rule + ".")) and module not in allowed:
                    found.append(f"{module}: {name}")
    return found


def first_sentence(path: Path) -> str | None:
    """The first sentence of the module's docstring, None without one as its first statement."""
    body = ast.parse(path.read_text()).body
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
        return None
    text = body[0].value.value if isinstance(body[0].value.value, str) else ""
    return re.split(r"\.(?:\s|$)", " ".join(text.split()), maxsplit=1)[0]


# Words that say a module has no one job of its own (a drawer): its first sentence must say what it does.
NO_JOB = re.compile(r"\b(misc\w*|util\w*|helpers?|various|stuff|TODO)\b", re.I)


def docstring_problems(files: dict[str, Path]) -> list[str]:
    """Each module without a leading docstring whose first sentence (4 words at least) says its job."""
    problems = []
    for module, path in sorted(files.items()):
        sentence = first_sentence(path)
        if sentence is None:
            problems.append(f"{module}: no docstring first")
        elif len(sentence.split()) < 4 or NO_JOB.search(sentence):
            problems.append(f"{module}: {sentence!r} does not say its job")
    return problems


def package_files() -> dict[str, Path]:
    """cifar_wrn/ (with report/) and the two entry points, by their names relative to cifar_wrn/ or the checkout."""
    files = {str(p.relative_to(PACKAGE)): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {**files, "raw_ddp.py": REPO / "raw_ddp.py", "accel_train.py": REPO / "accel_train.py"}


def test_each_job_defining_library_is_used_by_its_module_only():
    assert job_violations(package_files()) == []


def test_every_rule_names_a_module_that_uses_it():
    """The table is not stale: every module a rule allows uses that library (and exists)."""
    files = package_files()
    unused = [
        f"{rule}: {module}"
        for rule, allowed in ONE_JOB.items()
        for module in sorted(allowed)
        if module not in files or not any(n == rule or n.startswith(rule + ".") for n in used_names(files[module]))
    ]
    assert unused == []


def test_every_module_starts_by_saying_its_job():
    assert docstring_problems(package_files()) == []


def test_the_one_job_checks_find_a_planted_violation(tmp_path):
    planted = tmp_path / "model.py"
    planted.write_text(
        '"""The model."""\n\nimport torch\nimport torch.utils.tensorboard as tb\nfrom hashlib import sha256\n\n\n'
        "def f(x):\n    from accelerate.utils import reduce as r\n\n"
        "    torch.save(x, 'x.pt')\n    return tb.SummaryWriter, sha256, r\n"
    )
    assert job_violations({"model.py": planted}) == [
        "model.py: accelerate.utils",
        "model.py: accelerate.utils.reduce",
        "model.py: hashlib",
        "model.py: hashlib.sha256",
        "model.py: torch.save",
        "model.py: torch.utils.tensorboard",
        "model.py: torch.utils.tensorboard.SummaryWriter",
    ]
    assert job_violations({"checkpoints.py": planted}, {"torch.save": {"checkpoints.py"}}) == []
    assert docstring_problems({"model.py": planted}) == ["model.py: 'The model' does not say its job"]
    planted.write_text('import torch\n"""Reads and writes the checkpoints of both trainers."""\n')
    assert docstring_problems({"model.py": planted}) == ["model.py: no docstring first"]
    planted.write_text('"""Various helpers for the trainers. And more."""\n')
    assert docstring_problems({"model.py": planted}) == [
        "model.py: 'Various helpers for the trainers' does not say its job"
    ]
    planted.write_text('"""Reads and writes the checkpoints of both trainers. And more."""\n')
    assert docstring_problems({"model.py": planted}) == []
