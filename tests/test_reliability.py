"""Checkpoint and resume, preemption, crashed ranks, non-finite loss: nothing lost, nothing hangs."""
import os
import signal
import sys
import time

import psutil
import pytest
import torch

from cifar_wrn.checkpoint import CheckpointError, check_writable, load_checkpoint, resume_problem, save_atomic
from cifar_wrn.runlog import read_log
from conftest import wait_for_epoch, TINY, TRAIN_IMAGES, VAL_IMAGES, cpu_env, finish, raw_ddp as run_raw, start

PREEMPTED_EXIT = 75


def flags(cifar_dir, *extra):
    return ["--num-gpus", 2, *TINY, "--data-dir", cifar_dir, "--train-subset", TRAIN_IMAGES, "--val-subset",
            VAL_IMAGES, "--dist-timeout", 60, *extra]


# ----------------------------------------------------------------------------- pure pieces

def test_atomic_write_keeps_the_old_checkpoint_on_a_full_disk(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomic({"epoch": 1}, path)
    with pytest.raises(OSError, match="No space left"):
        save_atomic({"epoch": 2, "big": torch.zeros(10_000)}, path, simulate_enospc=True)
    assert torch.load(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


def test_unwritable_checkpoint_dir_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        check_writable(tmp_path / "file" / "sub")


def test_resume_problems_are_named():
    recipe = {"epochs": 3, "lr_schedule": "constant", "base_lr": 0.01, "patience": 2}
    checkpoint = {"world_size": 2, "model_width": 4, "recipe": dict(recipe, epochs=2)}
    assert resume_problem(checkpoint, recipe, 2, 4) is None  # more epochs on a constant schedule: fine
    assert "written by 2 processes, this run has 4" in resume_problem(checkpoint, recipe, 4, 4)
    assert "base_lr (0.01 -> 0.1)" in resume_problem(checkpoint, dict(recipe, base_lr=0.1), 2, 4)
    warm = dict(recipe, lr_schedule="warmup_linear")
    assert "epochs (2 -> 3)" in resume_problem({**checkpoint, "recipe": dict(warm, epochs=2)}, warm, 2, 4)
    # a checkpoint older than a recipe key: it was written with that key's default
    assert resume_problem(checkpoint, dict(recipe, bn_lr_scale=1.0), 2, 4) is None
    assert "bn_lr_scale (1.0 -> 2.0)" in resume_problem(checkpoint, dict(recipe, bn_lr_scale=2.0), 2, 4)


# ----------------------------------------------------------------------------- resume

def test_resumed_run_equals_uninterrupted_run(cifar_dir, tmp_path):
    straight = run_raw(*flags(cifar_dir, "--epochs", 3, "--save", tmp_path / "a.pt", "--log-json", tmp_path / "a.jsonl"))
    assert straight.returncode == 0, straight.stderr
    first = run_raw(*flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", tmp_path / "ck",
                           "--log-json", tmp_path / "b.jsonl"))
    assert first.returncode == 0, first.stderr
    second = run_raw(*flags(cifar_dir, "--epochs", 3, "--checkpoint-dir", tmp_path / "ck", "--resume",
                            "--save", tmp_path / "b.pt", "--log-json", tmp_path / "b.jsonl"))
    assert second.returncode == 0, second.stderr
    assert "Resuming from" in second.stdout and second.stdout.count("Epoch = ") == 1
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # identical weights
    (_, ea), (_, eb) = read_log(tmp_path / "a.jsonl"), read_log(tmp_path / "b.jsonl")
    assert [(e["epoch"], e["val_loss"], e["val_accuracy"]) for e in ea] == \
           [(e["epoch"], e["val_loss"], e["val_accuracy"]) for e in eb]  # identical per-epoch metrics
    assert eb[-1]["cumulative_time"] == pytest.approx(sum(e["epoch_time"] for e in eb))


def test_resume_refusals(cifar_dir, tmp_path):
    missing = run_raw(*flags(cifar_dir, "--epochs", 1, "--checkpoint-dir", tmp_path / "none", "--resume"))
    assert missing.returncode == 2 and "no checkpoint at" in missing.stderr and "Traceback" not in missing.stderr
    fresh = run_raw(*flags(cifar_dir, "--epochs", 1, "--checkpoint-dir", tmp_path / "ck", "--auto-resume"))
    assert fresh.returncode == 0 and "Resuming" not in fresh.stdout
    assert load_checkpoint(tmp_path / "ck")["epoch"] == 1
    other = run_raw(*flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", tmp_path / "ck", "--resume",
                           "--set", "momentum=0.5"))
    assert other.returncode == 2 and "momentum (0.0 -> 0.5)" in other.stderr
    one_process = run_raw(*flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", tmp_path / "ck", "--resume"),
                          "--num-gpus", 1)
    assert one_process.returncode == 2 and "written by 2 processes, this run has 1" in one_process.stderr


def test_full_disk_during_checkpoint_keeps_the_previous_one(cifar_dir, tmp_path):
    result = run_raw(*flags(cifar_dir, "--epochs", 3, "--checkpoint-dir", tmp_path / "ck"),
                     env=cpu_env(CIFAR_WRN_TEST_ENOSPC_AT_EPOCH=2))
    assert result.returncode == 2
    assert "could not write" in result.stderr and "No space left on device" in result.stderr
    assert "previous checkpoint is intact" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout.count("Epoch = ") == 2  # it stopped at the failed write, not later
    assert load_checkpoint(tmp_path / "ck")["epoch"] == 1
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["checkpoint.pt"]


# ----------------------------------------------------------------------------- preemption and faults

def test_sigusr1_to_the_launcher_checkpoints_and_requeues(cifar_dir, tmp_path):
    long_epochs = ["--batch-size", 4, "--epochs", 3, "--checkpoint-dir", tmp_path / "ck"]  # 40 steps per epoch
    proc = start([sys.executable, "raw_ddp.py", *flags(cifar_dir, *long_epochs, "--log-json", tmp_path / "l.jsonl")])
    wait_for_epoch(tmp_path / "l.jsonl")
    os.kill(proc.pid, signal.SIGUSR1)
    result = finish(proc, 60)
    assert result.returncode == PREEMPTED_EXIT, result.stderr
    assert "stopped by a signal at epoch 2, step" in result.stderr and "Traceback" not in result.stderr
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert (checkpoint["epoch"], checkpoint["finished"]) == (1, False) and 0 < checkpoint["step"] <= 40  # in epoch 2
    assert checkpoint["step"] % 10 == 0  # ranks agree every CHECK_EVERY = 10 steps (40 is also the epoch's end)
    resumed = run_raw(*flags(cifar_dir, *long_epochs, "--auto-resume", "--log-json", tmp_path / "l.jsonl"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming from {tmp_path / 'ck' / 'checkpoint.pt'}: epoch 2, step {checkpoint['step']}" in resumed.stdout
    _, epochs = read_log(tmp_path / "l.jsonl")
    assert [e["epoch"] for e in epochs] == [1, 2, 3]


def rank_processes(launcher_pid, count=2, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = [p for p in psutil.Process(launcher_pid).children()
                    if "spawn_main" in " ".join(p.cmdline())]
        if len(children) == count:
            return sorted(children, key=lambda p: p.create_time())
        time.sleep(0.1)
    pytest.fail("ranks did not start")


def test_killed_rank_ends_the_run_promptly_and_is_named(cifar_dir, tmp_path):
    proc = start([sys.executable, "raw_ddp.py", *flags(cifar_dir, "--batch-size", 4, "--epochs", 50,
                                                       "--log-json", tmp_path / "l.jsonl")])
    wait_for_epoch(tmp_path / "l.jsonl")
    rank_processes(proc.pid)[1].kill()  # SIGKILL, as the OOM killer would
    t0 = time.monotonic()
    result = finish(proc, 90)
    assert time.monotonic() - t0 < 40
    assert result.returncode != 0 and "rank 1 was killed by SIGKILL" in result.stderr


def test_rank_that_raises_ends_the_run_promptly(cifar_dir):
    result = run_raw(*flags(cifar_dir), env=cpu_env(CIFAR_WRN_TEST_RAISE_IN_RANK=1), timeout=90)
    assert result.returncode == 1 and result.seconds < 40
    assert "error: rank 1 failed" in result.stderr and "injected test fault in rank 1" in result.stderr


def test_non_finite_loss_stops_every_rank_at_the_same_step(cifar_dir):
    result = run_raw(*flags(cifar_dir, "--epochs", 2), env=cpu_env(CIFAR_WRN_TEST_NAN_AT="1,1,3"), timeout=90)
    assert result.returncode == 1
    # rank 1's loss is NaN at step 3; the ranks agree at the epoch's last step (5: 160 images per rank,
    # 32 per step; before CHECK_EVERY) and rank 0 reports once
    # (rank 0 follows at step 4: the all-reduce spreads rank 1's NaN gradients into its weights)
    assert result.stderr.count("error: non-finite loss in epoch 1 on rank(s) ") == 1
    assert "1 (first at step 3)" in result.stderr and "0 (first at step 4)" in result.stderr
    assert "every rank stopped at step 5" in result.stderr
    # had the ranks stopped at different steps, one would be left in a collective and report lost contact
    assert "lost contact" not in result.stderr and "Traceback" not in result.stderr
    assert "Epoch = " not in result.stdout


def test_sigterm_to_torchrun_checkpoints_through_the_ranks(cifar_dir, tmp_path):
    """torchrun's agent passes SIGTERM on to its workers; the ranks agree, checkpoint and stop."""
    from conftest import free_port
    long_epochs = ["--batch-size", 4, "--epochs", 3, "--checkpoint-dir", tmp_path / "ck"]
    proc = start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 2, "--master_port", free_port(),
                  "raw_ddp.py", *flags(cifar_dir, *long_epochs, "--log-json", tmp_path / "l.jsonl")[2:]])
    wait_for_epoch(tmp_path / "l.jsonl")
    os.kill(proc.pid, signal.SIGTERM)
    result = finish(proc, 90)
    assert result.returncode != 0  # torchrun reports its own SignalException
    assert "stopped by a signal at epoch 2, step" in result.stderr
    checkpoint = load_checkpoint(tmp_path / "ck")
    assert checkpoint["epoch"] == 1 and checkpoint["step"] % 10 == 0 and checkpoint["step"] > 0
    resumed = run_raw(*flags(cifar_dir, *long_epochs, "--auto-resume", "--log-json", tmp_path / "l.jsonl"))
    assert resumed.returncode == 0, resumed.stderr
    _, epochs = read_log(tmp_path / "l.jsonl")
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
