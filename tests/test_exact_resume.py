"""A resume is exact: a run stopped in the middle of an epoch and resumed ends bit for bit as the run never stopped,
for both trainers, both pipelines, with and without DataLoader workers, at 2 and at 3 processes.

The stop is asked for at a set step by tests/stop_at_step (as a SIGUSR1 then would), so each case stops where
it is meant to; LOADER_WORKERS gives the CPU's loaders worker processes, as GPUs have."""

import sys
from pathlib import Path

import pytest
import torch
from helpers import EPOCH_LINE, cpu_env, data_flags, finish, pythonpath_with, start
from test_accel import ACCEL_TINY, CONFIGS, accel_env

from cifar_wrn.resilience import PREEMPTED_EXIT
from cifar_wrn.runlog import read_log

STOP_AT_STEP = Path(__file__).parent / "stop_at_step"
TRAIN, VAL, BATCH, EPOCHS = 240, 64, 4, 2  # 20 steps an epoch at 3 processes, 30 at 2
RECIPE = ["--recipe", "baseline", "--batch-size", BATCH, "--epochs", EPOCHS, "--set", "target_accuracy=1.0"]
PIPELINES = {"dataloader": [], "device": ["--set", "data_pipeline=device", "--set", "augmentation=crop_flip"]}


def command(trainer: str, world_size: int, pipeline: str, data_dir, *extra) -> list:
    common = [*data_flags(data_dir, TRAIN, VAL), *RECIPE, *PIPELINES[pipeline], "--dist-timeout", 60, *extra]
    if trainer == "raw":
        return [sys.executable, "raw_ddp.py", "--num-gpus", world_size, "--device", "cpu", "--model-width", 4, *common]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / "two_cpus.yaml"]
    return [*launch, "--num_processes", world_size, "accel_train.py", "--cpu", *ACCEL_TINY, *common]


def environment(trainer: str, **extra) -> dict:
    env = cpu_env() if trainer == "raw" else accel_env()
    env["PYTHONPATH"] = pythonpath_with(STOP_AT_STEP, env=env)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def course_numbers(log) -> list:
    keys = ("epoch", "train_correct", "train_seen", "val_loss", "val_accuracy")
    return [tuple(e[k] for k in keys) for e in read_log(log)[1]]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, cifar_dir):
    """One run never stopped per (trainer, world size, pipeline), made once: its log and weights."""
    made = {}

    def straight(trainer, world_size, pipeline):
        key = (trainer, world_size, pipeline)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"straight-{trainer}-{world_size}-{pipeline}")
            run = command(trainer, world_size, pipeline, cifar_dir, "--log-json", folder / "l.jsonl")
            done = finish(start([*run, "--save", folder / "w.pt"], env=environment(trainer)), 300)
            assert done.returncode == 0, done.stderr[-3000:]
            made[key] = folder
        return made[key]

    return straight


# Each pipeline at 2 and 3 processes, each trainer; workers where they exist (the per-image pipeline) at 3.
CASES = [
    ("raw", 2, "dataloader", 0),
    ("raw", 3, "dataloader", 2),
    ("raw", 3, "device", 0),
    ("accel", 2, "dataloader", 0),
    ("accel", 3, "dataloader", 2),
    ("accel", 3, "device", 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("trainer, world_size, pipeline, workers", CASES)
def test_a_run_stopped_mid_epoch_and_resumed_ends_as_the_run_never_stopped(
    cifar_dir, tmp_path, straight_runs, trainer, world_size, pipeline, workers
):
    straight = straight_runs(trainer, world_size, pipeline)  # without workers: they change no number
    ck, log, weights = tmp_path / "ck", tmp_path / "l.jsonl", tmp_path / "w.pt"
    run = command(trainer, world_size, pipeline, cifar_dir, "--checkpoint-dir", ck, "--log-json", log)
    env = dict(LOADER_WORKERS=workers) if workers else {}
    stopped = finish(start(run, env=environment(trainer, STOP_AT="2,3", **env)), 300)
    if trainer == "raw":
        assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert "stopped by a signal at epoch 2, step" in stopped.stderr, stopped.stderr[-3000:]
    assert [int(n) for n in EPOCH_LINE.findall(stopped.stdout)] == [1]

    resumed = finish(start([*run, "--auto-resume", "--save", weights], env=environment(trainer, **env)), 300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and [int(n) for n in EPOCH_LINE.findall(resumed.stdout)] == [2]
    assert course_numbers(log) == course_numbers(straight / "l.jsonl")
    a, b = torch.load(straight / "w.pt"), torch.load(weights)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
