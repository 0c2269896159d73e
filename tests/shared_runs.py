"""The shared runs that take more than a few lines to start (conftest.py's session fixtures resume_runs and
one_step_runs call these): the runs side by side, and what each holds."""

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from helpers import ACCEL_TINY, ONE_STEP, TINY, Result, cpu_env, finish, resume_flags, start, torchrun_command


@dataclass
class ResumeRuns:
    checkpoint: Result  # raw_ddp.py --epochs 1 --auto-resume into an empty folder: folder/raw/ck, folder/raw/l.jsonl
    straight: Result  # raw_ddp.py --epochs 2, never stopped: folder/straight/w.pt, folder/straight/l.jsonl
    accel: Result  # accel_train.py --epochs 1 (test_accel.reliability_flags): folder/accel/ck
    folder: Path

    def copy(self, name: str, into: Path) -> Path:
        """A test's own copy of folder/name, as into/<its last part>: to resume into, the shared runs unchanged."""
        return Path(shutil.copytree(self.folder / name, into / Path(name).name))


def start_resume_runs(cifar_dir, folder: Path) -> ResumeRuns:
    """The three runs the resume tests of test_agreement.py and test_reliability.py resume from or compare with,
    started side by side (test start-up, not training, is what a run costs). A test that resumes into one (or only
    might write into it) copies its folder first; a test resuming raw_ddp.py's must pass helpers.resume_flags, as
    the runs did: the checkpoint records the data and batch size and refuses others."""
    from test_accel import CONFIGS, accelerate_launch, reliability_flags

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


def start_one_step_runs(cifar_dir, folder: Path) -> dict[str, OneStepRuns]:
    """Each trainer's OneStepRuns ("raw", "accel"), the four runs started side by side. accel_train.py's start
    is launched by torchrun (tests/test_raw_ddp.py's test_torchrun_launch reads it), its clipped run by
    `accelerate launch`; raw_ddp.py starts its own processes (--num-gpus 2). test_fast.py's
    test_grad_clip_norm_bounds_the_step measures the step of each."""
    from test_accel import CONFIGS, TIMEOUT, accel_env, accelerate_command

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
