"""Shared test helpers: small synthetic CIFAR-10 in the official layout, and process runs that cannot hang."""
import os
import pickle
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
PER_TRAIN_FILE = 64            # 5 files -> 320 training images
VAL_IMAGES = 101               # odd on purpose: DistributedSampler must pad it for 2 ranks
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


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """A data dir with 320 training and 101 validation images; use --train-subset/--val-subset."""
    return write_cifar(tmp_path_factory.mktemp("cifar"))


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


def cpu_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore::UserWarning")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(cmd, env=None, cwd=REPO) -> subprocess.Popen:
    """A new session, so that a timeout can kill the launcher and every rank it spawned."""
    return subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or cpu_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    import time
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s (process group killed)\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - t0)


def run(cmd, timeout: float = 180, env=None) -> Result:
    return finish(start(cmd, env), timeout)


def raw_ddp(*flags, timeout: float = 180, env=None) -> Result:
    return run([sys.executable, "raw_ddp.py", *flags], timeout=timeout, env=env)


TINY = ["--device", "cpu", "--model-width", "4", "--set", "eval_batch_size=64"]
