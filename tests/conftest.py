"""The suite's options, tiers and shared fixtures (the helpers the test modules import are in tests/helpers.py, the
longer shared runs' code in tests/shared_runs.py).

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
import tempfile
from pathlib import Path

import pytest
import torch  # noqa: F401  first import runs ldconfig (a process): here, not inside whichever test imports it first
from helpers import (
    ACCEL_TINY,
    TINY,
    Result,
    cpu_env,
    data_flags,
    exit_threads_env,
    profile_flags,
    raise_in_rank_env,
    raw_ddp,
    run,
    torchrun_command,
    write_cifar,
)
from shared_runs import OneStepRuns, ResumeRuns, start_one_step_runs, start_resume_runs

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


@pytest.fixture(scope="session")
def resume_runs(cifar_dir, tmp_path_factory) -> ResumeRuns:
    """shared_runs.start_resume_runs: the three runs the resume tests of test_agreement.py and test_reliability.py
    resume from or compare with (a test that resumes into one copies its folder first)."""
    return start_resume_runs(cifar_dir, tmp_path_factory.mktemp("resume_runs"))


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


@pytest.fixture(scope="session")
def one_step_runs(cifar_dir, tmp_path_factory) -> dict[str, OneStepRuns]:
    """shared_runs.start_one_step_runs: each trainer's OneStepRuns ("raw", "accel"), the four runs side by side."""
    return start_one_step_runs(cifar_dir, tmp_path_factory.mktemp("one_step"))


@pytest.fixture(scope="session")
def rank_1_raises(cifar_dir) -> Result:
    """raw_ddp.py, 2 processes, rank 1 raising in its first loss computation (tests/raise_in_rank/): one run for
    test_raw_ddp.py's test_worker_that_raises_is_named_with_traceback (core) and
    test_rank_that_raises_ends_the_run_promptly (slow). --dist-timeout 300: rank 0, were it left waiting, would
    wait that long, so each test's bound on the run's time tells. The timeout (240 s) only kills a hang; the tests
    assert their own bounds on result.seconds."""
    flags = ["--num-gpus", 2, *TINY, *data_flags(cifar_dir), "--dist-timeout", 300]
    return raw_ddp(*flags, env=raise_in_rank_env(1, cpu_env()), timeout=240)
