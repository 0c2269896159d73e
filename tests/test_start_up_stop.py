"""A stop signal during a rank's start-up (the group forming, the data loading, the checkpoint's load, the warm-up)
ends the run as a stop during training does: at the first step the ranks agree, write a checkpoint and stop (75).
tests/stop_at_step's SLOW_START holds each rank 3 s in its data loading, so the signal lands there; the other case
signals while the ranks are still importing their modules."""

import os
import signal
import sys
import time

import pytest
from checks import load_checkpoint
from helpers import finish, raw_flags, start
from test_accel import CONFIGS, accelerate_command, reliability_flags
from test_exact_resume import environment
from test_reliability import rank_processes

from cifar_wrn.accel_side import latest_checkpoint
from cifar_wrn.resilience import PREEMPTED_EXIT


def wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} never appeared")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["importing", "loading data"])
def test_a_stop_signal_during_start_up_checkpoints_at_the_first_step(cifar_dir, tmp_path, when):
    ck, held = tmp_path / "ck", tmp_path / "held"
    held.mkdir()
    env = environment("raw", SLOW_START=held)
    command = [sys.executable, "raw_ddp.py", "--num-gpus", 2, *raw_flags(cifar_dir, "--checkpoint-dir", ck)]
    proc = start(command, env=env)
    if when == "importing":
        rank_processes(proc.pid, timeout=30)  # the ranks exist: they are importing torch
    else:
        wait_for(held / "rank-0")
    os.kill(proc.pid, signal.SIGUSR1)  # to the launcher, as Slurm's batch script passes it on
    stopped = finish(proc, 180)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert "stopped by a signal at epoch 1, step 1: checkpoint written" in stopped.stderr, stopped.stderr[-3000:]
    assert "killed" not in stopped.stderr and "Traceback" not in stopped.stderr
    assert (load_checkpoint(ck)["epoch"], load_checkpoint(ck)["step"]) == (0, 1)


@pytest.mark.slow
def test_sigterm_to_accelerate_launch_during_start_up_checkpoints_at_the_first_step(cifar_dir, tmp_path):
    ck, held = tmp_path / "ck", tmp_path / "held"
    held.mkdir()
    env = environment("accel", SLOW_START=held)
    proc = start(
        accelerate_command(CONFIGS / "two_cpus.yaml", *reliability_flags(cifar_dir, "--checkpoint-dir", ck)), env
    )
    wait_for(held / "rank-0")
    proc.send_signal(signal.SIGTERM)  # its torchrun agent passes it on to the ranks
    stopped = finish(proc, 180)
    assert "stopped by a signal at epoch 1, step 1: checkpoint written" in stopped.stderr, stopped.stderr[-3000:]
    assert latest_checkpoint(ck) is not None
