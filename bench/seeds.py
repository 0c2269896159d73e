"""Run N seeds of one recipe, then summarise them per epoch (bench/seeds_summary.py).

    # GPU: the seeds go through bench/gpu_sweep.sh (four at a time on one GPU, fast.yaml at batch_size=256),
    # as lever lines `[KEY=VALUE ...] seed=K`; OUT, DATA, DEADLINE, PARALLEL are gpu_sweep.sh's
    python bench/seeds.py --seeds 10 --gpu "$(git rev-parse --short HEAD)"
    python bench/seeds.py --seeds 3 --first 0 --set ema_decay=0.98 --emit >> levers.txt   # only print the lines

    # CPU: one run after another with raw_ddp.py (each resumable: --checkpoint-dir, --auto-resume); flags this
    # script does not know go to raw_ddp.py
    python bench/seeds.py --seeds 3 --recipe fast --out runs/seeds --num-gpus 2 --device cpu --data-dir data

Seeds first .. first + N - 1. The JSON logs are OUT/seed-K.jsonl (CPU) or gpu_sweep.sh's tarball (GPU).
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import seeds_summary
from common import REPO, raw_ddp_command  # bench/common.py


def lever_lines(n: int, first: int, sets: list[str]) -> list[str]:
    """One bench/gpu_sweep.sh line per seed: the fixed overrides, then seed=K."""
    return [" ".join([*sets, f"seed={seed}"]) for seed in range(first, first + n)]


def cpu_commands(recipe: str, n: int, first: int, sets: list[str], out, extra: list, num_gpus=2) -> list[list[str]]:
    """raw_ddp.py command lines, one per seed, each with its own checkpoint folder so that it can be resumed."""
    commands = []
    for seed in range(first, first + n):
        overrides = [a for kv in [*sets, f"seed={seed}"] for a in ("--set", kv)]
        commands.append(
            raw_ddp_command(
                num_gpus,
                *extra,
                "--recipe",
                recipe,
                "--checkpoint-dir",
                f"{out}/ckpt-seed-{seed}",
                "--auto-resume",
                *overrides,
                "--log-json",
                f"{out}/seed-{seed}.jsonl",
            )
        )
    return commands


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, required=True, help="how many seeds")
    p.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--recipe", default="fast", help="CPU runs only: the recipe (gpu_sweep.sh runs fast.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the same override for every seed")
    p.add_argument("--out", default="runs/seeds", help="CPU runs: folder for the logs and checkpoints")
    p.add_argument("--num-gpus", type=int, help="CPU runs: processes (raw_ddp.py --num-gpus; default 2)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--emit", action="store_true", help="only print the gpu_sweep.sh lever lines")
    mode.add_argument("--gpu", metavar="COMMIT", help="run the seeds through bench/gpu_sweep.sh (recorded commit)")
    args, extra = p.parse_known_args(argv)
    if args.seeds < 1 or args.first < 0:
        print(f"error: --seeds must be >= 1 and --first >= 0 (got {args.seeds}, {args.first})", file=sys.stderr)
        return 2
    if any("=" not in kv for kv in args.set):
        print(f"error: --set takes KEY=VALUE (got {args.set})", file=sys.stderr)
        return 2
    lines = lever_lines(args.seeds, args.first, args.set)
    if args.emit:
        print("\n".join(lines))
        return 0
    if args.gpu:
        if args.recipe != "fast" or extra or args.num_gpus:
            print(
                "error: --gpu runs fast.yaml through bench/gpu_sweep.sh: no --recipe, no trainer flags", file=sys.stderr
            )
            return 2
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as levers:
            levers.write("\n".join(lines) + "\n")
        try:
            return subprocess.run(
                ["bash", str(REPO / "bench" / "gpu_sweep.sh"), args.gpu, levers.name], cwd=REPO
            ).returncode
        finally:
            os.unlink(levers.name)
    out = Path(args.out).resolve()  # the runs start in the repository root
    out.mkdir(parents=True, exist_ok=True)
    for command in cpu_commands(args.recipe, args.seeds, args.first, args.set, out, extra, args.num_gpus or 2):
        print("$ " + " ".join(command), flush=True)
        status = subprocess.run(command, cwd=REPO).returncode
        if status != 0:
            print(
                f"error: {command[-1]}'s run ended with status {status}; rerun the same command to resume it",
                file=sys.stderr,
            )
            return status
    return seeds_summary.main([f"{out}/seed-{seed}.jsonl" for seed in range(args.first, args.first + args.seeds)])


if __name__ == "__main__":
    sys.exit(main())
