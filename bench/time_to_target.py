"""Time to target: a recipe run to the stopping criterion, once or over seeds, and the summary of such runs.

    python bench/time_to_target.py --data-dir data --num-gpus 1 --recipe fast                   # one run, one row
    python bench/time_to_target.py --data-dir data --num-gpus 2 --recipe fast --baseline-epochs 2
    python bench/time_to_target.py --seeds 3 --recipe fast --out runs/seeds --device cpu --data-dir data
    python bench/time_to_target.py --seeds 9 --first 1 --set ema_decay=0.98 --emit   # lines for a GPU sweep
    python bench/time_to_target.py --summary runs/seeds [--group]                    # JSON logs, or folders of them

One run (the default): raw_ddp.py (a subprocess, as a user starts it) to the criterion (target_accuracy `patience`
epochs in a row), then one markdown row: recipe, processes, epochs run, the epoch the criterion was met at,
Cumulative Time there, mean epoch time, mean images/sec, final validation accuracy, wall clock of the whole
command (start-up and validation included). --baseline-epochs N adds N epochs of the baseline recipe (its
per-epoch time); --keep-log PATH keeps the JSON log (the baseline's as PATH.baseline.jsonl). A GPU gives the
numbers; a CPU run of the real model takes hours.

--seeds N: seeds --first .. --first + N - 1, one raw_ddp.py run after another (--num-gpus processes, default 2),
each resumable (OUT/ckpt-seed-K, --auto-resume; rerun the same command), logs OUT/seed-K.jsonl, then their
summary. --emit only prints one line per seed, `[KEY=VALUE ...] seed=K`, for `bash bench/gpu_session.sh --sweep`.

--summary: per epoch, the runs that reached it and the mean / min / max / std (n - 1) of validation accuracy,
and how many runs had met the criterion by then; per run, its accuracies and the epoch (and Cumulative Time)
of the criterion, "(safety net)" where the extra epochs were needed. A resumed log is one run (the later copy
of an epoch counts). A note names a recipe key other than `seed` that differs between the runs, and a log that
cannot be read. --group: one summary per recipe, the largest group (the reference) first.
Flags this script does not know go to raw_ddp.py. Bad arguments: one `error:` line, exit 2.
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, raw_ddp_command  # bench/common.py

from cifar_wrn.report.scaling import stopping_epoch  # (the trainers' stopping rule)
from cifar_wrn.runlog import read_log

IGNORED_KEYS = {"seed"}  # what may differ between seeds of one recipe


def criterion_record(epochs: list[dict], recipe: dict) -> dict | None:
    """The epoch record at which the run met its recipe's criterion, or None."""
    i = stopping_epoch([e["val_accuracy"] for e in epochs], recipe["target_accuracy"], recipe["patience"])
    return None if i is None else epochs[i]


def met_at(epochs: list[dict], recipe: dict) -> str:
    hit = criterion_record(epochs, recipe)
    if hit is None:
        return "not met"
    budget = recipe.get("epochs")  # met in an epoch the safety net added (extra_epochs)
    return f"epoch {hit['epoch']}" + (" (safety net)" if budget and hit["epoch"] > budget else "")


# ---------------------------------------------------------------------------------------------- one run


def one_run(recipe: str, args, extra, keep_log=None) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(keep_log) if keep_log else Path(tmp) / "log.jsonl"
        # raw_ddp.py by its path, in this shell's folder: relative paths among the flags mean what they say
        cmd = raw_ddp_command(args.num_gpus or 1, "--data-dir", args.data_dir, "--recipe", recipe, *extra)
        cmd[1] = str(REPO / "raw_ddp.py")
        cmd += ["--log-json", str(log)]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        header, epochs = read_log(log)
    r = header["recipe"]
    hit = criterion_record(epochs, r)
    rate = sum(e["images_per_sec"] for e in epochs) / len(epochs)
    cumulative = f"{hit['cumulative_time']:.2f}" if hit else f"({epochs[-1]['cumulative_time']:.2f} for all)"
    per_epoch = sum(e["epoch_time"] for e in epochs) / len(epochs)
    return (
        f"| {recipe} | {header['world_size']} | {len(epochs)} | {met_at(epochs, r)} | {cumulative} | "
        f"{per_epoch:.2f} | {rate:.0f} | {epochs[-1]['val_accuracy']:.4f} | {wall:.1f} | {header['git_commit'][:12]} |"
    )


# ---------------------------------------------------------------------------------------------- seeds


def lever_lines(n: int, first: int, sets: list[str]) -> list[str]:
    """One sweep line per seed: the fixed overrides, then seed=K."""
    return [" ".join([*sets, f"seed={seed}"]) for seed in range(first, first + n)]


def seed_commands(args, extra, out: Path) -> list[list[str]]:
    """raw_ddp.py command lines, one per seed, each with its own checkpoint folder so that it can be resumed."""
    commands = []
    for seed in range(args.first, args.first + args.seeds):
        overrides = [a for kv in [*args.set, f"seed={seed}"] for a in ("--set", kv)]
        commands.append(
            raw_ddp_command(
                args.num_gpus or 2,
                "--data-dir",
                str(Path(args.data_dir).resolve()),  # the runs start in the repository root
                *extra,
                "--recipe",
                args.recipe,
                "--checkpoint-dir",
                f"{out}/ckpt-seed-{seed}",
                "--auto-resume",
                *overrides,
                "--log-json",
                f"{out}/seed-{seed}.jsonl",
            )
        )
    return commands


# ---------------------------------------------------------------------------------------------- summary


def load_runs(paths) -> tuple[list[dict], list[str]]:
    """(runs, notes): each run {name, recipe, epochs} from a readable log with at least one epoch."""
    runs, notes = [], []
    for path in paths:
        try:
            header, epochs = read_log(path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError) as exc:
            notes.append(f"{path}: left out, not a readable JSON log ({type(exc).__name__}: {exc})")
            continue
        if "recipe" not in header or not epochs:
            notes.append(
                f"{path}: left out, {'no header with a recipe' if 'recipe' not in header else 'no epoch finished'}"
            )
            continue
        runs.append({"name": Path(path).stem, "recipe": header["recipe"], "epochs": epochs})
    return runs, notes


def differing_keys(runs) -> list[str]:
    keys = set().union(*(r["recipe"] for r in runs)) - IGNORED_KEYS
    return sorted(k for k in keys if len({json.dumps(r["recipe"].get(k)) for r in runs}) > 1)


def per_epoch(runs) -> list[dict]:
    """One row per epoch number any run reached: n, mean, min, max, std of val_accuracy, met-by count."""
    met = [(hit := criterion_record(r["epochs"], r["recipe"])) and hit["epoch"] for r in runs]
    rows = []
    for epoch in sorted({e["epoch"] for r in runs for e in r["epochs"]}):
        values = [e["val_accuracy"] for r in runs for e in r["epochs"] if e["epoch"] == epoch]
        rows.append(
            {
                "epoch": epoch,
                "n": len(values),
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "std": statistics.stdev(values) if len(values) > 1 else math.nan,
                "met": sum(m is not None and m <= epoch for m in met),
                "runs": len(runs),
            }
        )
    return rows


def render(runs, notes) -> str:
    lines = [f"note: {n}" for n in notes]
    if not runs:
        return "\n".join(lines + ["no run to summarise"])
    differ = differing_keys(runs)
    if differ:
        lines.append(f"note: the runs differ in {', '.join(differ)}, not only in seed: not seeds of one recipe")
    lines += [
        "",
        f"{len(runs)} runs; criterion: validation accuracy >= target_accuracy, patience epochs in a row "
        "(each log's recipe)",
        "",
        "| epoch | runs with it | mean | min | max | std | met the criterion by this epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in per_epoch(runs):
        std = "–" if math.isnan(row["std"]) else f"{row['std']:.4f}"
        lines.append(
            f"| {row['epoch']} | {row['n']} | {row['mean']:.4f} | {row['min']:.4f} | {row['max']:.4f} | "
            f"{std} | {row['met']}/{row['runs']} |"
        )
    lines += [
        "",
        "| run | seed | validation accuracy per epoch | criterion met at | Cumulative Time there (s) |",
        "|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (r["recipe"].get("seed", 0), r["name"])):
        hit = criterion_record(run["epochs"], run["recipe"])
        seconds = "–" if hit is None else f"{hit['cumulative_time']:.2f}"
        accuracies = " / ".join(f"{e['val_accuracy']:.4f}" for e in run["epochs"])
        lines.append(
            f"| {run['name']} | {run['recipe'].get('seed')} | {accuracies} | "
            f"{met_at(run['epochs'], run['recipe'])} | {seconds} |"
        )
    return "\n".join(lines)


def by_recipe(runs) -> list[tuple[str, list[dict]]]:
    """--group: the runs in groups of one recipe each (seed aside), the largest group first (the reference);
    each group named by its keys that differ from the reference's."""
    groups = {}
    for run in runs:
        key = json.dumps({k: v for k, v in run["recipe"].items() if k not in IGNORED_KEYS}, sort_keys=True)
        groups.setdefault(key, []).append(run)
    ordered = sorted(groups.values(), key=len, reverse=True)
    reference = ordered[0][0]["recipe"]
    named = []
    for group in ordered:
        recipe = group[0]["recipe"]
        changes = [
            f"{k}={recipe.get(k)}"
            for k in sorted(set(recipe) | set(reference))
            if k not in IGNORED_KEYS and recipe.get(k) != reference.get(k)
        ]
        named.append((" ".join(changes) or "the reference recipe (the largest group)", group))
    return named


def log_paths(arguments) -> list[Path]:
    paths = []
    for argument in map(Path, arguments):
        if argument.is_dir():
            paths += sorted(argument.glob("*.jsonl"))
        elif argument.is_file():
            paths.append(argument)
        else:
            raise FileNotFoundError(f"{argument}: no such file or folder")
    return paths


def summary(arguments, group: bool) -> int:
    try:
        paths = log_paths(arguments)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs, notes = load_runs(paths)
    if not group or not runs:
        print(render(runs, notes))
        return 0
    for note in notes:
        print(f"note: {note}")
    for name, members in by_recipe(runs):
        print(f"\n### {name}\n{render(members, [])}")
    return 0


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--num-gpus", type=int, help="processes (raw_ddp.py --num-gpus; default 1, with --seeds 2)")
    p.add_argument("--recipe", default="fast")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (every run)")
    p.add_argument("--baseline-epochs", type=int, default=0, help="one run: also N epochs of the baseline recipe")
    p.add_argument("--keep-log", help="one run: write its JSON log here instead of a temporary file")
    p.add_argument("--seeds", type=int, help="run this many seeds one after another, then summarise them")
    p.add_argument("--first", type=int, default=0, help="--seeds: the first seed (default 0)")
    p.add_argument("--out", default="runs/seeds", help="--seeds: folder for the logs and checkpoints")
    p.add_argument("--emit", action="store_true", help="--seeds: only print the sweep lines, one per seed")
    p.add_argument("--summary", nargs="+", metavar="LOG", help="summarise these JSON logs (or folders of them)")
    p.add_argument("--group", action="store_true", help="--summary: one summary per recipe, the largest first")
    args, extra = p.parse_known_args(argv)
    if args.summary:
        return summary(args.summary, args.group)
    if any("=" not in kv for kv in args.set):
        print(f"error: --set takes KEY=VALUE (got {args.set})", file=sys.stderr)
        return 2
    if args.seeds is None:
        if args.emit:
            print("error: --emit needs --seeds N", file=sys.stderr)
            return 2
        extra = [*extra, *(a for kv in args.set for a in ("--set", kv))]
        rows = [one_run(args.recipe, args, extra, args.keep_log)]
        if args.baseline_epochs:
            baseline_log = args.keep_log and str(Path(args.keep_log).with_suffix(".baseline.jsonl"))
            rows.append(one_run("baseline", args, [*extra, "--epochs", str(args.baseline_epochs)], baseline_log))
        print(
            "\n| recipe | processes | epochs run | criterion met | Cumulative Time to criterion (s) | "
            "mean epoch time (s) | mean images/sec | final val acc | wall clock (s) | commit |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
        return 0
    if args.seeds < 1 or args.first < 0:
        print(f"error: --seeds must be >= 1 and --first >= 0 (got {args.seeds}, {args.first})", file=sys.stderr)
        return 2
    if args.emit:
        print("\n".join(lever_lines(args.seeds, args.first, args.set)))
        return 0
    out = Path(args.out).resolve()  # the runs start in the repository root
    out.mkdir(parents=True, exist_ok=True)
    for command in seed_commands(args, extra, out):
        print("$ " + " ".join(command), flush=True)
        status = subprocess.run(command, cwd=REPO).returncode
        if status != 0:
            print(
                f"error: {command[-1]}'s run ended with status {status}; rerun the same command to resume it",
                file=sys.stderr,
            )
            return status
    return summary([f"{out}/seed-{seed}.jsonl" for seed in range(args.first, args.first + args.seeds)], False)


if __name__ == "__main__":
    sys.exit(main())
