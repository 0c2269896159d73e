"""The installed package whole, as pip puts it. `pip install .` (not editable) into a temporary target, from a copy of
the working tree (the build writes build/ and *.egg-info/ into the tree it builds), then, from a fresh folder
outside the checkout with PYTHONPATH the target: `python -m raw_ddp`, `accelerate launch -m accel_train` with the
shipped config and `python -m cifar_wrn.report` with the shipped example notes, the report quoting the installed
raw_ddp.py; pip's commands cifar-wrn-report and cifar-wrn-data by name. And the report's refusals: a bad input (a
log, the notes, the raw_ddp.py it quotes, an output it cannot write) ends in one `error:` line and exit status 2
before any file is written, in the checkout and installed."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import LEAN_GC, REPO, cpu_env, finish, free_port, start, write_cifar

from cifar_wrn.report import ddp_source
from cifar_wrn.report.cli import main
from cifar_wrn.report.content import where_text

# A small subset, one epoch, the tests' tiny model (as tests/test_readme.py's TINY_RUN).
TINY_RUN = ["--data-dir", "data", "--train-subset", "64", "--val-subset", "32", "--epochs", "1", "--batch-size", "8"]
TINY_RUN += ["--model-width", "4", "--set", "eval_batch_size=64"]
EXAMPLE_LOG = REPO / "docs" / "report-example" / "cpu-1x1.jsonl"


def working_tree_copy(to: Path) -> Path:
    """The checkout's files as they are now (tracked and untracked, not ignored; others' uncommitted edits
    included), so that building the wheel writes nothing into the checkout."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split("\0")
    for name in filter(None, names):
        source, target = REPO / name, to / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the working tree, or a submodule
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return to


def build_outputs() -> dict:
    """What a build in the checkout would leave there: build/ and *.egg-info/, with when they last changed."""
    paths = [REPO / "build", *REPO.glob("*.egg-info"), *REPO.glob("*.egg-info/*")]
    return {p.name: p.stat().st_mtime_ns for p in paths if p.exists()}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """`pip install --no-deps --no-build-isolation --target TARGET .` of a copy of the working tree."""
    before = build_outputs()
    source = working_tree_copy(tmp_path_factory.mktemp("source"))
    target = tmp_path_factory.mktemp("site-packages")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    result = finish(start([*pip, "--target", target, source], env=cpu_env(PIP_DISABLE_PIP_VERSION_CHECK=1)), 300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert build_outputs() == before  # the checkout untouched
    return target


def installed_env(target: Path) -> dict:
    """A CPU environment that imports the project from `target` only (PYTHONPATH without the checkout; the tests'
    lean_gc/ holds a sitecustomize module, no project code), run folders in runs/ of the folder run in."""
    env = {k: v for k, v in cpu_env().items() if not k.startswith("ACCELERATE_") and k != "RUNS_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(LEAN_GC)])
    env["COLUMNS"] = "1000"  # --help on one line a flag: a path it names is never wrapped
    return env


def in_folder(command: list, folder: Path, env: dict, timeout: float = 300):
    return finish(start([sys.executable, *command], env=env, cwd=folder), timeout)


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def assert_refused(result, message: str) -> None:
    """One `error:` line naming `message`, exit status 2, nothing printed on stdout."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert message in result.stderr and result.stdout == "", (message, result.stderr, result.stdout)


# ----------------------------------------------------------------------------- the report's refusals
# (arguments, what the error line names); run in a folder holding good.jsonl (a run log), bad.jsonl (not JSON),
# notes.yaml (good notes), bad.yaml (notes of no known section) and `taken`, a file.
REFUSALS = {
    "missing log": (["missing.jsonl", "--out", "out"], "missing.jsonl: no such file"),
    "bad log": (["bad.jsonl", "--out", "out"], "bad.jsonl, line 1: not JSON"),
    "missing notes": (
        ["good.jsonl", "--out", "out", "--notes", "missing.yaml"],
        "--notes missing.yaml: cannot be read",
    ),
    "bad notes": (["good.jsonl", "--out", "out", "--notes", "bad.yaml"], "--notes bad.yaml: expected steps:"),
    "--out a file": (["good.jsonl", "--out", "taken"], "--out taken: "),
    "--out under a file": (["good.jsonl", "--out", "taken/out"], "--out taken/out: "),
    "--pdf under a file": (["good.jsonl", "--out", "out", "--pdf", "taken/r.pdf"], "--pdf taken/r.pdf: "),
    "--pdf a folder": (["good.jsonl", "--out", "out", "--pdf", "."], "--pdf .: "),
}


def bad_inputs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE_LOG, folder / "good.jsonl")
    (folder / "bad.jsonl").write_text("not json\n")
    (folder / "notes.yaml").write_text("explain:\n  topology: mine\n")
    (folder / "bad.yaml").write_text("bogus:\n  x: y\n")
    (folder / "taken").write_text("a file\n")
    return folder


@pytest.mark.parametrize("case", REFUSALS)
def test_the_report_refuses_a_bad_input_before_writing_any_file(case, tmp_path, monkeypatch, capsys):
    folder = bad_inputs(tmp_path / "folder")
    monkeypatch.chdir(folder)
    argv, message = REFUSALS[case]
    before = files_in(folder)
    code = main(argv)
    out, err = capsys.readouterr()
    assert_refused(subprocess.CompletedProcess(argv, code, out, err), message)
    assert files_in(folder) == before


@pytest.mark.parametrize("notes", [[], ["--notes", "notes.yaml"]], ids=["without notes", "with notes"])
def test_without_the_raw_ddp_py_it_quotes_the_report_refuses_before_writing_any_file(
    notes, tmp_path, monkeypatch, capsys
):
    """The report cites the raw_ddp.py installed next to the package: without it, one line (no traceback, with
    --notes or without), before a figure is drawn."""
    folder = bad_inputs(tmp_path / "folder")
    monkeypatch.chdir(folder)
    monkeypatch.setattr(ddp_source, "RAW_DDP", tmp_path / "gone" / "raw_ddp.py")
    before = files_in(folder)
    code = main(["good.jsonl", "--out", "out", *notes])
    out, err = capsys.readouterr()
    assert_refused(subprocess.CompletedProcess([], code, out, err), f"{tmp_path / 'gone' / 'raw_ddp.py'}")
    assert files_in(folder) == before


# ----------------------------------------------------------------------------- installed
@pytest.mark.slow
@pytest.mark.xdist_group("test_installed")
def test_the_installed_package_is_whole(installed):
    """What the wheel holds: both trainers, the report, the recipes, the accelerate configs and the example notes;
    nothing of the checkout's tests or course material."""
    for name in ("raw_ddp.py", "accel_train.py", "cifar_wrn/report/cli.py", "cifar_wrn/recipes/baseline.yaml"):
        assert (installed / name).is_file(), name
    configs = sorted(p.name for p in (installed / "cifar_wrn" / "accelerate_configs").glob("*.yaml"))
    assert configs == sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml"))
    assert (installed / "cifar_wrn" / "report" / "example" / "notes.yaml").read_text() == (
        REPO / "docs" / "report-example" / "notes.yaml"
    ).read_text()
    assert not list((installed / "cifar_wrn" / "report" / "example").glob("*.jsonl"))  # the notes alone
    assert not (installed / "tests").exists() and not (installed / "course").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("test_installed")
def test_the_installed_package_finds_its_recipes_without_the_checkout(installed, tmp_path):
    """Imported from a folder outside the checkout, the installed copy (not the checkout's) loads both recipes by
    name."""
    code = (
        "import cifar_wrn; from cifar_wrn.recipe import load_recipe; print(cifar_wrn.__file__); "
        "print(load_recipe('fast').batch_size, load_recipe('baseline').batch_size)"
    )
    result = in_folder(["-c", code], tmp_path, installed_env(installed), timeout=120)
    assert result.returncode == 0, result.stderr
    where, sizes = result.stdout.splitlines()[-2:]
    assert where.startswith(str(installed)), where  # the installed copy, not the checkout's
    assert sizes == "128 32", result.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("test_installed")
def test_the_installed_commands_run_from_any_folder(installed, tmp_path):
    """python -m raw_ddp (2 CPU processes), accelerate launch -m accel_train (the shipped two_cpus.yaml) and
    python -m cifar_wrn.report (the shipped example notes) from a folder outside the checkout; the report quotes
    the installed raw_ddp.py (its lines moved by one here, so that the checkout's would show)."""
    folder = tmp_path / "anywhere"
    write_cifar(folder / "data")
    env = installed_env(installed)
    where = (
        "import importlib.util as u; print(*(u.find_spec(m).origin for m in ('raw_ddp', 'accel_train', 'cifar_wrn')))"
    )
    result = in_folder(["-c", where], folder, env, timeout=60)
    assert result.returncode == 0 and all(Path(p).is_relative_to(installed) for p in result.stdout.split()), result

    for module in ("raw_ddp", "accel_train"):
        result = in_folder(["-m", module, "--help"], folder, env, timeout=120)
        assert result.returncode == 0 and f"-m {module}" in result.stdout, result.stdout + result.stderr
    help_text = in_folder(["-m", "cifar_wrn.report", "--help"], folder, env, timeout=60).stdout
    notes = Path(re.search(r"(\S+notes\.yaml) shows the form", help_text).group(1))
    assert notes.is_relative_to(installed) and notes.is_file(), help_text

    raw = ["-m", "raw_ddp", "--num-nodes", "1", "--node-id", "0", "--num-gpus", "2", "--device", "cpu", *TINY_RUN]
    config = installed / "cifar_wrn" / "accelerate_configs" / "two_cpus.yaml"
    launch = ["-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", free_port()]
    for command in (raw, [*launch, "-m", "accel_train", "--cpu", *TINY_RUN]):
        result = in_folder(command, folder, env)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr[-3000:]}"
        assert result.stdout.startswith("Run log: runs/") and "Epoch =  1:" in result.stdout, result.stdout
    runs = sorted(str(p.relative_to(folder)) for p in (folder / "runs").iterdir())
    assert len(runs) == 2 and runs[0].startswith("runs/accel-baseline-1x2-"), runs

    source = installed / "raw_ddp.py"
    source.write_text("# the installed copy: its lines one below the checkout's\n" + source.read_text())
    result = in_folder(
        ["-m", "cifar_wrn.report", *runs, "--out", "report", "--no-figures", "--notes", notes], folder, env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = (folder / "report" / "report.md").read_text()
    cited = set(re.findall(r"raw_ddp\.py:[\d,]+", text))
    shipped = {where_text("raw_ddp.py", lines) for _, lines in ddp_source.ddp_steps(source)}
    assert shipped <= cited and not cited & ({where_text("raw_ddp.py", n) for _, n in ddp_source.ddp_steps()} - shipped)
    assert all(line in text for line in ddp_source.statement_lines("= DDP(", source))  # quoted at the moved lines
    assert "[you write: why R1.1 is needed]" in text and "(your words: what would go wrong without set_epoch)" in text


@pytest.mark.slow
@pytest.mark.xdist_group("test_installed")
def test_the_installed_console_commands_run_by_name(installed, tmp_path):
    """pip's cifar-wrn-report and cifar-wrn-data (in the target's bin/), found on PATH: each one's --help, and each
    one's refusal (a subset is not CIFAR-10; a missing log) in one `error:` line, exit status 2."""
    folder = bad_inputs(tmp_path / "folder")
    write_cifar(folder / "data")
    env = dict(installed_env(installed), PATH=f"{installed / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for name in ("cifar-wrn-report", "cifar-wrn-data"):
        result = finish(start([name, "--help"], env=env, cwd=folder), 60)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: {name} "), result.stdout + result.stderr
    result = finish(start(["cifar-wrn-data", "check", "data"], env=env, cwd=folder), 60)
    assert_refused(result, "the train split has 320 images, expected 50000")
    argv, message = REFUSALS["missing log"]
    assert_refused(finish(start(["cifar-wrn-report", *argv], env=env, cwd=folder), 60), message)


@pytest.mark.slow
@pytest.mark.xdist_group("test_installed")
def test_the_installed_report_refuses_a_bad_input_before_writing_any_file(installed, tmp_path):
    """Each refusal of the report, installed and run from outside the checkout, the missing raw_ddp.py last."""
    folder = bad_inputs(tmp_path / "folder")
    env = installed_env(installed)
    for case, (argv, message) in REFUSALS.items():
        before = files_in(folder)
        assert_refused(in_folder(["-m", "cifar_wrn.report", *argv], folder, env, timeout=120), message)
        assert files_in(folder) == before, case
    source = installed / "raw_ddp.py"
    kept = source.rename(installed / "raw_ddp.py.kept")
    try:
        for notes in ([], ["--notes", "notes.yaml"]):
            result = in_folder(["-m", "cifar_wrn.report", "good.jsonl", "--out", "out", *notes], folder, env)
            assert_refused(result, f"{source}")
            assert files_in(folder) == before
    finally:
        kept.rename(source)
