"""What a run finds is never destroyed, and what it will write is checked before any process trains:
a fresh run refuses a folder holding a checkpoint (either trainer's) and an existing log; one run a checkpoint
folder (a lock the OS drops with its holder); each output path is what it is meant to be; no epoch of 0 steps;
--num-gpus within the cores; a stop while mp.spawn starts the ranks; Ctrl-C as a stop; YAML errors and a group
that does not form said in one line.

The quick tests run each entry point's `__main__` in this process up to where it would start the ranks
(test_refusals.main_in_this_process)."""

import json
import os
import signal
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checks import load_checkpoint
from helpers import data_flags, finish, kill_all, raw_flags, start
from test_exact_resume import environment
from test_refusals import DEVICE, TRAINERS, assert_one_error_line, main_in_this_process
from test_start_up_stop import wait_for

import accel_train
import raw_ddp
from cifar_wrn import runlog
from cifar_wrn.accel_side import resolve_accel_launch
from cifar_wrn.cifar_files import DataError
from cifar_wrn.cli import Logging
from cifar_wrn.datasets import load_datasets
from cifar_wrn.model import COURSE_WIDTH
from cifar_wrn.raw_side import resolve_raw_launch
from cifar_wrn.recipe import Recipe
from cifar_wrn.report.logs import read_run
from cifar_wrn.resilience import INTERRUPTED_EXIT, PREEMPTED_EXIT
from cifar_wrn.runlog import JsonLog
from cifar_wrn.stopping import Progress

FORMATS = {"raw_ddp.py": ("checkpoint.pt",), "accel_train.py": ("LATEST", "state-1")}


def a_checkpoint_of(trainer: str, folder):
    folder.mkdir(exist_ok=True)
    for name in FORMATS[trainer]:
        (folder / name).mkdir() if name.startswith("state-") else (folder / name).write_text("state-1\n")
    return folder


def goes_on_to_train(trainer, flags, monkeypatch, capsys) -> bool:
    try:
        main_in_this_process(trainer, flags, monkeypatch, capsys)
    except AssertionError as exc:
        return "was not refused" in str(exc)
    return False


# ----------------------------------------------------------------------------- item 1: nothing is destroyed


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("written_by", TRAINERS)
def test_a_fresh_run_into_a_folder_holding_a_checkpoint_is_refused(trainer, written_by, tmp_path, monkeypatch, capsys):
    """It used to overwrite it at its first epoch (its own trainer's), or write beside it (the other's)."""
    ck = a_checkpoint_of(written_by, tmp_path / "ck")
    status, stderr = main_in_this_process(trainer, ["--checkpoint-dir", ck], monkeypatch, capsys)
    assert status == 2 and "Traceback" not in stderr
    if trainer == written_by:
        assert_one_error_line(stderr, "holds a checkpoint .*: continue it with --auto-resume, or give another")
    else:
        assert_one_error_line(stderr, f"holds {written_by}'s checkpoint .*: resume it with {written_by}")
    if trainer == written_by:  # continued, as the Slurm job scripts do (--auto-resume)
        assert goes_on_to_train(trainer, ["--checkpoint-dir", ck, "--auto-resume"], monkeypatch, capsys)
    assert sorted(p.name for p in ck.iterdir()) == sorted([*FORMATS[written_by], ".lock"])


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_fresh_run_refuses_an_existing_log_and_a_resumed_one_appends(trainer, tmp_path, monkeypatch, capsys):
    (log := tmp_path / "log.jsonl").write_text('{"kind": "header"}\n')
    status, stderr = main_in_this_process(trainer, ["--log-json", log], monkeypatch, capsys)
    assert status == 2
    assert_one_error_line(stderr, f"--log-json {log} holds a run's log already")
    resumed = ["--log-json", log, "--checkpoint-dir", tmp_path / "ck", "--auto-resume"]
    assert goes_on_to_train(trainer, resumed, monkeypatch, capsys)
    (empty := tmp_path / "empty.jsonl").touch()
    assert goes_on_to_train(trainer, ["--log-json", empty], monkeypatch, capsys)


def test_a_run_log_is_never_truncated(tmp_path):
    (path := tmp_path / "log.jsonl").write_text('{"kind": "header"}\n')
    log = JsonLog(path)
    log.write({"kind": "epoch"})
    log.close()
    assert path.read_text().splitlines() == ['{"kind": "header"}', '{"kind": "epoch"}']


# ----------------------------------------------------------------------------- item 2: one run a folder

HOLD = "import sys, time; from cifar_wrn.cli import hold_folder; hold_folder(sys.argv[1]); print('held')"
HOLD += "; time.sleep(120)"


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_second_run_on_a_held_folder_stops_naming_the_first_until_a_sigkill_frees_it(
    trainer, tmp_path, monkeypatch, capsys
):
    ck = tmp_path / "ck"
    ck.mkdir()
    holder = start([sys.executable, "-u", "-c", HOLD, ck])
    try:
        assert holder.stdout.readline() == "held\n"
        flags = ["--checkpoint-dir", ck, "--auto-resume"]
        status, stderr = main_in_this_process(trainer, flags, monkeypatch, capsys)
        assert status == 2
        assert_one_error_line(
            stderr, f"--checkpoint-dir {ck} is in use by the run of pid {holder.pid} on {socket.gethostname()}"
        )
        # the run's other processes hold nothing: rank 1 under torchrun or accelerate launch goes on
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        rank_1 = [*DEVICE[trainer], "--checkpoint-dir", str(ck), "--auto-resume"]
        if trainer == "raw_ddp.py":
            assert resolve_raw_launch(raw_ddp.parse_args(rank_1))[0].torchrun_local_rank == 1
        else:
            assert resolve_accel_launch(accel_train.parse_args(rank_1))[0].checkpoints.directory == str(ck)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
    finally:
        if holder.poll() is None:  # a failure above
            kill_all(holder)
    assert goes_on_to_train(trainer, flags, monkeypatch, capsys)  # the OS dropped the lock with its process


@pytest.mark.slow
def test_a_live_raw_ddp_run_holds_its_folder_against_accel_train(cifar_dir, tmp_path, monkeypatch, capsys):
    """The mp.spawn launcher holds it (the ranks are its children); the first run trains on to its end."""
    ck, held = tmp_path / "ck", tmp_path / "held"
    held.mkdir()
    first = start(
        [sys.executable, "raw_ddp.py", "--num-gpus", 2, *raw_flags(cifar_dir, "--checkpoint-dir", ck, "--epochs", 1)],
        env=environment("raw", SLOW_START=held),
    )
    wait_for(held / "rank-0")
    status, stderr = main_in_this_process("accel_train.py", ["--checkpoint-dir", ck], monkeypatch, capsys)
    assert status == 2
    assert_one_error_line(stderr, f"is in use by the run of pid {first.pid} on ")
    done = finish(first, 180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert load_checkpoint(ck)["epoch"] == 1


# ----------------------------------------------------------------------------- item 3: output paths


def output_cases(tmp_path) -> dict:
    folder, file = tmp_path / "folder", tmp_path / "file"
    if tmp_path.name != "<names>":
        folder.mkdir()
        file.write_text("x")
    return {
        "save a folder": (["--save", folder], f"--save {folder} is a folder"),
        "save under a file": (["--save", file / "w.pt"], f"--save {file / 'w.pt'}: the folder is a file ({file})"),
        "save in no folder": (["--save", tmp_path / "no" / "w.pt"], f"the folder does not exist ({tmp_path / 'no'})"),
        "log-json a folder": (["--log-json", folder], f"--log-json {folder} is a folder"),
        "log-json under a file": (["--log-json", file / "l.jsonl"], f"the folder is a file ({file})"),
        "trace a file": (["--trace", file], f"--trace {file}: the folder is a file ({file})"),
        "trace below a file": (["--trace", file / "t"], f"--trace {file / 't'}: the folder is a file ({file})"),
        "project-dir a file": (
            ["--with-tracking", "--project-dir", file],
            f"--project-dir {file}: the folder is a file ({file})",
        ),
        "checkpoint-dir a file": (
            ["--checkpoint-dir", file],
            f"--checkpoint-dir {file}: the folder is a file ({file})",
        ),
        "trace unwritable": (["--trace", "/sys/trace"], "--trace /sys/trace: /sys is not writable"),
    }


CASES = list(output_cases(Path("<names>")))


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("case", CASES)
def test_each_output_path_is_checked_before_any_process_trains(trainer, case, tmp_path, monkeypatch, capsys):
    """--save DIR used to train to the end and lose the weights in a traceback; --trace FILE, a traceback from each
    rank at step 3; --log-json DIR, an IsADirectoryError."""
    if case == "trace unwritable" and os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("/sys is writable here")
    flags, message = output_cases(tmp_path)[case]
    status, stderr = main_in_this_process(trainer, flags, monkeypatch, capsys)
    assert status == 2 and "Traceback" not in stderr
    assert_one_error_line(stderr, message.replace("(", r"\(").replace(")", r"\)"))


# ----------------------------------------------------------------------------- item 4: no epoch of 0 steps


@pytest.mark.parametrize(("images", "refused"), [(63, True), (64, False)])
def test_an_epoch_of_0_steps_in_either_trainer_is_refused(cifar_dir, images, refused):
    """63 images at 2 processes of 32: DistributedSampler gives each rank 32, a batch, but Accelerate's prepared
    loader floor(floor(63 / 32) / 2) = 0 steps (a ZeroDivisionError on every rank): the stricter rule for both."""
    run = SimpleNamespace(recipe=Recipe(batch_size=32), world_size=2, rank=0, device="cpu")
    source = SimpleNamespace(data_dir=cifar_dir, train_subset=images, val_subset=10)
    if refused:
        with pytest.raises(DataError, match=r"less than one batch of 32 per process \(0 steps an epoch\)"):
            load_datasets(source, run.recipe, run)
    else:
        assert len(load_datasets(source, run.recipe, run)[0]) == images


# ----------------------------------------------------------------------------- item 5: --num-gpus, the spawn


def test_num_gpus_beyond_4_a_core_on_the_cpu_is_refused(monkeypatch, capsys):
    """--num-gpus 1000 --device cpu used to start 130 processes and 10 GB within 11 s."""
    bound = 4 * len(os.sched_getaffinity(0))
    status, stderr = main_in_this_process("raw_ddp.py", ["--num-gpus", bound + 1], monkeypatch, capsys)
    assert status == 2
    assert_one_error_line(stderr, rf"--num-gpus {bound + 1} CPU processes: at most {bound} here, 4 a core")
    assert goes_on_to_train("raw_ddp.py", ["--num-gpus", bound], monkeypatch, capsys)


@pytest.mark.slow
def test_a_stop_while_mp_spawn_starts_the_ranks_is_passed_on(cifar_dir, tmp_path):
    """It was lost: a thread of the launcher's store took it before the launcher knew the ranks, which trained on
    to the end. Now the ranks stop as at any start-up stop: at the first step, with a checkpoint (75)."""
    ck, spawning = tmp_path / "ck", tmp_path / "spawning"
    spawning.mkdir()
    command = [sys.executable, "raw_ddp.py", "--num-gpus", 2, *raw_flags(cifar_dir, "--checkpoint-dir", ck)]
    proc = start(command, env=environment("raw", SLOW_SPAWN=spawning))
    wait_for(spawning / "spawned-1")  # rank 0 started, rank 1 not yet
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, 180)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert "stopped by a signal at epoch 1, step 1: checkpoint written" in stopped.stderr, stopped.stderr[-3000:]
    assert (load_checkpoint(ck)["epoch"], load_checkpoint(ck)["step"]) == (0, 1)


# ----------------------------------------------------------------------------- item 7: the smaller points

YAML_ERRORS = {
    "syntax": ("epochs: [1\nbase_lr: 0.1\n", r"not valid YAML: line 2, column 8: expected ',' or ']', but got ':'$"),
    "python tag": (
        "seed: !!python/object/apply:os.system [echo hi]\n",
        r"not valid YAML: line 1, column 7: could not determine a constructor for the tag .*python/object/apply",
    ),
}


@pytest.mark.parametrize("case", YAML_ERRORS)
def test_a_recipe_files_yaml_error_is_one_line_naming_the_file(case, tmp_path, monkeypatch, capsys):
    """It used to be 3-4 lines naming "<unicode string>"."""
    text, message = YAML_ERRORS[case]
    (recipe := tmp_path / "recipe.yaml").write_text(text)
    status, stderr = main_in_this_process("raw_ddp.py", ["--recipe", recipe], monkeypatch, capsys)
    assert status == 2 and len(stderr.splitlines()) == 1, stderr
    assert_one_error_line(stderr, f"^error: {recipe}: {message}")


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_checkpoints_and_exits_130(cifar_dir, tmp_path):
    """SIGINT to the group (the launcher and its ranks), as a terminal's Ctrl-C: the step's checkpoint, one line,
    exit 130 (it used to end in a KeyboardInterrupt traceback from launcher.wait)."""
    ck, held = tmp_path / "ck", tmp_path / "held"
    held.mkdir()
    flags = raw_flags(cifar_dir, "--checkpoint-dir", ck, "--batch-size", 4)
    proc = start([sys.executable, "raw_ddp.py", "--num-gpus", 2, *flags], env=environment("raw", SLOW_START=held))
    wait_for(held / "rank-1")
    os.killpg(proc.pid, signal.SIGINT)
    stopped = finish(proc, 180)
    assert stopped.returncode == INTERRUPTED_EXIT, stopped.stderr[-3000:]
    assert stderr_of(stopped) == [
        f"stopped by a signal at epoch 1, step 1: checkpoint written to {ck / 'checkpoint.pt'}; rerun with --resume "
        "to continue"
    ]
    assert (load_checkpoint(ck)["epoch"], load_checkpoint(ck)["step"]) == (0, 1)


def test_a_resumed_run_that_starts_afresh_appends_a_header_resumed_at_its_start(tmp_path, monkeypatch):
    """An attempt that died before its first checkpoint, then the --auto-resume that found none: the log is
    appended to (it used to be emptied), and the report reads it as one run."""
    monkeypatch.setattr(runlog, "git_commit", lambda: "abc")
    sizes = lambda: dict(train_images=320, val_images=101, steps_per_epoch=10)
    run = SimpleNamespace(recipe=Recipe(), is_main=True, world_size=1)
    run.__dict__.update(global_batch_size=32, lr=0.1, data=SimpleNamespace(sizes=sizes), model_width=COURSE_WIDTH)
    run.raw_model, log = torch.nn.Linear(1, 1), tmp_path / "log.jsonl"
    launch = dict(num_nodes=1, num_gpus=1, backend="gloo", device="cpu", launcher="mp.spawn")
    for _ in range(2):
        runlog.open_run_log(run, Progress(), Logging(str(log)), **launch).close()
    headers = [json.loads(line) for line in log.read_text().splitlines()]
    assert [h["resumed_at"] for h in headers] == [None, {"epoch": 1, "step": 0}]
    assert len(read_run(log).segments) == 2


def stderr_of(result) -> list:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_node_that_cannot_reach_node_0_says_one_line(cifar_dir, tmp_path):
    """Node 1 of 2, node 0 never started: it used to print ~100 lines of the store's C++ retries first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    flags = [*data_flags(cifar_dir), "--num-nodes", 2, "--node-id", 1, "--master-addr", "127.0.0.1"]
    flags += ["--master-port", port, "--dist-timeout", 5, "--device", "cpu", "--model-width", 4]
    failed = finish(start([sys.executable, "raw_ddp.py", *flags]), 120)
    assert failed.returncode == 2
    assert len(stderr_of(failed)) == 1, failed.stderr[-3000:]
    assert_one_error_line(failed.stderr, "rank 1: the process group did not form at 127.0.0.1")
