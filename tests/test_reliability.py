"""Checkpoint and resume, preemption, crashed ranks, non-finite loss: nothing lost, nothing hangs."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from checks import load_checkpoint, read_training_state
from helpers import EPOCH_LINE, cpu_env, finish, raw_flags, resume_flags, start, torchrun_command, wait_for_epoch
from helpers import raw_ddp as run_raw
from test_accel import CONFIGS, accel_env, accelerate_command, accelerate_launch, reliability_flags, worker_processes

from cifar_wrn.accel_side import latest_checkpoint
from cifar_wrn.checkpoints import CheckpointError, check_writable, resume_problem, save_atomic
from cifar_wrn.model import ARCHITECTURE, WideResNet
from cifar_wrn.raw_side import RawCheckpointer
from cifar_wrn.resilience import PREEMPTED_EXIT
from cifar_wrn.runlog import read_log


def flags(cifar_dir, *extra):
    return ["--num-gpus", 2, *raw_flags(cifar_dir, *extra)]


# ----------------------------------------------------------------------------- pure pieces


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a folder on a tmpfs of `size` bytes (a real full disk: writes end in ENOSPC); mount it
    again with another size to make room. Needs root (the tests run as root in CI); skipped where refused."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = []

    def mount(size: int):
        options = f"{'remount,' if mounted else ''}size={size}"
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True
        )
        if result.returncode:
            pytest.skip(f"a real full disk needs a small tmpfs, and mount was refused here: {result.stderr.strip()}")
        mounted.append(size)
        return folder

    yield mount
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def checkpoint_bytes(width: int, momentum: bool = False) -> int:
    """About what one checkpoint of this width takes on disk: the weights, and with `momentum` the SGD momentum
    buffers too (the baseline recipe's SGD has momentum 0.9, as the course script's)."""
    model, buffer = WideResNet(width=width), io.BytesIO()
    torch.save([model.state_dict(), [p.detach().clone() for p in model.parameters()] if momentum else []], buffer)
    return len(buffer.getvalue())


@pytest.mark.slow
def test_atomic_write_keeps_the_old_checkpoint_on_a_full_disk(small_disk):
    state = {"epoch": 1, "model": WideResNet(width=8).state_dict()}
    disk = small_disk(checkpoint_bytes(8) * 3 // 2)  # room for one checkpoint, not for the next beside it
    save_atomic(state, disk / "checkpoint.pt")
    # torch.save into the open file raises RuntimeError ("unexpected pos") while handling the OSError
    with pytest.raises(CheckpointError, match=f"could not write {disk / 'checkpoint.pt'}: No space left on device$"):
        save_atomic({**state, "epoch": 2}, disk / "checkpoint.pt")
    assert torch.load(disk / "checkpoint.pt")["epoch"] == 1
    assert [p.name for p in disk.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


def test_unwritable_checkpoint_dir_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        check_writable(tmp_path / "file" / "sub")


def test_resume_problems_are_named():
    recipe = {"epochs": 3, "lr_schedule": "constant", "base_lr": 0.01, "patience": 2}
    checkpoint = {"world_size": 2, "model_width": 4, "architecture": ARCHITECTURE, "recipe": dict(recipe, epochs=2)}
    assert resume_problem(checkpoint, recipe, 2, 4) is None  # more epochs on a constant schedule: fine
    earlier = {k: v for k, v in checkpoint.items() if k != "architecture"}  # before the course's model
    assert "the model changed" in resume_problem(earlier, recipe, 2, 4)
    assert resume_problem(earlier, recipe, 2, 4, architecture=None) is None  # two logs of that time (the report)
    assert "written by 2 processes, this run has 4" in resume_problem(checkpoint, recipe, 4, 4)
    assert "base_lr (0.01 -> 0.1)" in resume_problem(checkpoint, dict(recipe, base_lr=0.1), 2, 4)
    warm = dict(recipe, lr_schedule="warmup_linear")
    assert "epochs (2 -> 3)" in resume_problem({**checkpoint, "recipe": dict(warm, epochs=2)}, warm, 2, 4)
    # a checkpoint holding a key that left the code (an earlier version's): refused by name, never misread
    old = {**checkpoint, "recipe": dict(recipe, lookahead_steps=0)}
    assert "lookahead_steps (0 -> None)" in resume_problem(old, recipe, 2, 4)
    # a checkpoint older than a recipe key: refused by name too (the report fills in defaults for old logs itself)
    assert "bn_lr_scale (None -> 1.0)" in resume_problem(checkpoint, dict(recipe, bn_lr_scale=1.0), 2, 4)


def agreement_steps(seconds_per_step: list[float], steps: int, steps_per_epoch: int = 1000) -> list[list[int]]:
    """The steps (1-based) at which two ranks' StepGuards agree, rank r's steps taking seconds_per_step[r]
    on its own clock: each guard in its own thread, the agreement a MAX over both (as dist.all_reduce)."""
    import threading
    from unittest import mock

    from cifar_wrn.resilience import StepGuard

    clocks, slots, checked = [0.0, 0.0], [None, None], [[], []]
    meet, this_thread = threading.Barrier(2), threading.local()

    def rank(r):
        this_thread.rank = r
        guard = StepGuard(r, 2, "cpu")

        def agree(flags):
            slots[r] = flags.clone()
            meet.wait()
            flags.copy_(torch.maximum(*slots))
            meet.wait()
            checked[r].append(step + 1)

        for step in range(steps):
            clocks[r] += seconds_per_step[r]
            guard.check(torch.tensor(1.0), 0, step, steps_per_epoch, agree)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    with mock.patch("cifar_wrn.resilience.monotonic", lambda: clocks[this_thread.rank]):  # each rank's own clock
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    return checked


@pytest.mark.slow
def test_the_ranks_agree_often_enough_to_stop_within_seconds():
    """Fast steps: every 10 (after the first two, which measure). Slow steps: often enough that a stop signal
    waits about 2 s at most (STOP_LATENCY), every step when a step takes longer; the slowest rank sets the pace
    and both ranks agree at the same steps."""
    assert agreement_steps([0.01, 0.01], 40) == [[1, 2, 10, 20, 30, 40]] * 2
    assert agreement_steps([0.01, 9.5], 6) == [[1, 2, 3, 4, 5, 6]] * 2
    assert agreement_steps([0.3, 0.1], 12) == [[1, 2, 5, 10]] * 2  # 5 x 0.3 s <= 2 s: every 5
    assert agreement_steps([0.1, 0.5], 10) == [[1, 2, 4, 6, 8, 10]] * 2  # 5 x 0.5 s > 2 s: every 2
    assert agreement_steps([0.01, 0.01], 7, steps_per_epoch=7) == [[1, 2, 7]] * 2  # and at the epoch's end


# ----------------------------------------------------------------------------- resume
# conftest's resume_runs: raw_ddp.py's checkpoint after epoch 1 (--auto-resume into an empty folder) and the
# same run over 2 epochs never stopped. Copied before a resume (or a refused one) could write into them.


@pytest.mark.xdist_group("resume_runs")
@pytest.mark.core
def test_resumed_run_equals_uninterrupted_run(cifar_dir, tmp_path, resume_runs):
    """Stopped at the end of epoch 1, resumed for epoch 2: the weights and every epoch's metrics of the run
    never stopped (resume_runs.straight: the same flags, no checkpoint)."""
    run = resume_runs.copy("raw", tmp_path)  # its ck/ and l.jsonl
    second = run_raw(
        "--num-gpus",
        2,
        *resume_flags(
            cifar_dir,
            "--epochs",
            2,
            "--checkpoint-dir",
            run / "ck",
            "--resume",
            "--save",
            run / "w.pt",
            "--log-json",
            run / "l.jsonl",
        ),
    )
    assert second.returncode == 0, second.stderr
    assert "Resuming from" in second.stdout and second.stdout.count("Epoch = ") == 1
    straight = resume_runs.folder / "straight"
    a, b = torch.load(straight / "w.pt"), torch.load(run / "w.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # identical weights
    (_, ea), (_, eb) = read_log(straight / "l.jsonl"), read_log(run / "l.jsonl")
    assert [(e["epoch"], e["val_loss"], e["val_accuracy"]) for e in ea] == [
        (e["epoch"], e["val_loss"], e["val_accuracy"]) for e in eb
    ]  # identical per-epoch metrics
    assert eb[-1]["cumulative_time"] == pytest.approx(sum(e["epoch_time"] for e in eb))


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
def test_resume_refusals(cifar_dir, tmp_path, resume_runs):
    missing = run_raw(*flags(cifar_dir, "--epochs", 1, "--checkpoint-dir", tmp_path / "none", "--resume"))
    assert missing.returncode == 2 and "no checkpoint at" in missing.stderr and "Traceback" not in missing.stderr
    fresh = resume_runs.checkpoint  # --auto-resume into an empty folder starts afresh
    assert fresh.returncode == 0 and "Resuming" not in fresh.stdout
    ck = resume_runs.copy("raw/ck", tmp_path)
    assert load_checkpoint(ck)["epoch"] == 1
    other = run_raw(
        "--num-gpus",
        2,
        *resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--resume", "--set", "momentum=0.5"),
    )
    assert other.returncode == 2 and "momentum (0.9 -> 0.5)" in other.stderr
    one_process = run_raw(*resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--resume"), "--num-gpus", 1)
    assert one_process.returncode == 2 and "written by 2 processes, this run has 1" in one_process.stderr


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_a_full_disk_stops_every_rank_and_the_previous_checkpoint_resumes(cifar_dir, small_disk, trainer):
    """A real ENOSPC (a tmpfs with room for one checkpoint of the width-32 model, not two): the second
    checkpoint fails however the library reports it (torch.save: RuntimeError; save_state: SafetensorError
    or RuntimeError); every rank stops at once with one error line naming the folder; once there is room
    the first checkpoint resumes."""
    from test_accel import CONFIGS, accelerate_launch

    disk = small_disk(checkpoint_bytes(32, momentum=True) * 3 // 2)
    # --dist-timeout 300: a rank left waiting for the one that failed would outlast the test's timeout
    small = [
        "--model-width",
        32,
        "--train-subset",
        64,
        "--val-subset",
        32,
        "--checkpoint-dir",
        disk,
        "--dist-timeout",
        300,
    ]
    if trainer == "raw":
        launch = lambda *extra: run_raw(*flags(cifar_dir, *small, *extra), timeout=240)
    else:
        launch = lambda *extra: accelerate_launch(
            CONFIGS / "two_cpus.yaml", "--cpu", "--data-dir", cifar_dir, "--set", "eval_batch_size=64", *small, *extra
        )
    result = launch("--epochs", 3)
    assert result.returncode != 0 and result.seconds < 180, result.stderr[-3000:]  # start-up (slow under 4 loaded
    # workers) and 2 epochs; a rank left waiting would take --dist-timeout (300 s) more
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]  # rank 0 says it once; rank 1 stops with it, silently
    assert f"no checkpoint could be written in {disk} (rank " in errors[0] and "No space left on device" in errors[0]
    assert "previous checkpoint there is intact" in errors[0]
    assert 'accel_train.py", line' not in result.stderr, result.stderr  # (torchrun adds its own traceback)
    assert result.stdout.count("Epoch = ") == 2  # it stopped at the failed write, not later
    if trainer == "raw":
        assert result.returncode == 2
        assert sorted(p.name for p in disk.iterdir()) == [".lock", "checkpoint.pt"]
        assert load_checkpoint(disk)["epoch"] == 1
    else:
        assert sorted(p.name for p in disk.iterdir()) == [".lock", "LATEST", "state-1"]  # the half-written one removed
        assert read_training_state(disk / "state-1")["epoch"] == 1
    small_disk(checkpoint_bytes(32, momentum=True) * 4)  # room again: the first checkpoint and the next
    resumed = launch("--epochs", 2, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and ": epoch 2, step 0" in resumed.stdout
    assert resumed.stdout.count("Epoch = ") == 1


# ----------------------------------------------------------------------------- preemption and faults


@pytest.mark.slow
def test_sigusr1_to_the_launcher_checkpoints_and_exits_75(cifar_dir, tmp_path):
    """SIGUSR1 to mp.spawn's launcher alone (Slurm's --signal=B:USR1): the launcher passes it on, the ranks write a
    checkpoint in the middle of epoch 2 and the run exits PREEMPTED_EXIT (75, on which the Slurm scripts requeue:
    tests/test_slurm.py). Its resume: test_a_stop_signal_checkpoints_and_the_run_resumes_exactly, below."""
    long_epochs = ["--batch-size", 4, "--epochs", 3, "--checkpoint-dir", tmp_path / "ck"]  # 40 steps per epoch
    proc = start([sys.executable, "raw_ddp.py", *flags(cifar_dir, *long_epochs, "--log-json", tmp_path / "l.jsonl")])
    wait_for_epoch(tmp_path / "l.jsonl")
    os.kill(proc.pid, signal.SIGUSR1)
    result = finish(proc, 60)
    assert result.returncode == PREEMPTED_EXIT, result.stderr
    assert "stopped by a signal at epoch 2, step" in result.stderr and "Traceback" not in result.stderr
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert (checkpoint["epoch"], checkpoint["finished"]) == (1, False) and 0 < checkpoint["step"] <= 40  # in epoch 2


def rank_processes(launcher_pid, count=2, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = [p for p in psutil.Process(launcher_pid).children() if "spawn_main" in " ".join(p.cmdline())]
        if len(children) == count:
            return sorted(children, key=lambda p: p.create_time())
        time.sleep(0.1)
    pytest.fail("ranks did not start")


@pytest.mark.slow
def test_killed_rank_ends_the_run_promptly_and_is_named(cifar_dir, tmp_path):
    """Rank 1 killed mid-run: rank 0 and the launcher end within seconds and name it. First, in the same run
    (one launch for two claims), the rendezvous: one node and no port given, the launcher itself listens on the
    store's port and both ranks are its clients; rank 0 serves nothing. (Before, the launcher picked a free port
    and rank 0 bound it seconds later, after importing torch: another program could take it meanwhile, and
    once in a parallel test run did: EADDRINUSE.)"""
    proc = start(
        [
            sys.executable,
            "raw_ddp.py",
            *flags(cifar_dir, "--batch-size", 4, "--epochs", 50, "--log-json", tmp_path / "l.jsonl"),
        ]
    )
    wait_for_epoch(tmp_path / "l.jsonl")
    ranks = rank_processes(proc.pid)
    launcher_sockets = psutil.Process(proc.pid).net_connections("tcp")
    listening = [c.laddr.port for c in launcher_sockets if c.status == psutil.CONN_LISTEN]
    assert len(listening) == 1, launcher_sockets
    for rank in ranks:
        sockets = rank.net_connections("tcp")
        assert any(c.raddr and c.raddr.port == listening[0] and c.status == psutil.CONN_ESTABLISHED for c in sockets), (
            sockets
        )
        assert not any(c.laddr.port == listening[0] and c.status == psutil.CONN_LISTEN for c in sockets), sockets
    ranks[1].kill()  # SIGKILL, as the OOM killer would
    t0 = time.monotonic()
    result = finish(proc, 90)
    assert time.monotonic() - t0 < 40
    assert result.returncode != 0 and "rank 1 was killed by SIGKILL" in result.stderr


# A rank that raises: tests/test_raw_ddp.py (conftest's rank_1_raises run, asserted there only).


DIVERGES = ["--set", "base_lr=1.0e+12"]  # a real divergence: the loss is finite at step 1, NaN from step 2


def check_diverged(stderr: str, traceback: str = "Traceback") -> None:
    """Both ranks named with the step they first saw it, one report (rank 0's), every rank stopped at one step;
    `traceback`: what a traceback through the trainer looks like (accelerate launch prints its own)."""
    assert stderr.count("error: non-finite loss in epoch 1 on rank(s) ") == 1, stderr[-3000:]
    found = re.search(
        r"rank\(s\) 0 \(first at step (\d+)\), 1 \(first at step (\d+)\): .*every rank stopped at "
        r"step (\d+)",
        stderr,
    )
    assert found and int(found[1]) == int(found[2]) <= int(found[3]) < 5, stderr[-3000:]  # mid-epoch: 5 steps
    # had the ranks stopped at different steps, one would be left in a collective and report lost contact
    assert "lost contact" not in stderr and traceback not in stderr


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_non_finite_loss_stops_every_rank_at_the_same_step(cifar_dir, trainer):
    if trainer == "raw":
        result = run_raw(*flags(cifar_dir, "--epochs", 2, *DIVERGES), timeout=180)
    else:
        result = accelerate_launch(CONFIGS / "two_cpus.yaml", *reliability_flags(cifar_dir, "--epochs", 2, *DIVERGES))
    assert result.returncode == 1, result.stderr[-3000:]
    check_diverged(result.stderr, traceback="Traceback" if trainer == "raw" else 'accel_train.py", line')
    assert "Epoch = " not in result.stdout


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_through_the_ranks(cifar_dir, tmp_path):
    """torchrun's agent passes SIGTERM on to its workers; the ranks agree, checkpoint and stop."""
    long_epochs = ["--batch-size", 4, "--epochs", 3, "--checkpoint-dir", tmp_path / "ck"]
    proc = start(
        torchrun_command("raw_ddp.py", *flags(cifar_dir, *long_epochs, "--log-json", tmp_path / "l.jsonl")[2:])
    )
    wait_for_epoch(tmp_path / "l.jsonl")
    os.kill(proc.pid, signal.SIGTERM)
    result = finish(proc, 90)
    assert result.returncode != 0  # torchrun reports its own SignalException
    assert "stopped by a signal at epoch 2, step" in result.stderr
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert (checkpoint["epoch"], checkpoint["finished"]) == (1, False) and checkpoint["step"] > 0


# ----------------------------------------------------------------------------- the stop -> checkpoint -> resume flow
# Once per trainer, here. It runs inside the safety net (test_safety_net.py has the rule): a resume that lost the
# scheduler's place among the net's epochs would train at the wrong rates and show in the weights.

# accelerate launch's status once its torchrun agent has passed a SIGTERM on: accelerate < 1.16 lets the agent's
# SignalException end the process (exit 1), 1.16 and later exit 128 + the signal.
LAUNCHER_SIGTERM_EXITS = (1, 128 + signal.SIGTERM)
NET = [
    *("--epochs", 2, "--target-accuracy", 0.0, "--patience", 6, "--set", "extra_epochs=4"),  # ends at epoch 6
    *("--set", "lr_schedule=warmup_linear", "--set", "warmup_epochs=0.5", "--batch-size", 2),
]


def preemptible(trainer, cifar_dir):
    """(command(*flags), environment) of 2-process runs of `trainer` with NET: 80 steps per epoch (320 images, 2 x 2
    a step), so that the stop lands in the middle of an epoch even when the signal comes late on a loaded machine."""
    if trainer == "raw":
        command = lambda *extra: [sys.executable, "raw_ddp.py", *flags(cifar_dir, *NET, *extra)]
        return command, cpu_env()
    # the device pipeline here; the per-image one resumes as exactly (tests/test_exact_resume.py)
    accel_flags = reliability_flags(cifar_dir, "--set", "data_pipeline=device", "--set", "augmentation=crop_flip", *NET)
    return lambda *extra: accelerate_command(CONFIGS / "two_cpus.yaml", *accel_flags, *extra), accel_env()


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_a_stop_signal_checkpoints_and_the_run_resumes_exactly(cifar_dir, tmp_path, trainer):
    """A SIGTERM as Slurm sends it: to raw_ddp.py's launcher and every rank (scancel, the time limit), to accelerate
    launch alone (--signal=B:TERM; its torchrun agent passes it on). Sent once the safety net's first epoch is
    logged, it stops the run in the middle of a later epoch: the ranks agree, write a checkpoint and exit 75
    (accelerate launch fails, as its agent re-raises the signal). --auto-resume continues from that step, and
    the run ends as one never stopped: the same epoch records, numbered on (one safety-net record, extra_epoch
    counted from the budget's end), and bit for bit the same weights (CPU: no loader workers; dropout active)."""
    command, env = preemptible(trainer, cifar_dir)
    straight = finish(start(command("--save", tmp_path / "s.pt", "--log-json", tmp_path / "s.jsonl"), env=env), 240)
    assert straight.returncode == 0, straight.stderr[-3000:]
    last_line = "Early stopping after epoch 6 (4 safety-net epoch(s) after the 2-epoch budget)"
    assert [int(n) for n in EPOCH_LINE.findall(straight.stdout)] == list(range(1, 7)) and last_line in straight.stdout

    ck, log = tmp_path / "ck", tmp_path / "l.jsonl"
    proc = start(command("--checkpoint-dir", ck, "--log-json", log), env=env)
    ranks = rank_processes(proc.pid) if trainer == "raw" else worker_processes(proc.pid)
    wait_for_epoch(log, text='"extra_epoch"')  # the net's first epoch (epoch 3) is logged
    os.killpg(proc.pid, signal.SIGTERM) if trainer == "raw" else proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, 240)
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)  # none left behind
    latest = RawCheckpointer(ck).path if trainer == "raw" else latest_checkpoint(ck)
    state = load_checkpoint(ck) if trainer == "raw" else read_training_state(latest)
    epoch, step = state["epoch"], state["step"]  # the epochs finished, the steps done of the next one
    if trainer == "raw":
        assert stopped.returncode == PREEMPTED_EXIT and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    else:
        assert stopped.returncode in LAUNCHER_SIGTERM_EXITS, stopped.stderr[-3000:]
        assert "Received 15 death signal" in stopped.stderr
    assert 3 <= epoch < 6 and 0 < step < 80 and not state["finished"], (epoch, step, stopped.stderr[-3000:])
    assert f"stopped by a signal at epoch {epoch + 1}, step {step}: checkpoint written" in stopped.stderr, (
        stopped.stderr[-3000:]
    )
    assert [int(n) for n in EPOCH_LINE.findall(stopped.stdout)] == list(range(1, epoch + 1))
    assert stopped.stdout.count("Safety net: ") == 1 and re.search(
        r"^Epoch =  2: .*\nSafety net: ", stopped.stdout, re.M
    ), stopped.stdout

    resumed = command("--checkpoint-dir", ck, "--auto-resume", "--log-json", log, "--save", tmp_path / "r.pt")
    resumed = finish(start(resumed, env=env), 240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {latest}: epoch {epoch + 1}, step {step} of 80" in resumed.stdout, resumed.stdout
    assert [int(n) for n in EPOCH_LINE.findall(resumed.stdout)] == list(range(epoch + 1, 7))
    assert last_line in resumed.stdout and "Safety net: " not in resumed.stdout  # said once, at the budget's end

    # The log as written (read_log would hide a repeated epoch): the stopped run's records, then the resumed
    # run's, each epoch once, and what each says the same as the run never stopped.
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["resumed_at"] for r in records if r["kind"] == "header"] == [None, {"epoch": epoch + 1, "step": step}]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(1, 7))
    assert [e.get("extra_epoch") for e in epochs] == [None, None, 1, 2, 3, 4]
    assert [e["epoch"] for e in epochs if "safety_net" in e] == [2]
    assert epochs[1]["safety_net"] == {"budget": 2, "extra_epochs": 4, "streak": 2, "patience": 6}
    course = lambda e: {
        k: e.get(k)
        for k in ("epoch", "extra_epoch", "safety_net", "val_loss", "val_accuracy", "train_correct", "train_seen")
    }
    assert [course(e) for e in epochs] == [course(e) for e in read_log(tmp_path / "s.jsonl")[1]]
    assert epochs[-1]["cumulative_time"] == pytest.approx(sum(e["epoch_time"] for e in epochs))
    a, b = torch.load(tmp_path / "s.pt"), torch.load(tmp_path / "r.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
