"""Per-step training time of accel_train.py against raw_ddp.py: same recipe, same processes, one run.

    python bench/accel_vs_raw.py --data-dir data --device cpu --processes 2 --train-subset 384 --epochs 4
    python bench/accel_vs_raw.py --data-dir data --device cuda --processes 2 --train-subset 12800 --precision bf16

Both entry points run as subprocesses, as users start them: raw_ddp.py with mp.spawn (--num-gpus N),
accel_train.py with `accelerate launch` (a MULTI_GPU config with --num_processes N; on the CPU with
accel_train.py --cpu). The recipe (baseline unless --recipe) is the same for both; --precision goes
to both as --set precision=..., and the launch passes --mixed_precision no so that the config file
cannot override it. Each run trains --epochs epochs of the real model (width 160 unless --model-width);
its JSON log gives epoch_time and steps_per_epoch, so per-step time = epoch_time / steps_per_epoch
(training only: validation, start-up and process creation are outside the clock). Epoch 1 of each run
is a warm-up (allocator, thread pools, cuDNN) and is dropped; every later epoch is one sample. The two
trainers alternate (raw, accel, accel, raw, ...) for --repeats rounds, so that a change of the machine's
load falls on both. Printed: every run's samples, then for each trainer the best (minimum) and the median
per-step time, and the ratios accel / raw of both. Other work on the machine only ever adds time, so on a
shared machine the best-of ratio is the one to quote; on an idle one the two agree.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, raw_ddp_command  # bench/common.py

from cifar_wrn.launchers import free_port
from cifar_wrn.runlog import read_log


def command(trainer: str, args, log: Path) -> list[str]:
    common = [
        "--data-dir",
        args.data_dir,
        "--recipe",
        args.recipe,
        "--set",
        f"precision={args.precision}",
        "--epochs",
        str(args.epochs),
        "--train-subset",
        str(args.train_subset),
        "--val-subset",
        str(args.val_subset),
        "--model-width",
        str(args.model_width),
        "--target-accuracy",
        "1.0",
        "--log-json",
        str(log),
    ]
    if trainer == "raw":
        return raw_ddp_command(args.processes, "--device", args.device, *common)
    config = "two_cpus.yaml" if args.device == "cpu" else "two_gpus.yaml"
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"accelerate_configs/{config}",
        "--num_processes",
        str(args.processes),
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(free_port()),
        "accel_train.py",
        *(["--cpu"] if args.device == "cpu" else []),
        *common,
    ]


def run(trainer: str, args, workdir: Path, index: int) -> dict:
    log = workdir / f"{trainer}{index}.jsonl"
    cmd = command(trainer, args, log)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"error: {trainer} run failed (status {proc.returncode}):\n{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    header, epochs = read_log(log)
    timed = epochs[1:]  # epoch 1 is the warm-up
    return {
        "trainer": trainer,
        "steps_s": [e["epoch_time"] / header["steps_per_epoch"] for e in timed],
        "images_per_sec": [e["images_per_sec"] for e in timed],
        "steps": header["steps_per_epoch"],
        "world_size": header["world_size"],
        "wall_s": wall,
        "precision": header["recipe"]["precision"],
        "commit": header["git_commit"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default="data")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--processes", type=int, default=2, help="processes per trainer (default 2)")
    p.add_argument("--recipe", default="baseline")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="bf16",
        help="given to both trainers (default bf16: the benchmark setup)",
    )
    p.add_argument("--epochs", type=int, default=4, help="per run, the first is the warm-up (default 4)")
    p.add_argument("--train-subset", type=int, default=384, help="training images per epoch (default 384)")
    p.add_argument("--val-subset", type=int, default=64, help="validation images (outside the clock; default 64)")
    p.add_argument("--model-width", type=int, default=160, help="default 160, the course model")
    p.add_argument("--repeats", type=int, default=2, help="rounds of (raw, accel) pairs (default 2)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (epoch 1 is dropped as warm-up)")

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = ("raw", "accel") if r % 2 == 0 else ("accel", "raw")
            for trainer in order:
                res = run(trainer, args, Path(tmp), r)
                results.append(res)
                print(
                    f"round {r + 1} {trainer:5s}: ms/step per timed epoch "
                    f"{', '.join(f'{t * 1000:.0f}' for t in res['steps_s'])}; images/s "
                    f"{', '.join(f'{v:.1f}' for v in res['images_per_sec'])} ({res['steps']} steps/epoch, "
                    f"world size {res['world_size']}, {res['precision']}, wall {res['wall_s']:.0f} s)",
                    flush=True,
                )
    samples = {t: [x for r in results if r["trainer"] == t for x in r["steps_s"]] for t in ("raw", "accel")}
    best = {t: min(v) for t, v in samples.items()}
    median = {t: statistics.median(v) for t, v in samples.items()}
    print(
        f"\nper-step time, best of {len(samples['raw'])} epochs: raw_ddp.py {best['raw'] * 1000:.1f} ms, "
        f"accel_train.py {best['accel'] * 1000:.1f} ms: ratio accel / raw = {best['accel'] / best['raw']:.3f}"
    )
    print(
        f"per-step time, median:        raw_ddp.py {median['raw'] * 1000:.1f} ms, "
        f"accel_train.py {median['accel'] * 1000:.1f} ms: ratio accel / raw = {median['accel'] / median['raw']:.3f}"
    )
    print(f"commit {results[0]['commit']}; command: python bench/accel_vs_raw.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
