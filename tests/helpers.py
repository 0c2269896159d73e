"""What the test modules share: a small synthetic CIFAR-10 in the official layout, the trainers' tiny flags, and
process runs that cannot hang (a session of their own, a timeout that kills every process they started)."""

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
LEAN_GC = TESTS / "lean_gc"

PER_TRAIN_FILE = 64  # 5 files -> 320 training images
VAL_IMAGES = 101  # odd on purpose: DistributedSampler must pad it for 2 ranks
TRAIN_IMAGES = 5 * PER_TRAIN_FILE


def synthetic_batch(n: int, seed: int) -> dict:
    """Learnable images: each class is its own mean colour plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    palette = np.random.default_rng(1234).integers(30, 225, (10, 3))
    images = palette[labels][:, :, None, None] + rng.normal(0, 25, (n, 3, 32, 32))
    data = np.clip(images, 0, 255).astype(np.uint8).reshape(n, 3072)
    return {"data": data, "labels": labels.tolist()}


def write_cifar(root: Path, per_train_file=PER_TRAIN_FILE, val_images=VAL_IMAGES) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(synthetic_batch(per_train_file, seed=i), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(synthetic_batch(val_images, seed=99), f)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def pythonpath_with(*folders, env: dict) -> str:
    """`env`'s PYTHONPATH with `folders` first (a sitecustomize module there is the one Python imports)."""
    return os.pathsep.join(filter(None, [*map(str, folders), env.get("PYTHONPATH")]))


def cpu_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore::UserWarning")
    # Every Python process started with this environment collects garbage less often, and not at exit
    # (tests/lean_gc/sitecustomize.py): a quarter of the CPU time a test run of raw_ddp.py costs.
    env["PYTHONPATH"] = pythonpath_with(LEAN_GC, env=env)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def raise_in_rank_env(rank: int, env: dict) -> dict:
    """`env` with tests/raise_in_rank/ first on PYTHONPATH: rank `rank` raises in its first loss computation.
    The checkout comes next, so that the processes import its cifar_wrn, whatever pip installed."""
    return {**env, "PYTHONPATH": pythonpath_with(TESTS / "raise_in_rank", REPO, env=env), "RAISE_IN_RANK": str(rank)}


def slow_rank_env(folder: Path, env: dict) -> dict:
    """`env` with tests/slow_rank/ first on PYTHONPATH (then the checkout, whose cifar_wrn it patches): rank 1's
    epochs take twice as long, and every rank writes the epoch time its clock measured to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = pythonpath_with(TESTS / "slow_rank", REPO, env=env)
    return {**env, "PYTHONPATH": path, "SLOW_RANK_DIR": str(folder)}


def exit_threads_env(folder: Path, env: dict) -> dict:
    """`env` with tests/exit_threads/ first on PYTHONPATH: every process writes to `folder` the threads it still
    runs at exit (check_no_gloo_thread_at_exit reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {**env, "PYTHONPATH": pythonpath_with(TESTS / "exit_threads", env=env), "EXIT_THREADS_DIR": str(folder)}


def check_no_gloo_thread_at_exit(folder: Path) -> None:
    """No process started with exit_threads_env(folder, ...) still ran a gloo thread at exit (the launcher and the
    two ranks, at least, wrote what they ran)."""
    threads = {file.name: file.read_text().split("\n") for file in folder.iterdir()}
    assert len(threads) >= 3, threads
    assert {pid: names for pid, names in threads.items() if any("gloo" in name for name in names)} == {}


def start(cmd, env=None, cwd=REPO) -> subprocess.Popen:
    """A new session, so that a timeout can kill the launcher and every rank it spawned (kill_all)."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the process started by start(), its group, and every process descending from it. The group alone
    is not enough: torchrun's agent (which accelerate launch runs too) starts each rank in a session of its own,
    and a rank left alive holds the test's pipes open, so that communicate() would wait for it, a hang."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)  # before the kill orphans them
    except psutil.Error:
        descendants = []
    os.killpg(proc.pid, signal.SIGKILL)
    for process in descendants:
        try:
            process.kill()
        except psutil.Error:  # gone already
            pass


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    import time

    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s (every process killed)\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - t0)


def run(cmd, timeout: float = 180, env=None) -> Result:
    return finish(start(cmd, env), timeout)


def raw_ddp(*flags, timeout: float = 180, env=None) -> Result:
    return run([sys.executable, "raw_ddp.py", *flags], timeout=timeout, env=env)


# The tiny model the tests train: raw_ddp.py's flags (TINY) and accel_train.py's (ACCEL_TINY: its device comes from
# the launch or --cpu; eval_batch_size 16 gives several validation batches and a remainder).
TINY = ["--device", "cpu", "--model-width", "4", "--set", "eval_batch_size=64"]
ACCEL_TINY = ["--model-width", "4", "--set", "eval_batch_size=16"]

# The course's epoch line as both trainers print it (cifar_wrn/runlog.py's epoch_line); group 1: the epoch.
EPOCH_LINE = re.compile(
    r"^Epoch = +(\d+): Cumulative Time = [\d.]+, Epoch Time = [\d.]+, Images/sec = [\d.]+, "
    r"Training Accuracy = [\d.]+, Validation Loss = [\d.]+, Validation Accuracy = [\d.]+$",
    re.M,
)


def data_flags(data_dir, train=TRAIN_IMAGES, val=VAL_IMAGES) -> list:
    """The flags that point a trainer at `data_dir` (synthetic: write_cifar), `train` and `val` images of it."""
    return ["--data-dir", data_dir, "--train-subset", train, "--val-subset", val]


def raw_flags(data_dir, *extra) -> list:
    """raw_ddp.py's tiny model on all of `data_dir`, --dist-timeout 60 (a rank left waiting fails the run in a
    minute), then `extra`; without --num-gpus."""
    return [*TINY, *data_flags(data_dir), "--dist-timeout", 60, *extra]


def torchrun_command(*args, nproc: int = 2) -> list:
    """torchrun (python -m torch.distributed.run) of `nproc` processes on this machine, its rendezvous on a free
    port; `args`: the script and its flags (or --no-python and a program)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        nproc,
        "--master_port",
        free_port(),
        *args,
    ]


def two_node_flags(node_id, port) -> list:
    """raw_ddp.py's flags for node `node_id` of two "nodes" of one process each on this machine, meeting at `port`."""
    return [
        "--num-nodes",
        2,
        "--node-id",
        node_id,
        "--num-gpus",
        1,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]


def profile_flags(out: Path) -> list:
    """2 epochs with --profile, the traces in out/trace and the log in out/log.jsonl: what check_profile reads."""
    return ["--epochs", 2, "--profile", "--trace", out / "trace", "--log-json", out / "log.jsonl"]


# The fast recipe at batch size 32 for 2 epochs, without the safety net: fast.yaml's extra_epochs would add a third
# epoch whenever epoch 1 misses 0.85 and epoch 2 meets it (tests/test_safety_net.py tests the net).
FAST_2_EPOCHS = ["--recipe", "fast", "--batch-size", 32, "--epochs", 2, "--set", "extra_epochs=0"]

# The fast recipe's options that both trainers' end-to-end tests add (tests/test_fast.py, tests/test_accel.py):
# EMA, DDP bucket view and static graph, bf16 gradient compression, flip TTA, augmentation (random crop and flip),
# a doubled rate for BatchNorm parameters, BatchNorm recalibration on 100 training images.
EVERY_OPTION = [
    "ema_decay=0.9",
    "ddp_bucket_view=true",
    "ddp_static_graph=true",
    "grad_compression=bf16",
    "tta_flip=true",
    "augment=true",
    "bn_lr_scale=2",
    "bn_recalibration=100",
]


def wait_for_epoch(log_path, timeout=120, text='"kind": "epoch"'):
    """Block until a run's JSON log holds its first epoch record (then signal it mid-run); with `text`, until
    the log holds that text (the first record that says so)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log_path.exists() and text in log_path.read_text():
            return
        time.sleep(0.05)
    pytest.fail(f"the run never wrote {text} to its log within {timeout} s")


# One plain-SGD step (baseline: no momentum, no weight decay) of 2 x 16 images at a fixed learning rate.
ONE_STEP = [
    "--recipe",
    "baseline",
    "--batch-size",
    16,
    "--epochs",
    1,
    "--train-subset",
    32,
    "--val-subset",
    VAL_IMAGES,
    "--set",
    "lr_scaling=none",
    "--set",
    "momentum=0",  # plain SGD: the tests measure one step's own size (the baseline's momentum is 0.9)
]


def resume_flags(data_dir, *extra):
    """raw_ddp.py's flags for the shared runs, without --num-gpus (2 in the runs: two_nodes passes its own).
    --batch-size 4: 40 steps per epoch, so that a signal can stop a run in the middle of an epoch."""
    return raw_flags(data_dir, "--batch-size", 4, *extra)
