"""Epoch 1 against epoch 2 with and without the start-up warm-up (recipe key startup_steps), alternating.

    python bench/startup.py --data-dir data [--num-gpus 2] [--device cpu] [--train-subset 2048] [--rounds 2] \
        [--model-width 160]
    python bench/startup.py --data-dir data --num-gpus 1 --device cuda --train-subset 50000 --set batch_size=256

One-time start-up (kernel loading, cuDNN's autotuning, torch.compile, the allocator's growth, DDP's bucket
rebuild) falls into epoch 1's Epoch Time. fast.yaml's startup_steps moves it before the clock. This runs
raw_ddp.py with the fast recipe for 2 epochs with startup_steps 0 and 3, alternating, `--rounds` times each,
and prints per run epoch 1's and epoch 2's Epoch Time, their difference (what epoch 1 carries beyond an
ordinary epoch) and the warm-up's own seconds from the log header. Epoch 2 is the same work in both variants,
so (epoch 1 - epoch 2) with the warm-up against without it is the start-up taken off the clock.
"""

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import REPO, raw_ddp_command  # bench/common.py

from cifar_wrn.runlog import read_log


def one_run(args, steps: int, log: Path) -> dict:
    cmd = raw_ddp_command(
        args.num_gpus,
        "--device",
        args.device,
        "--data-dir",
        args.data_dir,
        "--train-subset",
        str(args.train_subset),
        "--val-subset",
        str(args.val_subset),
        "--model-width",
        str(args.model_width),
        "--recipe",
        "fast",
        "--epochs",
        "2",
        "--set",
        "extra_epochs=0",
        "--set",
        f"startup_steps={steps}",
        "--target-accuracy",
        "1.0",  # both epochs always run
        "--progress",
        "off",
        "--log-json",
        str(log),
        *[flag for setting in args.set for flag in ("--set", setting)],
    )
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    header, epochs = read_log(log)
    return {
        "startup_steps": steps,
        "startup_seconds": header.get("startup_seconds", 0.0),
        "epoch_1": epochs[0]["epoch_time"],
        "epoch_2": epochs[1]["epoch_time"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--train-subset", type=int, default=2048)
    p.add_argument("--val-subset", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-width", type=int, default=160, help="160: the course model; smaller for a quick look")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.rounds):
            for steps in (0, 3):
                rows.append(one_run(args, steps, Path(folder) / f"{i}-{steps}.jsonl"))
    print(
        f"# start-up warm-up: {args.num_gpus} x {args.device}, fast recipe, width {args.model_width}, "
        f"{args.train_subset} training images"
    )
    print("| startup_steps | warm-up (s) | epoch 1 (s) | epoch 2 (s) | epoch 1 - epoch 2 (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [r["startup_seconds"], r["epoch_1"], r["epoch_2"], r["epoch_1"] - r["epoch_2"]]
        print(f"| {r['startup_steps']} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    for steps in (0, 3):
        extra = [r["epoch_1"] - r["epoch_2"] for r in rows if r["startup_steps"] == steps]
        print(f"median epoch 1 - epoch 2 with startup_steps {steps}: {statistics.median(extra):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
