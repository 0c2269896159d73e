"""docs/tutorial.md as a student follows it: every command of its bash blocks runs in a fresh folder (the training
commands on tiny data), and every output it shows is what the command prints, rank by rank."""

import re
import shlex
import sys

import pytest
from helpers import EPOCH_LINE, REPO, cpu_env, finish, free_port, pythonpath_with, start, write_cifar

DOC = REPO / "docs" / "tutorial.md"
# Appended to the training commands: a few images and the tests' tiny model (later flags win).
TINY = ["--train-subset", "256", "--val-subset", "100", "--epochs", "1", "--model-width", "4"]


def commands_and_outputs() -> list[tuple[str, str | None]]:
    """Each command of the bash blocks, with the text block that follows its block directly (None if none)."""
    blocks = re.findall(r"^```(bash|text)\n(.*?)^```\n", DOC.read_text(), re.S | re.M)
    out = []
    for i, (kind, body) in enumerate(blocks):
        if kind == "bash":
            shown = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text" else None
            out += [(line, shown) for line in body.splitlines() if line.strip()]
    return out


def by_rank(text: str) -> dict[str, list[str]]:
    """Each rank's lines in its order (the ranks' lines interleave as they like), process ids and ports
    renumbered: ports in increasing order from 29500, ids as 1001 and on."""
    ports = sorted({int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)})
    text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{29500 + ports.index(int(m[1]))}", text)
    text = re.sub(r"process \d+", "process N", text)
    lines = {}
    for line in text.splitlines():
        if line.startswith("[rank "):
            lines.setdefault(line.split("]")[0], []).append(line)
    return lines


def test_the_tutorial_runs_each_step_with_and_without_it():
    names = [c for c, _ in commands_and_outputs() if c.startswith("python course/steps.py")]
    steps = {c.split()[2] for c in names}
    assert steps == {"spawn", "group", "barrier", "sampler", "set-epoch", "ddp", "reduce", "print"}
    assert all(f"python course/steps.py {step} --without" in names for step in steps)
    assert len(DOC.read_text().split()) <= 3000
    assert all(f"R1.{n}" in DOC.read_text() for n in range(1, 12))


def test_r1_4_shows_the_torchvision_form_and_what_one_download_per_node_assumes():
    """The step as students write it (torchvision's CIFAR10 with download=True on local rank 0, the barrier, then
    every rank opens it), and the truth about disks: one download per node is the course's rule, and on a disk
    the nodes share (Falcon's) two nodes would still download into one folder."""
    section = DOC.read_text().split("## R1.4")[1].split("\n## ")[0]
    form = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "torchvision" in b]
    assert len(form) == 1, section
    first, download, barrier, opened = form[0].splitlines()
    assert "if local_rank == 0:" in first and "torchvision.datasets.CIFAR10(args.data_dir, download=True)" in download
    assert "dist.barrier()" in barrier and "CIFAR10(args.data_dir, train=True" in opened and "download" not in opened
    for doc in (DOC, REPO / "docs" / "ddp_walkthrough.md", REPO / "docs" / "design-notes.md"):
        text = " ".join(doc.read_text().split())
        assert "may not share a disk" not in text and "download into one folder at once" in text, doc.name


def test_the_rank_check_sees_a_changed_line():
    shown = "[rank 0] a\n[rank 1] b\n[rank 0] c\n"
    assert by_rank("[rank 1] b\n[rank 0] a\n[rank 0] c\n") == by_rank(shown)
    assert by_rank("[rank 0] c\n[rank 0] a\n[rank 1] b\n") != by_rank(shown)


@pytest.fixture(scope="module")
def tutorial_folder(tmp_path_factory):
    """What docs/tutorial.md's commands read (course/, the package, raw_ddp.py) and tiny data in data/: the folder
    they run in (test_readme.py's student_folder is a whole checkout, with the student's PATH)."""
    folder = tmp_path_factory.mktemp("tutorial")
    for name in ("course", "cifar_wrn", "raw_ddp.py"):
        (folder / name).symlink_to(REPO / name)
    write_cifar(folder / "data")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("command, shown", commands_and_outputs(), ids=[c for c, _ in commands_and_outputs()])
def test_each_tutorial_command_runs_and_prints_what_the_tutorial_shows(command, shown, tutorial_folder):
    argv = shlex.split(command)
    if argv[:2] == ["pip", "install"]:
        pytest.skip("the install: the suite runs installed")
    trains = argv[0] == "python" and argv[1] in ("course/cifar10.py", "course/cifar10_ddp.py")
    if argv[0] == "python":
        argv[0] = sys.executable
    if trains:
        argv += [*TINY, *(["--master-port", str(free_port())] if "ddp" in argv[1] else [])]
    env = cpu_env()
    env["PYTHONPATH"] = pythonpath_with(REPO, env=env)  # cifar_wrn from the checkout, installed or not
    result = finish(start(argv, env=env, cwd=tutorial_folder), timeout=180)
    if argv[0] == "diff":  # 1: the files differ
        assert result.returncode == 1 and "# R1.11" in result.stdout, result.stderr
    else:
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    if trains:
        assert len(EPOCH_LINE.findall(result.stdout)) == 1, result.stdout
    if shown is not None:
        assert by_rank(result.stdout) == by_rank(shown), result.stdout
