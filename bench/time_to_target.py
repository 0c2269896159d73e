"""Time to target: run a recipe to the stopping criterion and record epochs, Cumulative Time and wall clock.

    python bench/time_to_target.py --data-dir data --num-gpus 1 --recipe fast
    python bench/time_to_target.py --data-dir data --num-gpus 2 --recipe fast --baseline-epochs 2

Runs raw_ddp.py (a subprocess, as a user would), reads its JSON log, and prints one markdown row per
run: recipe, processes, epochs run, whether the criterion (target accuracy `patience` epochs in a row)
was met and at which epoch, Cumulative Time at that epoch, mean images/sec, final validation
accuracy, and wall-clock time of the whole command (start-up and validation included).
With --baseline-epochs N it also runs N epochs of the baseline recipe, for its per-epoch time;
--keep-log PATH keeps the JSON log (the baseline's beside it, as PATH.baseline.jsonl).
Needs a GPU for meaningful numbers (a CPU run of the real model takes hours).
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from cifar_wrn.runlog import criterion_met, read_log


def criterion_epoch(epochs, target, patience):
    """The first epoch record at which the course's rule holds (cifar_wrn.runlog.criterion_met), or None."""
    accuracies = [e["val_accuracy"] for e in epochs]
    return next((e for i, e in enumerate(epochs) if criterion_met(accuracies[: i + 1], target, patience)), None)


def run(recipe: str, args, extra, keep_log=None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(keep_log) if keep_log else Path(tmp) / "log.jsonl"
        cmd = [
            sys.executable,
            str(REPO / "raw_ddp.py"),
            "--num-nodes",
            "1",
            "--node-id",
            "0",
            "--num-gpus",
            str(args.num_gpus),
            "--data-dir",
            args.data_dir,
            "--recipe",
            recipe,
            "--log-json",
            str(log),
            *extra,
        ]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        header, epochs = read_log(log)
    r = header["recipe"]
    hit = criterion_epoch(epochs, r["target_accuracy"], r["patience"])
    rate = sum(e["images_per_sec"] for e in epochs) / len(epochs)
    reached = f"epoch {hit['epoch']}" if hit else "not reached"
    if hit and hit["epoch"] > r["epochs"]:  # met in an epoch the safety net added (extra_epochs)
        reached += " (safety net)"
    cumulative = f"{hit['cumulative_time']:.2f}" if hit else f"({epochs[-1]['cumulative_time']:.2f} for all)"
    per_epoch = sum(e["epoch_time"] for e in epochs) / len(epochs)
    return (
        f"| {recipe} | {header['world_size']} | {len(epochs)} | {reached} | {cumulative} | {per_epoch:.2f} | "
        f"{rate:.0f} | {epochs[-1]['val_accuracy']:.4f} | {wall:.1f} | {header['git_commit'][:12]} |"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--recipe", default="fast")
    p.add_argument("--baseline-epochs", type=int, default=0)
    p.add_argument("--keep-log", help="write the run's JSON log here instead of a temporary file")
    args, extra = p.parse_known_args()
    rows = [run(args.recipe, args, extra, args.keep_log)]
    if args.baseline_epochs:
        baseline_log = args.keep_log and str(Path(args.keep_log).with_suffix(".baseline.jsonl"))
        rows.append(run("baseline", args, [*extra, "--epochs", str(args.baseline_epochs)], baseline_log))
    print(
        "\n| recipe | processes | epochs run | criterion met | Cumulative Time to criterion (s) | "
        "mean epoch time (s) | mean images/sec | final val acc | wall clock (s) | commit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
