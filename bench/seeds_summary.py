"""Seeds as one measurement: several runs of one recipe that differ only in `seed`, summarised per epoch.

    python bench/seeds_summary.py runs/seeds/*.jsonl          # or a folder of JSON logs
    python bench/seeds_summary.py docs/runs/h200-sweep-2026-12-01/00_-.jsonl \
        docs/runs/h200-sweep-2026-12-01/18_seed-1.jsonl

Reads the trainers' JSON logs (a resumed run's log, with one header per start, is one run: cifar_wrn.runlog.read_log
keeps the later record of a repeated epoch) and prints two markdown tables:
  - per epoch: how many runs have it, the mean, minimum, maximum and standard deviation (n - 1) of the validation
    accuracy, and how many runs had met the criterion (target_accuracy `patience` epochs in a row, from each log's
    recipe) by that epoch -- a run that met it earlier stops, so later epochs have fewer runs;
  - per run: its seed, accuracy per epoch, the epoch it met the criterion at (marked when the safety net's extra
    epochs were needed) and its Cumulative Time there.
A note names any recipe key other than `seed` that differs between the runs (then they are not seeds of one
recipe); a log that cannot be read is named and left out. --group summarises each recipe apart (a lever sweep
at several seeds each). Bad arguments: one `error:` line, exit 2.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from cifar_wrn.report.scaling import stopping_epoch  # (the trainers' stopping rule)
from cifar_wrn.runlog import read_log

IGNORED_KEYS = {"seed"}  # what may differ between seeds of one recipe


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


def criterion_epoch(run) -> int | None:
    """The 1-based epoch at which the run met its recipe's criterion, or None."""
    r = run["recipe"]
    i = stopping_epoch([e["val_accuracy"] for e in run["epochs"]], r["target_accuracy"], r["patience"])
    return None if i is None else run["epochs"][i]["epoch"]


def per_epoch(runs) -> list[dict]:
    """One row per epoch number any run reached: n, mean, min, max, std of val_accuracy, met-by count."""
    met = [criterion_epoch(r) for r in runs]
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
        hit = criterion_epoch(run)
        budget = run["recipe"].get("epochs")
        at = "not met" if hit is None else f"epoch {hit}" + (" (safety net)" if budget and hit > budget else "")
        seconds = (
            "–" if hit is None else f"{next(e for e in run['epochs'] if e['epoch'] == hit)['cumulative_time']:.2f}"
        )
        accuracies = " / ".join(f"{e['val_accuracy']:.4f}" for e in run["epochs"])
        lines.append(f"| {run['name']} | {run['recipe'].get('seed')} | {accuracies} | {at} | {seconds} |")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="JSON logs of the runs, or folders holding them (*.jsonl)")
    p.add_argument(
        "--group",
        action="store_true",
        help="one summary per recipe (runs that differ only in seed), the largest group first",
    )
    args = p.parse_args(argv)
    try:
        paths = log_paths(args.logs)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs, notes = load_runs(paths)
    if not args.group or not runs:
        print(render(runs, notes))
        return 0
    for note in notes:
        print(f"note: {note}")
    for name, group in by_recipe(runs):
        print(f"\n### {name}\n{render(group, [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
