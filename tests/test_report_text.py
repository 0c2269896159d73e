"""The report of a student's own run: rank 0's printed epoch lines read as a run (a Slurm job's
train.log, or any file of them), with what they cannot say from the job folder or from flags; and --source, the
R1 steps found in the student's file by their tag or else by their call, the missing ones a checklist. Bad text
ends in one line naming the file and line, exit status 2."""

import ast
import json
import re
import sys

import pytest
from helpers import REPO, cpu_env, data_flags, finish, free_port, run, start

from cifar_wrn.report.cli import main
from cifar_wrn.report.featured import printed_lines
from cifar_wrn.report.textlog import read_text_run

SINGLE, DDP = REPO / "course" / "cifar10.py", REPO / "course" / "cifar10_ddp.py"
STEPS = [f"R1.{n}" for n in range(1, 12)]


def course_line(epoch: int, cumulative: float, accuracy: float, training: bool = True) -> str:
    """An epoch line exactly as course/cifar10.py prints it (its own print's f-string, evaluated); without
    Training Accuracy as the course's first script printed it."""
    tree = ast.parse(SINGLE.read_text())
    printed = next(
        n.args[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print" and "Epoch = " in ast.unparse(n)
    )
    values = dict(epoch=epoch - 1, total_time=cumulative, epoch_time=30.0, images_per_sec=1600.0 * (epoch + 1))
    values.update(train_accuracy=accuracy - 0.1, val_loss=2.0 - accuracy, val_accuracy=accuracy)
    line = eval(compile(ast.Expression(printed), str(SINGLE), "eval"), {}, values)
    return line if training else re.sub(r"Training Accuracy = [\d.]+, ", "", line)


def printed_log(path, accuracies, training=True, before=("Files already downloaded and verified",)):
    """Rank 0's output: a few other lines, the epoch lines, and the early stop where the course's rule holds."""
    lines = list(before) + [course_line(e, 30.0 * e, a, training) for e, a in enumerate(accuracies, 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def report(tmp_path, *args) -> str:
    assert main([*map(str, args), "--out", str(tmp_path / "out"), "--no-figures"]) == 0
    return (tmp_path / "out" / "report.md").read_text()


def tags(path) -> dict[str, list[int]]:
    """Each step's lines in `path`: every line whose comment names `R1.<n>`, read here apart from the report."""
    found: dict[str, list[int]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        comment = line[line.index("#") :] if "#" in line else ""
        for n in re.findall(r"R1\.(\d+)", comment):
            found.setdefault(f"R1.{n}", []).append(number)
    return found


# ----------------------------------------------------------------------------- printed lines as a run


def test_the_course_scripts_printed_lines_are_read_with_and_without_training_accuracy(tmp_path):
    one = printed_log(tmp_path / "one.txt", [0.55, 0.86, 0.87])
    two = printed_log(tmp_path / "two.out", [0.56, 0.86, 0.88], training=False)
    text = report(tmp_path, one, two, "--world-size", 1, "--world-size", 2)
    # every number as printed; no training accuracy where none was printed
    assert "| 1 | 30.000 | 30.000 | 3200.0 | 0.4500 | 1.4500 | 0.5500 |  |" in text
    assert "| 3 | 90.000 | 30.000 | 6400.0 | 0.7700 | 1.1300 | 0.8700 | 2/2, stop |" in text
    assert "| 3 | 90.000 | 30.000 | 6400.0 | – | 1.1200 | 0.8800 | 2/2, stop |" in text
    # the world sizes from --world-size, in order: the pair compared (same times: speedup 1)
    assert "| two | 2 | 1 x 2 | 90.000 | 4800.0 | 0.8800 | one | 1.000 | 0.500 |" in text
    assert "world size 2 (1 x 2) from --world-size 2, device cuda" in text
    assert "a text log: no recipe, model or data sizes" in text and "| model | not logged (a text log) |" in text


def test_a_job_folder_gives_what_the_printed_lines_cannot(tmp_path):
    """runs/<job id>/: train.log (slurm/job.sh's banner, the command, the printed lines) and topology.txt; a
    requeued job prints its banner again and starts over: the later lines count."""
    banner = [
        "=== 2026-12-07 14:00:00 job 4242 (course_2gpu): my_cifar10.py, 1 node",
        "hosts: falcon-a30-7",
        "world size: 2 = 1 node(s) x 2 process(es), device cuda",
        "repo: /home/me/cifar, git 5bc2f82",
        "torch 2.7.1+cu126, CUDA 12.6, NCCL 2.21.5, 2 GPU(s) visible",
        "+ python my_cifar10.py --num-nodes 1 --node-id 0 --num-gpus 2 --data-dir /tmp/cifar10",
    ]
    job = tmp_path / "runs" / "4242"
    job.mkdir(parents=True)
    (job / "topology.txt").write_text("GPU 0: NVIDIA A30 (UUID: GPU-1)\nGPU 1: NVIDIA A30 (UUID: GPU-2)\n")
    first = [course_line(1, 30.0, 0.5), course_line(2, 60.0, 0.6)]
    log = printed_log(job / "train.log", [0.55, 0.86, 0.87], before=banner + first + banner)
    text = report(tmp_path, job)  # the folder stands for its train.log
    for fact in (
        "| world size (processes) | 2 |",
        "| GPUs per node | 2 |",
        "| backend | nccl |",
        "| commit | 5bc2f82 |",
    ):
        assert fact in text, fact
    assert "| hardware | 2 x NVIDIA A30 |" in text and "| host (rank 0) | falcon-a30-7 |" in text
    assert "| torch | 2.7.1+cu126 |" in text and "| command | python my_cifar10.py --num-nodes 1" in text
    assert "### 4242" in text and f"Log: `{log}`" in text  # named for its job
    assert f"{log}, line 15: the job restarted and printed epoch 1 again: the later lines count" in text
    assert "| 1 | 30.000 | 30.000 | 3200.0 | 0.4500 | 1.4500 | 0.5500 |  |" in text  # the second start's
    assert printed_lines(read_text_run(job, [])) == log.read_text().splitlines()[-3:]  # R3's lines: the later ones


def test_a_text_log_and_a_json_log_are_reported_together_but_not_compared(tmp_path):
    """A JSON log (as the trainers write it) beside a text log: both reported, no speedup between them."""
    header = {"kind": "header", "world_size": 1, "num_nodes": 1, "num_gpus": 1, "backend": "nccl", "device": "cuda"}
    header["recipe"] = {"target_accuracy": 0.85, "patience": 2}
    epoch = {"kind": "epoch", "epoch": 1, "cumulative_time": 30.0, "epoch_time": 30.0, "images_per_sec": 1600.0}
    epoch.update(val_loss=1.0, val_accuracy=0.5)
    json_log = tmp_path / "raw.jsonl"
    json_log.write_text("\n".join(map(json.dumps, [header, epoch])) + "\n")
    text = report(tmp_path, json_log, printed_log(tmp_path / "mine.txt", [0.55]), "--world-size", 2)
    assert "| raw | 1 | 1 x 1 |" in text and "| mine | 2 | 1 x 2 |" in text
    assert "**`mine` is not compared with a 1-process run**" in text and "log_format (json vs text)" in text


def test_readme_steps_7_and_8_the_students_two_printed_logs_and_a_profiled_run_give_the_time_profile(tmp_path):
    """README's checklist: the student's 1- and 2-GPU printed logs, and raw_ddp.py's --profile run for the
    bottleneck section. The profiled run is of another kind (a JSON log), so it is not set beside the featured
    run, but its profile is the report's time profile, named as another run's, and Demonstrate 5 points to it."""
    header = {"kind": "header", "world_size": 2, "num_nodes": 1, "num_gpus": 2, "backend": "nccl", "device": "cuda"}
    header["recipe"] = {"target_accuracy": 0.85, "patience": 2}
    epoch = {"kind": "epoch", "epoch": 1, "cumulative_time": 30.0, "epoch_time": 30.0, "images_per_sec": 1600.0}
    epoch.update(val_loss=1.0, val_accuracy=0.5, profile={"data": 2.0, "forward": 9.0, "backward": 19.0})
    profiled = tmp_path / "raw-profile.jsonl"
    profiled.write_text("\n".join(map(json.dumps, [header, epoch])) + "\n")
    one, two = printed_log(tmp_path / "one.txt", [0.55, 0.86]), printed_log(tmp_path / "two.txt", [0.56, 0.87])
    text = report(tmp_path, one, two, profiled, "--world-size", 1, "--world-size", 2)
    profile = text[text.index("## Time profile") :]
    assert "| raw-profile | 2.000 | 9.000 | 19.000 |" in profile.split("\n## ")[0]
    assert "`raw-profile`" in profile.split("|")[0]  # says whose profile it is, before the table
    assert 'the section "Time profile" shows where an epoch' in text


BAD = {  # file content, extra flags, the one error line (FILE: the file's path)
    "no epoch line": ("Files already downloaded and verified\n", [], "{FILE}: not a run log: no epoch line found"),
    "cut short": (
        course_line(1, 30.0, 0.5) + "\nEpoch =  2: Cumulative Time = 60.000, Epoch Ti\n",
        [],
        "{FILE}, line 2: an epoch line without Epoch Time, Images/sec, Validation Loss, Validation Accuracy "
        "(cut short?)",
    ),
    "not finite": (
        course_line(1, 30.0, 0.5).replace("Validation Loss = 1.500", "Validation Loss = nan") + "\n",
        [],
        "{FILE}, line 1: Validation Loss = nan is not a finite number",
    ),
    "a percentage": (
        course_line(1, 30.0, 0.5).replace("Validation Accuracy = 0.500", "Validation Accuracy = 87.0") + "\n",
        [],
        "{FILE}, line 1: val_accuracy must be a fraction in [0, 1] (got 87.0)",
    ),
    "a negative time": (
        course_line(1, 30.0, 0.5).replace("Cumulative Time = 30.000", "Cumulative Time = -30.0") + "\n",
        [],
        "{FILE}, line 1: cumulative_time must be a finite number >= 0 (got -30.0)",
    ),
    "every rank printing": (
        course_line(1, 30.0, 0.5) + "\n" + course_line(1, 30.0, 0.5) + "\n",
        [],
        "{FILE}, line 2: epoch 1 after epoch 1 with no job restart between them",
    ),
    "every rank printing, a signal's note between": (  # slurm/requeue.sh's note is no restart of the job
        course_line(1, 30.0, 0.5)
        + "\n=== 2026-12-07 14:00:00 job 4242: SIGUSR1 received; not passed on, no requeue: x.py cannot checkpoint\n"
        + course_line(1, 30.0, 0.5)
        + "\n",
        [],
        "{FILE}, line 3: epoch 1 after epoch 1 with no job restart between them",
    ),
    "no world size": (course_line(1, 30.0, 0.5) + "\n", None, "{FILE}: a text log without the job's banner"),
    "world size 0": (course_line(1, 30.0, 0.5) + "\n", ["--world-size", "0"], "--world-size 0: expected N"),
    "world size to spare": (
        course_line(1, 30.0, 0.5) + "\n",
        ["--world-size", "2", "--world-size", "4"],
        "--world-size 4: more values than text logs without a job banner",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_text_logs_give_one_line_naming_the_file_and_line(case, tmp_path, capsys):
    content, flags, message = BAD[case]
    log = tmp_path / "rank0.txt"
    log.write_text(content)
    flags = ["--world-size", "2"] if flags == [] else flags or []
    assert main([str(log), *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.format(FILE=log)) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- --source: the student's file


def steps_rows(text: str) -> dict[str, str]:
    """The R1 table of report.md: step -> where."""
    return dict(re.findall(r"^\| (R1\.\d+) \| (.+?) \| ", text, re.M))


def without_tags(path, to):
    """A copy of `path` with every `# R1.<n>` comment taken out (the lines stay where they were)."""
    to.write_text(re.sub(r"[ \t]*#[ \t]*R1\.\d+.*$", "", path.read_text(), flags=re.M))
    return to


def test_source_finds_each_step_at_its_tags_else_by_its_call_and_every_listing_names_its_file(tmp_path):
    log = printed_log(tmp_path / "mine.txt", [0.55])
    text = report(tmp_path, log, "--world-size", 2, "--source", DDP)
    assert steps_rows(text) == {step: f"{DDP}:{','.join(map(str, lines))}" for step, lines in tags(DDP).items()}
    assert len(steps_rows(text)) == 11 and "Not found in" not in text
    listings = re.findall(r"```\n(.*?)\n```", text, re.S)
    quoted = [block for block in listings if re.search(r"^\d+: ", block, re.M)]
    assert len(quoted) == 4 and all(block.startswith(f"# quoted from {DDP} (line: code)") for block in quoted)
    # untagged: each step found by the call it names, at one of the lines its tag was on
    bare = without_tags(DDP, tmp_path / "bare.py")
    text = report(tmp_path, log, "--world-size", 2, "--source", bare)
    for step, where in steps_rows(text).items():
        found = re.fullmatch(rf"{re.escape(str(bare))}:([\d,]+) \(by its call, untagged\)", where)
        assert found, (step, where)
        assert {int(n) for n in found.group(1).split(",")} <= set(tags(DDP)[step]), step
    assert "dist.all_reduce(metrics, op=dist.ReduceOp.AVG)" in text and "Not found in" not in text
    # the default quotes raw_ddp.py, and says so
    text = report(tmp_path, log, "--world-size", 2)
    quoted = [block for block in re.findall(r"```\n(.*?)\n```", text, re.S) if re.search(r"^\d+: ", block, re.M)]
    assert quoted and all(block.startswith("# quoted from raw_ddp.py (line: code)") for block in quoted)


def test_a_step_removed_from_the_students_file_is_named_in_its_checklist(tmp_path, capsys):
    """course/cifar10_ddp.py without its set_epoch line (R1.6), and with a comment and a docstring that name
    the call: a mention is no call."""
    lines = DDP.read_text().splitlines()
    kept = [line for line in lines if "# R1.6" not in line] + ['"""call sampler.set_epoch(epoch)"""']
    mine = tmp_path / "my_cifar10.py"
    mine.write_text("\n".join(kept) + "\n# train_loader.sampler.set_epoch(epoch)\n")
    assert main([str(printed_log(tmp_path / "r.txt", [0.5])), "--world-size", "2", "--source", str(mine)] + [
        "--out", str(tmp_path / "out"), "--no-figures"]) == 0  # fmt: skip
    text = (tmp_path / "out" / "report.md").read_text()
    item = f"[ ] R1.6 (set_epoch: a new shuffle every epoch): no `<sampler>.set_epoch(epoch)` in {mine}"
    assert steps_rows(text)["R1.6"] == f"not found in {mine}" and f"- {item}: add it, or tag" in text
    assert [step for step, where in steps_rows(text).items() if where.startswith("not found")] == ["R1.6"]
    assert item in capsys.readouterr().out


STUDENT = """\
import argparse, os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler


def main(gpu, args):
    \"\"\"Nothing here counts: init_process_group( mp.spawn( dist.barrier()\"\"\"
    args.rank = args.node_id * args.gpus + gpu
    args.world_size = args.nodes * args.gpus
    dist.init_process_group("nccl", rank=args.rank, world_size=args.world_size)
    device = torch.device("cuda", gpu)
    if gpu == 0:
        download()
    dist.barrier()
    train_sampler = DistributedSampler(train_set)
    model = DistributedDataParallel(model.to(device), device_ids=[gpu])
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        dist.reduce(images_per_sec, 0)
        dist.all_reduce(
            metrics, op=dist.ReduceOp.AVG
        )
        if args.rank == 0:

            print("Epoch =", epoch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--num-nodes", type=int, dest="nodes")
    parser.add_argument("--node-id", type=int)
    parser.add_argument("-g", "--num-gpus", type=int, dest="gpus")
    torch.multiprocessing.spawn(main, args=(parser.parse_args(),), nprocs=2)
"""
FOUND = {  # where each step of STUDENT is: by its call alone
    "R1.1": [32, 33, 34], "R1.2": [10, 11], "R1.3": [12], "R1.4": [16], "R1.5": [17], "R1.6": [20], "R1.7": [13],
    "R1.8": [18], "R1.9": [21, 22], "R1.10": [25], "R1.11": [35],
}  # fmt: skip


def test_a_students_own_style_is_found_by_its_calls_and_a_split_call_by_its_first_line(tmp_path):
    """Another hand than the course's: other names, torch.device("cuda", gpu), a call split over lines (found at
    its first line, its AVG on the next), a blank line between the rank-0 if and its print; the docstring's
    mentions are no calls."""
    mine = tmp_path / "mine.py"
    mine.write_text(STUDENT)
    text = report(tmp_path, printed_log(tmp_path / "r.txt", [0.5]), "--world-size", 2, "--source", mine)
    assert steps_rows(text) == {s: f"{mine}:{','.join(map(str, n))} (by its call, untagged)" for s, n in FOUND.items()}
    assert "Not found in" not in text and "22: dist.all_reduce(\n23: metrics, op=dist.ReduceOp.AVG\n24: )" in text
    mine.write_text(STUDENT.replace("dist.barrier()", "pass").replace("op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM"))
    text = report(tmp_path, printed_log(tmp_path / "r.txt", [0.5]), "--world-size", 2, "--source", mine)
    assert f"- [ ] R1.4 (download on one process per node, then a barrier): no `barrier(` in {mine}" in text
    assert f"- [ ] R1.9 (reduce images/sec, all_reduce(AVG) validation): no `all_reduce(..., AVG)` in {mine}" in text
    assert steps_rows(text)["R1.9"] == f"{mine}:21 (by its call, untagged)"  # the reduce found, the AVG not


@pytest.mark.parametrize("case", ["missing", "not python"])
def test_a_bad_source_gives_one_line(case, tmp_path, capsys):
    source = tmp_path / "mine.py"
    if case == "not python":
        source.write_text("def main(:\n")
    log = printed_log(tmp_path / "r.txt", [0.5])
    assert main([str(log), "--world-size", "2", "--source", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    expected = f"--source {source}: no such file" if case == "missing" else f"--source {source}, line 1: not Python"
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a real job's folder, for real


def job(runs, job_id: str, processes: int, command: list) -> None:
    """runs/<job id>/ as a Slurm job of slurm/job.sh writes it: print_banner's lines and topology.txt (its own
    code, run in bash), the command as run_preemptable echoes it, then what the training printed."""
    folder = runs / job_id
    folder.mkdir(parents=True)
    script = (
        f"source slurm/job.sh; JOB_ID={job_id} NUM_NODES=1 GPUS_PER_NODE={processes} JOB_WORLD_SIZE={processes} "
        f"DEVICE=cpu HOSTS=(node1) RESUME_ARGS=() REPO_DIR=. PYTHON={sys.executable} RUN_DIR={folder} "
        f'LOG={folder}/train.log; print_banner "{command[1].name}, mp.spawn, 1 node" >/dev/null; '
        f'echo "+ $(quote_args "$@")" >> "$LOG"'
    )
    banner = run(["bash", "-c", script, "job", *command], timeout=120)
    assert banner.returncode == 0, banner.stderr
    trained = run(command, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    with open(folder / "train.log", "a") as log:
        log.write(trained.stdout + trained.stderr)


@pytest.fixture(scope="module")
def course_jobs(cifar_dir, tmp_path_factory):
    """Two jobs' folders: course/cifar10.py on 1 process and course/cifar10_ddp.py on 2 CPU processes, 2 epochs
    of 256 training and 100 validation images, the narrow model."""
    tmp = tmp_path_factory.mktemp("jobs")
    tiny = [*data_flags(cifar_dir, 256, 100), "--model-width", 4, "--epochs", 2]
    job(tmp / "runs", "501", 1, [sys.executable, SINGLE, *tiny])
    job(tmp / "runs", "502", 2, [sys.executable, DDP, "--num-gpus", 2, "--master-port", free_port(), *tiny])
    return tmp


@pytest.mark.slow
@pytest.mark.xdist_group("course_jobs")
def test_the_report_of_the_course_scripts_own_jobs_finds_all_eleven_steps(course_jobs):
    """The course job's report command, as README gives it, on the printed logs of real runs."""
    pytest.importorskip("fpdf")
    out = course_jobs / "report"
    runs = [course_jobs / "runs" / job_id / "train.log" for job_id in ("501", "502")]
    command = [sys.executable, "-m", "cifar_wrn.report", *runs, "--source", "course/cifar10_ddp.py"]
    result = finish(start([*command, "--out", f"{out}/", "--pdf", out / "report.pdf"], env=cpu_env()), 300)
    assert result.returncode == 0, result.stderr
    text = (out / "report.md").read_text()
    where = {step: f"course/cifar10_ddp.py:{','.join(map(str, lines))}" for step, lines in tags(DDP).items()}
    assert steps_rows(text) == where and sorted(where) == sorted(STEPS)
    assert "| 502 | 2 | 1 x 2 |" in text and "| 501 | 1 | 1 x 1 |" in text and "compared with" in text
    assert "| device | cpu |" in text and "| backend | gloo |" in text and "| command | " in text
    printed = [line for line in runs[1].read_text().splitlines() if line.startswith("Epoch = ")]
    assert len(printed) == 2 and text.count("\n| 2 | ") == 2  # both runs' second epoch
    assert (out / "report.pdf").stat().st_size > 0 and "wrote" in result.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("course_jobs")
def test_the_same_jobs_reported_with_a_step_removed_name_it(course_jobs, tmp_path):
    lines = DDP.read_text().splitlines()
    mine = tmp_path / "my_cifar10.py"
    mine.write_text("\n".join(line for line in lines if "# R1.8" not in line) + "\n")  # no DDP wrap (nor its import)
    runs = [course_jobs / "runs" / job_id for job_id in ("501", "502")]
    result = run([sys.executable, "-m", "cifar_wrn.report", *runs, "--source", mine, "--out", tmp_path / "out"])
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out" / "report.md").read_text()
    assert steps_rows(text)["R1.8"] == f"not found in {mine}"
    assert f"R1.8 (DistributedDataParallel): no `DistributedDataParallel(` (or `DDP(`) in {mine}" in result.stdout
