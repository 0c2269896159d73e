"""Elastic restarts: under torchrun --max-restarts a worker killed mid-run makes the agent start the group again;
the new group forms in a store of its own (launch.own_store_after_a_restart), resumes from the last checkpoint
(--auto-resume) and ends as the run never stopped."""

import json
import signal
import time

import pytest
import torch
from helpers import cpu_env, finish, raw_flags, start, torchrun_command, wait_for_epoch
from test_accel import worker_processes

from cifar_wrn.runlog import read_log


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_ends_as_one_never_stopped(cifar_dir, tmp_path):
    flags = raw_flags(cifar_dir, "--batch-size", 4, "--epochs", 3, "--set", "target_accuracy=1.0")
    straight = finish(
        start(torchrun_command("raw_ddp.py", *flags, "--save", tmp_path / "s.pt", "--log-json", tmp_path / "s.jsonl")),
        240,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    log, ck = tmp_path / "l.jsonl", tmp_path / "ck"
    elastic = torchrun_command("--max-restarts", 1, "raw_ddp.py", *flags, "--checkpoint-dir", ck, "--auto-resume")
    proc = start([*elastic, "--save", tmp_path / "r.pt", "--log-json", log], env=cpu_env())
    ranks = worker_processes(proc.pid, script="raw_ddp.py")
    wait_for_epoch(log)  # epoch 1 logged (and checkpointed right after)
    time.sleep(1)
    ranks[1].send_signal(signal.SIGKILL)
    done = finish(proc, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Resuming from" in done.stdout, done.stdout
    headers = [json.loads(line) for line in log.read_text().splitlines() if '"kind": "header"' in line]
    assert len(headers) == 2 and headers[1]["resumed_at"] is not None
    keys = ("epoch", "train_correct", "train_seen", "val_loss", "val_accuracy")
    numbers = lambda path: [tuple(e[k] for k in keys) for e in read_log(path)[1]]
    assert numbers(log) == numbers(tmp_path / "s.jsonl")
    a, b = torch.load(tmp_path / "s.pt"), torch.load(tmp_path / "r.pt")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
