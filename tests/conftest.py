"""The suite's options, tiers and shared fixtures (the helpers the test modules import are in tests/helpers.py).

The tiers (docs/development.md): every test that starts a process (a training run, a shell, a Slurm job) says so
in its file with `@pytest.mark.slow`. As in pytest's documented `--runslow` example, `python -m pytest` skips
them, so that it runs exactly what `-m "not slow"` selects; `--runslow` runs them all. The tests that use the
real Slurm cluster (the `cluster` fixture: daemons, as root) are marked `slurm` here and run only with `--slurm`;
asked for, a cluster that cannot start fails them instead of skipping them. A test that starts a process without
being marked `slow` fails at once (no_process_in_the_fast_tier), unless it is marked `core`: one of the few
end-to-end runs the quick tier keeps.
"""

import atexit
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch  # noqa: F401  first import runs ldconfig (a process): here, not inside whichever test imports it first
from helpers import (
    ACCEL_TINY,
    ONE_STEP,
    TINY,
    Result,
    cpu_env,
    data_flags,
    exit_threads_env,
    finish,
    profile_flags,
    raise_in_rank_env,
    raw_ddp,
    resume_flags,
    run,
    start,
    torchrun_command,
    write_cifar,
)

# Runs that are not given --log-json write a run folder under $RUNS_DIR: the tests' go to a folder of their own,
# never into the checkout's runs/, where a student's report would pick them up.
os.environ["RUNS_DIR"] = tempfile.mkdtemp(prefix="cifar-wrn-test-runs-")
atexit.register(shutil.rmtree, os.environ["RUNS_DIR"], True)


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="run the tests marked slow, every test that starts a process (the full suite)",
    )
    parser.addoption(
        "--slurm",
        action="store_true",
        default=False,
        help="run the tests under a real Slurm: starts munged, slurmctld and two slurmd daemons (root, "
        "Debian's slurm and munge packages installed); they fail if it cannot start",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cluster" in item.fixturenames:  # tests/test_slurm.py's session cluster: real daemons
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("slurm"):
            if not config.getoption("--slurm"):
                item.add_marker(pytest.mark.skip(reason="starts a real Slurm (daemons, as root): pass --slurm"))
        elif item.get_closest_marker("slow") and not config.getoption("--runslow"):
            item.add_marker(pytest.mark.skip(reason="slow (starts processes): pass --runslow for the full suite"))
    # Longest first: the Slurm jobs that train (minutes each, much of it waiting on the scheduler), then the other
    # tests that start processes, then those that start none; otherwise a job started last keeps one worker busy
    # while the others idle. (A stable sort: each file's tests keep their order.)
    items.sort(
        key=lambda item: (
            0
            if {"cluster", "cifar_dir"} <= set(item.fixturenames)
            else 1
            if item.get_closest_marker("slow") or item.get_closest_marker("core")
            else 2
        )
    )


@pytest.fixture(autouse=True)
def no_process_in_the_fast_tier(request, monkeypatch):
    """A test marked neither slow nor core must not start a process: fail at once, before anything starts."""
    if request.node.get_closest_marker("slow") is None and request.node.get_closest_marker("core") is None:

        def refuse(*args, **kwargs):
            pytest.fail(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow", pytrace=True)

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        monkeypatch.setattr(os, "fork", refuse)
        monkeypatch.setattr(os, "posix_spawn", refuse)
        monkeypatch.setattr(os, "system", refuse)


# ---- shared runs: tests that only read what a run printed and wrote share it. Under pytest-xdist each worker
# would build a session fixture again: the tests that use one carry @pytest.mark.xdist_group(<its name>), and
# pyproject.toml's --dist loadgroup sends each group to one worker.


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """A data dir with 320 training and 101 validation images; use --train-subset/--val-subset."""
    return write_cifar(tmp_path_factory.mktemp("cifar"))


@pytest.fixture(scope="session")
def two_process_run(cifar_dir, tmp_path_factory) -> tuple[Result, Path]:
    """One plain 2-process run: (result, folder holding w.pt, log.jsonl and threads/, the threads each process ran
    at exit). 2 epochs: at most 6, stopped early by a target of 0 with patience 2; base_lr 0.02 learns in 10 steps."""
    out = tmp_path_factory.mktemp("run")
    result = raw_ddp(
        *["--num-nodes", 1, "--node-id", 0, "--num-gpus", 2, *TINY, *data_flags(cifar_dir)],
        *["--epochs", 6, "--target-accuracy", 0.0, "--patience", 2, "--set", "momentum=0.9", "--base-lr", 0.02],
        *["--save", out / "w.pt", "--log-json", out / "log.jsonl"],
        env=exit_threads_env(out / "threads", cpu_env()),
    )
    return result, out


@dataclass
class ResumeRuns:
    checkpoint: Result  # raw_ddp.py --epochs 1 --auto-resume into an empty folder: folder/raw/ck, folder/raw/l.jsonl
    straight: Result  # raw_ddp.py --epochs 2, never stopped: folder/straight/w.pt, folder/straight/l.jsonl
    accel: Result  # accel_train.py --epochs 1 (test_accel.reliability_flags): folder/accel/ck
    folder: Path

    def copy(self, name: str, into: Path) -> Path:
        """A test's own copy of folder/name, as into/<its last part>: to resume into, the shared runs unchanged."""
        return Path(shutil.copytree(self.folder / name, into / Path(name).name))


@pytest.fixture(scope="session")
def resume_runs(cifar_dir, tmp_path_factory) -> ResumeRuns:
    """The three runs the resume tests of test_agreement.py and test_reliability.py resume from or compare with,
    started side by side (test start-up, not training, is what a run costs). A test that resumes into one (or only
    might write into it) copies its folder first; a test resuming raw_ddp.py's must pass helpers.resume_flags, as
    the runs did: the checkpoint records the data and batch size and refuses others."""
    from test_accel import CONFIGS, accelerate_launch, reliability_flags

    folder = tmp_path_factory.mktemp("resume_runs")
    raw, straight = folder / "raw", folder / "straight"
    raw.mkdir()
    straight.mkdir()
    procs = [
        start([sys.executable, "raw_ddp.py", "--num-gpus", 2, *resume_flags(cifar_dir, *extra)])
        for extra in (
            ["--epochs", 1, "--checkpoint-dir", raw / "ck", "--auto-resume", "--log-json", raw / "l.jsonl"],
            ["--epochs", 2, "--save", straight / "w.pt", "--log-json", straight / "l.jsonl"],
        )
    ]
    accel = accelerate_launch(
        CONFIGS / "two_cpus.yaml",  # meanwhile, the raw runs go on
        *reliability_flags(cifar_dir, "--epochs", 1, "--checkpoint-dir", folder / "accel" / "ck"),
    )
    runs = ResumeRuns(*(finish(p, 240) for p in procs), accel, folder)  # 240 s: three runs at once on a loaded machine
    for result in (runs.checkpoint, runs.straight, runs.accel):
        assert result.returncode == 0, result.stderr[-3000:]
    return runs


@pytest.fixture(scope="session")
def torchrun_profile_run(cifar_dir, tmp_path_factory) -> tuple[Result, Path]:
    """raw_ddp.py started by torchrun (2 processes), 2 epochs of a width-8 model in bf16 with --profile and
    --trace: (result, folder holding log.jsonl and trace/). tests/test_raw_ddp.py's torchrun launch and
    tests/test_profile.py's profile test read it (one launch for both: the launcher does not matter to the
    profile, the profile not to the launch)."""
    out = tmp_path_factory.mktemp("torchrun_profile")
    flags = [*TINY, "--model-width", 8, "--set", "precision=bf16", *data_flags(cifar_dir), *profile_flags(out)]
    return run(torchrun_command("raw_ddp.py", *flags), timeout=300), out


@pytest.fixture(scope="session")
def bf16_profile_run(cifar_dir, tmp_path_factory) -> tuple[Result, Path]:
    """accel_train.py with ACCELERATE_USE_CPU=1 and the (bf16) benchmark config, 2 epochs of a width-8 model with
    --profile and --trace: (result, folder holding log.jsonl and trace/), as torchrun_profile_run is raw_ddp.py's.
    One launch shared by tests/test_accel.py's test_environment_form_and_bf16_from_the_launch_config (how the
    launch is configured) and tests/test_profile.py's profile test (what --profile records): neither claim depends
    on the other's flags, and a launch costs ~20 CPU-seconds of start-up."""
    from test_accel import CONFIGS, accel_env, accelerate_launch

    out = tmp_path_factory.mktemp("bf16_profile")
    result = accelerate_launch(
        CONFIGS / "two_gpus.yaml",
        *data_flags(cifar_dir),
        *ACCEL_TINY,
        "--model-width",
        8,
        *profile_flags(out),
        env=accel_env(ACCELERATE_USE_CPU=1),
    )
    return result, out


# One step of clipped SGD: each step at a non-zero rate moves the parameters by exactly lr x 0.001 (L2);
# warmup_linear over one step gives the step the rate factor 1, as the constant schedule would.
CLIPPED = ["--base-lr", 1.0, "--set", "grad_clip_norm=0.001", "--set", "lr_schedule=warmup_linear"]


@dataclass
class OneStepRuns:
    """One trainer's two runs of one SGD step (helpers.ONE_STEP) on 2 processes, from the same weights (the same
    seed gives them, whichever launcher starts the ranks)."""

    start: Result  # at a learning rate of 1e-12 (the weights move by ~1e-12): the point the step is measured from
    start_weights: Path
    start_log: Path
    clipped: Result  # at learning rate 1 with grad_clip_norm=0.001 (CLIPPED)
    clipped_weights: Path


@pytest.fixture(scope="session")
def one_step_runs(cifar_dir, tmp_path_factory) -> dict[str, OneStepRuns]:
    """Each trainer's OneStepRuns ("raw", "accel"), the four runs started side by side. accel_train.py's start
    is launched by torchrun (tests/test_raw_ddp.py's test_torchrun_launch reads it), its clipped run by
    `accelerate launch`; raw_ddp.py starts its own processes (--num-gpus 2). test_fast.py's
    test_grad_clip_norm_bounds_the_step measures the step of each."""
    from test_accel import CONFIGS, TIMEOUT, accel_env, accelerate_command

    folder = tmp_path_factory.mktemp("one_step")
    commands = {}
    for trainer in ("raw", "accel"):
        (folder / trainer).mkdir()
        start_run = ["--base-lr", 1e-12, "--save", folder / trainer / "start.pt"]
        start_run += ["--log-json", folder / trainer / "start.jsonl"]
        clipped_run = [*CLIPPED, "--save", folder / trainer / "clipped.pt"]
        if trainer == "raw":
            raw = [sys.executable, "raw_ddp.py", "--num-gpus", 2, *TINY, *ONE_STEP, "--data-dir", cifar_dir]
            commands[trainer] = [([*raw, *start_run], cpu_env()), ([*raw, *clipped_run], cpu_env())]
        else:
            accel = ["--data-dir", cifar_dir, *ACCEL_TINY, *ONE_STEP]
            commands[trainer] = [
                (torchrun_command("accel_train.py", *accel, *start_run), accel_env(ACCELERATE_USE_CPU=1)),
                (accelerate_command(CONFIGS / "two_cpus.yaml", "--cpu", *accel, *clipped_run), accel_env()),
            ]
    procs = {trainer: [start(cmd, env=env) for cmd, env in pair] for trainer, pair in commands.items()}
    return {
        trainer: OneStepRuns(
            finish(started, TIMEOUT),
            folder / trainer / "start.pt",
            folder / trainer / "start.jsonl",
            finish(clipped, TIMEOUT),
            folder / trainer / "clipped.pt",
        )
        for trainer, (started, clipped) in procs.items()
    }


@pytest.fixture(scope="session")
def rank_1_raises(cifar_dir) -> Result:
    """raw_ddp.py, 2 processes, rank 1 raising in its first loss computation (tests/raise_in_rank/): one run for
    test_raw_ddp.py's test_worker_that_raises_is_named_with_traceback (core) and
    test_rank_that_raises_ends_the_run_promptly (slow). --dist-timeout 300: rank 0, were it left waiting, would
    wait that long, so each test's bound on the run's time tells. The timeout (240 s) only kills a hang; the tests
    assert their own bounds on result.seconds."""
    flags = ["--num-gpus", 2, *TINY, *data_flags(cifar_dir), "--dist-timeout", 300]
    return raw_ddp(*flags, env=raise_in_rank_env(1, cpu_env()), timeout=240)
