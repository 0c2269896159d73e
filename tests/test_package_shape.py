"""The package's shape: values in, each trainer's side in one module. Only the launch checks (cli.py and each
side's resolve function) read the argparse namespace, no module of cifar_wrn/ asks which trainer runs it, and only
accel_train.py's side imports accelerate: what differs sits in cifar_wrn/raw_side.py and cifar_wrn/accel_side.py,
chosen by each entry point."""

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
