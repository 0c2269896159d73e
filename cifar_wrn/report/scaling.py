"""The scaling arithmetic: time to the stopping criterion, speedup, parallel efficiency, the Karp-Flatt serial
fraction and Amdahl's predictions, computed only between comparable runs (same recipe, stopping rule in force at
the target, data, model and device type, differing in world size)."""

import json
import math
from dataclasses import dataclass

from .content import code, md_text
from .logs import Run, full_recipe, is_number

AMDAHL_GPUS = (2, 4, 8)  # the GPU counts Amdahl's law is asked about
# Fewer steps an epoch and the first and last (the loader's start, the first all-reduce, the short batch) are over
# a tenth of it: its times say little of the steady training a speedup is about.
MIN_STEPS = 20
# Header entries that must agree for a speedup to compare like with like (log_format: a text log's, textlog.py).
COMPARABLE = ("recipe", "train_images", "val_images", "model_width", "model_parameters", "device", "log_format")
# The recipe keys of the stopping rule: compared as in force at the target (run_rule), not as the first header's.
STOP_RULE = ("target_accuracy", "patience")


def stopping_epoch(accuracies, target, patience) -> int | None:
    """Index (0-based) of the first epoch at which the trainers stop early (stopping.criterion_met, the course's
    rule), or None. `target` and `patience`: one value, or one per epoch (the values in force when it was
    logged: a resume may change them, Run.rules)."""
    from ..stopping import criterion_met

    targets = target if isinstance(target, list) else [target] * len(accuracies)
    patiences = patience if isinstance(patience, list) else [patience] * len(accuracies)
    for i in range(len(accuracies)):
        if criterion_met(accuracies[: i + 1], targets[i], patiences[i]):
            return i
    return None


def run_stop(run: Run) -> int | None:
    """The epoch index at which `run` stopped under the rules in force, or None. A resume checks its rule over the
    logged epochs before it trains: where that held, the run stopped at the last epoch logged before it."""
    from ..stopping import criterion_met

    stop = stopping_epoch(run.accuracies, *run.rules)
    if stop is None and run.epochs and criterion_met(run.accuracies, run.target, run.patience):
        return len(run.epochs) - 1
    return stop


def run_rule(run: Run) -> dict:
    """The stopping rule ({target_accuracy, patience}) in force when `run` met it, the one its time to target
    measures; for a run that never met it, the rule it ended with. A resume may change the rule (Run.rules)."""
    stop = run_stop(run)
    if stop is None or stop != stopping_epoch(run.accuracies, *run.rules):  # never met, or met at a resume
        return {key: run.recipe[key] for key in STOP_RULE}
    targets, patiences = run.rules
    return {"target_accuracy": targets[stop], "patience": patiences[stop]}


def time_to_target(epochs: list[dict], target, patience) -> float | None:
    """Cumulative Time (seconds of training, validation excluded) at the stopping epoch, or None."""
    i = stopping_epoch([e["val_accuracy"] for e in epochs], target, patience)
    return None if i is None else float(epochs[i]["cumulative_time"])


def run_time_to_target(run: Run) -> float | None:
    stop = run_stop(run)
    return None if stop is None else float(run.epochs[stop]["cumulative_time"])


def mean_images_per_sec(epochs: list[dict]) -> float | None:
    """Arithmetic mean of the per-epoch images/sec over every logged epoch (epoch 1 included)."""
    return sum(e["images_per_sec"] for e in epochs) / len(epochs) if epochs else None


def speedup_by_time(t1: float, tp: float) -> float:
    """S = T(1) / T(p): how many times faster p processes reach the same point."""
    return t1 / tp


def speedup_by_throughput(r1: float, rp: float) -> float:
    """S = R(p) / R(1) for throughputs R in images/sec."""
    return rp / r1


def parallel_efficiency(speedup: float, p: int) -> float:
    """E = S / p: 1 is perfect scaling."""
    return speedup / p


def karp_flatt(speedup: float, p: int) -> float:
    """Experimentally determined serial fraction e = (1/S - 1/p) / (1 - 1/p) (Karp and Flatt, 1990).
    0 for perfect scaling, 1 when p processes are no faster than one; undefined for p = 1."""
    if p <= 1:
        raise ValueError(f"the Karp-Flatt metric needs p > 1 processes (got {p})")
    if not speedup > 0:
        raise ValueError(f"the Karp-Flatt metric needs a positive speedup (got {speedup})")
    return (1 / speedup - 1 / p) / (1 - 1 / p)


def amdahl_speedup(serial_fraction: float, n: int) -> float:
    """Speedup on n processors of a program whose fraction e is serial: S(n) = 1 / (e + (1 - e) / n)."""
    return 1 / (serial_fraction + (1 - serial_fraction) / n)


@dataclass
class Difference:
    """A header entry (COMPARABLE), or the stopping rule in force at the target (key "stopping rule"), that
    is not the same in every run, in words."""

    key: str
    text: str

    def __str__(self) -> str:
        return self.text


def _rule_difference(runs: list[Run]) -> Difference | None:
    """The stopping rule in force at the target (run_rule), when it is not the same in every run: their times
    to target would measure different rules."""
    rules = [run_rule(r) for r in runs]
    changed = [
        f"{key} {' vs '.join(dict.fromkeys(str(rule[key]) for rule in rules))}"
        for key in STOP_RULE
        if any(rule[key] != rules[0][key] for rule in rules)
    ]
    if not changed:
        return None
    return Difference("stopping rule", f"the stopping rule in force at the target ({', '.join(changed)})")


def _header_value(run: Run, key: str):
    """A COMPARABLE entry of the first header; the recipe in full (full_recipe) less its stopping rule, which
    a resume may change (STOP_RULE: compared as in force at the target)."""
    value = run.header.get(key, "json" if key == "log_format" else None)
    if key == "recipe" and isinstance(value, dict):
        return {k: v for k, v in full_recipe(value).items() if k not in STOP_RULE}
    return value


def differences(runs: list[Run]) -> list[Difference]:
    """Header entries (COMPARABLE) that are not the same in every run, and the stopping rule in force at the
    target (run_rule) when it is not."""
    out = []
    for key in COMPARABLE:
        values = [_header_value(r, key) for r in runs]
        if all(v == values[0] for v in values):
            continue
        if key == "recipe" and all(isinstance(v, dict) for v in values):
            keys = sorted({k for v in values for k in v if len({json.dumps(x.get(k)) for x in values}) > 1})
            out.append(Difference(key, "recipe (" + ", ".join(map(md_text, keys)) + ")"))
        else:
            out.append(Difference(key, f"{key} ({' vs '.join(dict.fromkeys(map(md_text, values)))})"))
    rule = _rule_difference(runs)
    if rule:  # after the rest of the recipe
        out.insert(1 if out and out[0].key == "recipe" else 0, rule)
    return out


@dataclass
class Scaling:
    rows: list[dict]  # one per run, in the order of the table
    basis: str | None  # "time" (Cumulative Time to target), "throughput" (images/sec), None
    baseline: Run | None
    notes: list[str]


def _row(run: Run) -> dict:
    return {
        "run": run,
        "p": run.world_size,
        "time_to_target": run_time_to_target(run),
        "images_per_sec": mean_images_per_sec(run.epochs),
        "final_accuracy": run.epochs[-1]["val_accuracy"] if run.epochs else None,
    }


def _pair(rows: list[dict], singles: list[Run]) -> list[str]:
    """Give each N-process row the first comparable 1-process run as its "reference" (and each such 1-process
    run itself); a note for each N-process row with none."""
    notes = []
    for row in rows:
        if row["p"] > 1:
            row["reference"] = next((s for s in singles if not differences([s, row["run"]])), None)
            if row["reference"] is None:
                differ = "; ".join(map(str, differences([singles[0], row["run"]])))
                notes.append(
                    f"**{code(row['run'].label)} is not compared with a 1-process run**: against "
                    f"{code(singles[0].label)} it differs in {differ}"
                    f", so no speedup, efficiency, Karp-Flatt or Amdahl is computed for it. Run the same "
                    f"recipe on the same data and device with 1 process."
                )
    references = {id(row["reference"]) for row in rows if row.get("reference")}
    for row in rows:
        if id(row["run"]) in references:
            row["reference"] = row["run"]
    return notes


def _speedup_function(compared: list[dict]):
    """(basis, speedup of a row): time to target when every compared run reached it, else mean images/sec;
    (None, None) when a run has no epochs."""
    if all(row["time_to_target"] and run_time_to_target(row["reference"]) for row in compared):
        return "time", lambda row: speedup_by_time(run_time_to_target(row["reference"]), row["time_to_target"])
    if all(row["images_per_sec"] and row["reference"].epochs for row in compared):
        reference = lambda row: mean_images_per_sec(row["reference"].epochs)
        return "throughput", lambda row: speedup_by_throughput(reference(row), row["images_per_sec"])
    return None, None


def _karp_flatt_and_amdahl(row: dict, s: float) -> list[str]:
    """Fill a compared N-process row's serial fraction and Amdahl predictions; the flags it raises."""
    notes = []
    if s < 1:
        notes.append(
            f"**Flag: {code(row['run'].label)} is slower than {code(row['reference'].label)}** (speedup "
            f"{s:.3f} < 1): {row['p']} processes trained fewer images per second than one."
        )
    if s > 0:
        row["karp_flatt"] = e = karp_flatt(s, row["p"])
        if 0 <= e <= 1:
            row["amdahl"] = {n: amdahl_speedup(e, n) for n in AMDAHL_GPUS}
        else:
            notes.append(
                f"**Flag: {code(row['run'].label)}'s serial fraction e = {e:.4f} is outside [0, 1]** "
                + ("(a speedup above p: superlinear, or noise)" if e < 0 else "(a speedup below 1)")
                + ": it is no serial fraction Amdahl's law can use, so no Amdahl predictions."
            )
    return notes


def scaling(runs: list[Run]) -> Scaling:
    """The numbers of the scaling table. Each N-process run is compared only with a 1-process run of the same
    experiment (COMPARABLE: recipe, data, model, device type; and the stopping rule in force at the target,
    run_rule), the first such one given; a run with none gets no speedup, efficiency, Karp-Flatt or Amdahl,
    and a note naming what differs. The basis is Cumulative Time to target when every compared run reached
    it, else mean images/sec (so all rows share one basis)."""
    ordered = sorted(runs, key=lambda r: (r.world_size, r.num_nodes))  # stable: ties keep the given order
    rows = [_row(r) for r in ordered]
    singles = [r for r in ordered if r.world_size == 1]
    if not singles:
        note = (
            "There is no 1-process run (world size 1) among these logs, so no "
            "speedup, efficiency, Karp-Flatt or Amdahl columns: add one."
        )
        return Scaling(rows, None, None, [note])
    notes = _pair(rows, singles)
    if not any(row.get("reference") and row["p"] > 1 for row in rows):
        return Scaling(rows, None, singles[0], notes)
    compared = [row for row in rows if row.get("reference")]
    basis, speedup = _speedup_function(compared)
    if basis is None:
        return Scaling(rows, None, singles[0], notes + ["A run has no epoch records: no speedup columns."])
    for row in compared:
        row["speedup"] = s = speedup(row)
        row["efficiency"] = parallel_efficiency(s, row["p"])
        if row["p"] > 1:
            notes += _karp_flatt_and_amdahl(row, s)
    return Scaling(rows, basis, singles[0], notes)


def short_runs(runs: list[Run]) -> list[str]:
    """A warning for each run with fewer than MIN_STEPS steps an epoch (as its header logs them)."""
    return [
        f"**Warning: {code(r.label)} has {r.header['steps_per_epoch']} steps an epoch**, too few for its times to "
        f"mean anything (start-up and the last batch weigh on every epoch): give it at least {MIN_STEPS}."
        for r in runs
        if isinstance(r.header.get("steps_per_epoch"), int) and r.header["steps_per_epoch"] < MIN_STEPS
    ]


def profile_parts(epochs: list[dict]) -> dict[str, float]:
    """Mean seconds per epoch of each numeric entry of the epochs' "profile" dicts ({} when none)."""
    sums: dict[str, float] = {}
    profiled = [e["profile"] for e in epochs if isinstance(e.get("profile"), dict)]
    for prof in profiled:
        for key, value in prof.items():
            if is_number(value) and math.isfinite(value):
                sums[key] = sums.get(key, 0.0) + value
    return {key: total / len(profiled) for key, total in sums.items()}


def profiled(runs: list[Run]) -> tuple[list[tuple[Run, dict]], list[str]]:
    """(run, mean seconds per part) of each run with a profile, and every part's name in order of appearance."""
    parts = [(r, profile_parts(r.epochs)) for r in runs]
    parts = [(r, p) for r, p in parts if p]
    keys: list[str] = []
    for _, p in parts:
        keys += [k for k in p if k not in keys]
    return parts, keys
