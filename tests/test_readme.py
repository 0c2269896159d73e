"""The README's commands as a student types them: the main job, the 1-GPU run, the challenge recipe and the
report, each run literally from the README's bash blocks in a fresh folder (only tiny-data flags appended),
and the report reading the logs those runs left."""

import os
import re
import shlex
import sys

import pytest
from helpers import REPO, cpu_env, finish, start, write_cifar

from cifar_wrn.runlog import run_log_path

# Appended to the README's training commands: a small subset, one epoch, the tests' tiny model.
TINY_RUN = [
    "--train-subset",
    "64",
    "--val-subset",
    "32",
    "--epochs",
    "1",
    "--batch-size",
    "8",
    "--model-width",
    "4",
    "--set",
    "eval_batch_size=64",
]


def readme_commands() -> list[str]:
    """Every command line of the README's ```bash blocks, continuation lines joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def the_command(pattern: str, exclude: str = "$^") -> str:
    found = [c for c in readme_commands() if re.search(pattern, c) and not re.search(exclude, c)]
    assert found, f"the README has no bash command matching {pattern!r}"
    return found[0]


def test_the_readme_names_each_command_of_the_students_path():
    assert the_command(r"^pip install -e \.$")
    assert "--recipe" not in the_command(r"^python raw_ddp\.py .*--num-gpus 2\b", r"--recipe")
    assert the_command(r"^python raw_ddp\.py .*--num-gpus 1\b")
    assert the_command(r"^python raw_ddp\.py .*--recipe fast\b")
    assert the_command(r"^cifar-wrn-report ")


def test_the_first_screen_leads_from_clone_to_pdf_on_falcon():
    """README's first 40 lines: a numbered checklist of at most 10 steps, from the clone through the Falcon install
    (with its constraints), the data and the course's sbatch lines for 1 and 2 GPUs (scripts that exist), a profiled
    run for the bottleneck section, to the report's PDF of the two jobs' train.log files."""
    first = (REPO / "README.md").read_text().splitlines()[:40]
    steps = [int(m[1]) for line in first if (m := re.match(r"^(\d+)\. ", line))]
    assert steps == list(range(1, len(steps) + 1)) and 6 <= len(steps) <= 10, steps
    text = "\n".join(first)
    assert re.search(r"^1\. Clone", text, re.M)
    assert "pip install -c slurm/constraints-falcon.txt -e '.[pdf]'" in text and "PyTorch/2.7.1-" in text
    for gpus in (1, 2):
        line = re.search(rf"^ +SCRIPT=(\S+) sbatch (slurm/course_{gpus}gpu\.sbatch)$", text, re.M)
        assert line and (REPO / line[2]).is_file(), gpus
    assert re.search(r"EXTRA_ARGS=--profile sbatch (slurm/raw_2gpu\.sbatch)", text)
    report = re.search(r"^ +(cifar-wrn-report .*)$", text, re.M)[1]
    assert re.fullmatch(
        r"cifar-wrn-report runs/<1-GPU job>/train\.log runs/<2-GPU job>/train\.log --source (\S+) "
        r"--out report/ --pdf report/report\.pdf",
        report,
    ), report


def test_the_success_lines_are_a_real_logs_epochs_as_the_trainer_prints_them():
    """What success looks like, in the first 40 lines: the epoch lines runlog.epoch_line makes of the log the
    README names (committed under docs/runs/), and the stop where the criterion was met; nothing typed by hand."""
    from cifar_wrn.runlog import epoch_line, read_log
    from cifar_wrn.stopping import criterion_met

    text = "\n".join((REPO / "README.md").read_text().splitlines()[:40])
    log = REPO / re.search(r"\]\((docs/runs/[^)]+\.jsonl)\)", text)[1]
    header, epochs = read_log(log)
    shown = re.findall(r"^(?:Epoch = .*|Early stopping after epoch \d+)$", text, re.M)
    rule = header["recipe"]
    accuracies = [e["val_accuracy"] for e in epochs]
    met = next(n for n in range(1, len(epochs) + 1) if criterion_met(accuracies[:n], 0.85, 2))
    assert rule["target_accuracy"] == 0.85 and rule["patience"] == 2 and met == len(epochs)
    assert shown == [*map(epoch_line, epochs), f"Early stopping after epoch {met}"], shown
    assert header["device"] == "cuda" and header["recipe"]["batch_size"] == 256 and "H200" in text  # as it says
    assert header["started_at"].startswith("2026-12-04") and "2026-12-04" in text and "--recipe fast" in text


def test_every_falcon_install_keeps_the_constraints():
    """docs/slurm.md: keep -c slurm/constraints-falcon.txt on every install on Falcon (else pip replaces the
    module's torch); the README's report command is not chained to an install without it."""
    readme = (REPO / "README.md").read_text()
    falcon = readme[: readme.index("**Success**")] + readme[readme.index("## On Falcon") :].split("\n## ")[0]
    installs = re.findall(r"pip install[^`\n]*", falcon)
    assert installs and all("-c slurm/constraints-falcon.txt" in i for i in installs), installs
    assert not [c for c in readme_commands() if re.search(r"pip install .*&& cifar-wrn-report", c)]


def test_where_a_run_log_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNS_DIR", str(tmp_path / "runs"))
    assert run_log_path("mine.jsonl", "fast", "1x2") == "mine.jsonl"  # --log-json chooses
    first = run_log_path(None, "recipes/fast.yaml", "1x2", prefix="accel-")
    second = run_log_path(None, "recipes/fast.yaml", "1x2", prefix="accel-")
    assert re.fullmatch(r"accel-fast-1x2-\d{8}-\d{6}(-2)?", os.path.basename(os.path.dirname(first)))
    assert os.path.dirname(first) != os.path.dirname(second)  # the same second: a folder each
    assert all(os.path.isdir(os.path.dirname(p)) and not os.listdir(os.path.dirname(p)) for p in (first, second))


@pytest.fixture(scope="module")
def student_folder(tmp_path_factory):
    """A folder laid out like a fresh checkout (the entry points, the package, the recipes) with tiny data in
    data/, and a PATH whose `python` is this interpreter and whose cifar-wrn-report runs the folder's report, as on
    the student's machine (pip's script would import the editable install's, another checkout's)."""
    folder = tmp_path_factory.mktemp("student")
    for name in ("raw_ddp.py", "accel_train.py", "cifar_wrn", "recipes", "accelerate_configs"):
        (folder / name).symlink_to(REPO / name)
    write_cifar(folder / "data")
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "cifar-wrn-report").write_text('#!/bin/sh\nexec python -m cifar_wrn.report "$@"\n')
    (bin_dir / "cifar-wrn-report").chmod(0o755)
    env = cpu_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("RUNS_DIR")  # the default: runs/ in the folder the command runs in
    return folder, env


def shell(command: str, folder, env, timeout=240):
    return finish(start(["bash", "-c", command], env=env, cwd=folder), timeout)


@pytest.mark.slow
def test_the_readmes_runs_leave_logs_that_its_report_command_reads(student_folder):
    folder, env = student_folder
    logs = {}
    for name, command in [
        ("2 GPUs", the_command(r"^python raw_ddp\.py .*--num-gpus 2\b", r"--recipe")),
        ("1 GPU", the_command(r"^python raw_ddp\.py .*--num-gpus 1\b", r"--recipe")),
        ("fast", the_command(r"^python raw_ddp\.py .*--recipe fast\b")),
    ]:
        result = shell(f"{command} {shlex.join(TINY_RUN)}", folder, env)
        assert result.returncode == 0, f"{name}: {command}\n{result.stdout}\n{result.stderr}"
        first = result.stdout.splitlines()[0]
        assert first.startswith("Run log: runs/"), result.stdout  # said where, first
        logs[name] = folder / first.removeprefix("Run log: ")
        assert logs[name].is_file() and '"kind": "epoch"' in logs[name].read_text()
    assert len({log.parent for log in logs.values()}) == 3  # a folder each
    assert logs["2 GPUs"].parent.name.startswith("baseline-1x2-")
    assert logs["1 GPU"].parent.name.startswith("baseline-1x1-")
    assert logs["fast"].parent.name.startswith("fast-1x2-")

    report = the_command(r"^cifar-wrn-report ", r"--pdf")
    result = shell(f"{report} --no-figures", folder, env, timeout=120)
    assert result.returncode == 0, f"{report}\n{result.stdout}\n{result.stderr}"
    out = folder / shlex.split(report)[shlex.split(report).index("--out") + 1]
    text = (out / "report.md").read_text()
    for name in ("1 GPU", "2 GPUs"):  # both of the baseline runs the README's globs name, and not the fast one
        assert str(logs[name].parent.relative_to(folder)) in text, text
    assert str(logs["fast"].parent.relative_to(folder)) not in text


@pytest.mark.slow
def test_the_readmes_no_gpu_commands_run_as_written(student_folder):
    """Both trainers' "No GPU?" commands, literally (tiny data appended): each trains on 2 CPU processes."""
    folder, env = student_folder
    for pattern in (r"^python raw_ddp\.py .*--device cpu", r"^accelerate launch .*two_cpus\.yaml accel_train\.py"):
        command = the_command(pattern)
        assert "--device cpu" in command
        result = shell(f"{command} {shlex.join(TINY_RUN)}", folder, env)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr[-3000:]}"
        assert "Epoch =  1:" in result.stdout and "Training Accuracy = " in result.stdout, result.stdout
        log = folder / result.stdout.splitlines()[0].removeprefix("Run log: ")
        assert '"world_size": 2' in log.read_text() and '"backend": "gloo"' in log.read_text()


@pytest.mark.slow
def test_without_cuda_both_main_commands_train_on_the_cpu_after_the_same_warning(student_folder):
    """The README's 2-GPU command of each trainer, as written, on a machine without CUDA: both train on 2 CPU
    processes after one warning that says so and how long an epoch takes there (accel_train.py refused before)."""
    from cifar_wrn.launchers import CPU_FALLBACK_WARNING

    folder, env = student_folder
    env = dict(env, CUDA_VISIBLE_DEVICES="")  # no GPU, whatever this machine has
    for pattern, exclude in (
        (r"^python raw_ddp\.py .*--num-gpus 2\b", r"--recipe|--device"),
        (r"two_gpus\.yaml", "$^"),
    ):
        command = the_command(pattern, exclude)
        result = shell(f"{command} {shlex.join(TINY_RUN)}", folder, env)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr[-3000:]}"
        assert result.stderr.count(CPU_FALLBACK_WARNING) == 1, result.stderr[-3000:]
        log = folder / result.stdout.splitlines()[0].removeprefix("Run log: ")
        assert '"world_size": 2' in log.read_text() and '"device": "cpu"' in log.read_text()
