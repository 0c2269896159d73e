"""What one tiny 2-process test run of raw_ddp.py costs, and what tests/lean_gc/ (less garbage collection) saves.

    python bench/process_cost.py [--rounds 4]

The tests' runs train for about a second; the rest of what they cost is Python starting and stopping three
processes (the launcher and two ranks, each importing torch and, through DistributedDataParallel, torch._dynamo).
This script times the same tiny run (synthetic data of the tests' size, their width-4 model, 2 epochs) with and without
tests/lean_gc on PYTHONPATH, alternating, and reports per variant the median wall time and CPU seconds (user +
system of the run's processes, from the kernel's accounting of waited-for children) and the ratio of the two
variants from the same invocation. Run it on a quiet machine; it takes about a minute per round.
"""

import argparse
import os
import pickle
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, raw_ddp_command  # bench/common.py

LEAN_GC = REPO / "tests" / "lean_gc"
# The tests' tiny run (tests/helpers.py: TINY, write_cifar's sizes); random images cost what theirs do.
TINY = ["--device", "cpu", "--model-width", "4", "--set", "eval_batch_size=64"]
PER_TRAIN_FILE, VAL_IMAGES = 64, 101


def write_random_cifar(root: Path) -> Path:
    """CIFAR-10's python layout under root: 5 training files of PER_TRAIN_FILE random images, VAL_IMAGES to validate."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", PER_TRAIN_FILE) for i in range(1, 6)), ("test_batch", VAL_IMAGES)]:
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return root


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(data_dir: Path, lean_gc: bool) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MASTER_PORT", "MASTER_ADDR")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore::UserWarning")
    if lean_gc:
        env["PYTHONPATH"] = str(LEAN_GC)
    cmd = raw_ddp_command(
        2,
        *map(str, TINY),
        "--data-dir",
        str(data_dir),
        "--train-subset",
        str(5 * PER_TRAIN_FILE),
        "--val-subset",
        str(VAL_IMAGES),
        "--epochs",
        "2",
    )
    cpu0, t0 = children_cpu(), time.monotonic()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    return time.monotonic() - t0, children_cpu() - cpu0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="runs per variant, alternating (default 4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = write_random_cifar(Path(tmp))
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for lean_gc in (False, True):
                times[lean_gc].append(one_run(data_dir, lean_gc))
    medians = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    for lean_gc, label in ((False, "plain Python"), (True, "tests/lean_gc")):
        wall, cpu = medians[lean_gc]
        print(f"{label:16s} median of {args.rounds}: {wall:5.1f} s wall, {cpu:5.1f} CPU-s")
    print(
        f"ratio lean_gc / plain: wall {medians[True][0] / medians[False][0]:.2f}, "
        f"CPU {medians[True][1] / medians[False][1]:.2f}"
    )


if __name__ == "__main__":
    main()
