"""The report's tables from the logs: the R1 steps, the scaling table and what it means, the time profile, and
per run its header facts and epoch log."""

import math
import re

from .content import Bullets, Section, Step, Table, Text, code
from .logs import Run, is_number
from .notes import slot
from .scaling import AMDAHL_GPUS, Scaling, profiled, run_rule, run_stop, short_runs
from .student_source import TITLES, shipped_source


def fmt(value, digits: int = 3, missing: str = "–") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def steps(notes: dict, source=None) -> list[Step]:
    """Section 1: each R1 step's lines in the file quoted (the shipped raw_ddp.py, or --source), and the
    student's why (a slot)."""
    source = source or shipped_source()
    return [
        Step(step, source.steps.get(step, []), slot(notes, "steps", step, f"why {step} is needed"), source.where(step))
        for step in TITLES
    ]


def steps_table(notes: dict, source=None) -> Table:
    return Table(["step", "where", "why"], [[s.id, s.where, s.why] for s in steps(notes, source)])


OPTIONAL_FACTS = (
    ("trainer", "trainer"),
    ("launcher", "launcher"),
    ("per-process batch", "per_device_batch_size"),
    ("global batch", "global_batch_size"),
    ("learning rate", "lr"),
    ("steps per epoch", "steps_per_epoch"),
    ("training images", "train_images"),
    ("validation images", "val_images"),
    ("model width", "model_width"),
    ("model parameters", "model_parameters"),
    ("torch", "torch_version"),
    ("host (rank 0)", "hostname"),
    ("hardware", "hardware"),  # a text log's: its job's topology.txt
    ("command", "command"),
    ("started", "started_at"),
)


def header_facts(run: Run) -> list[list]:
    h = run.header
    per_node = "GPUs per node" if h["device"] == "cuda" else "processes per node (CPU)"
    facts = [
        ["world size (processes)", h["world_size"]],
        ["nodes", h["num_nodes"]],
        [per_node, h["num_gpus"]],
        ["backend", h["backend"]],
        ["device", h["device"]],
        ["commit", h.get("git_commit", "not logged")],
    ]
    facts += [[name, h[key]] for name, key in OPTIONAL_FACTS if key in h]
    # logs from before the course's model (commit 6f38cac) lack it: they trained the earlier variant
    facts.append(["model", h.get("architecture") or "the project's earlier, non-course WideResNet (AdaptiveAvgPool2d)"])
    facts.append(["stopping rule", f"validation accuracy >= {run.target} for {run.patience} epoch(s) in a row"])
    if run.resumes:
        facts.append(["resumed", resume_text(run)])
    return facts


def short_commit(commit) -> str:
    """'1615f1c' for a 40-digit commit ('1615f1c-dirty' for a dirty tree); anything else as it is."""
    text = str(commit)
    return text[:7] + ("-dirty" if text.endswith("-dirty") else "") if re.match(r"[0-9a-f]{40}", text) else text


def resume_text(run: Run) -> str:
    """Where the run was resumed, '' when it never was: one log, one run, however many segments."""
    if not run.resumes:
        return ""
    each = [
        f"at {s.where()} (line {s.line}"
        + (f", started {s.header['started_at']}" if s.header.get("started_at") else "")
        + (f", commit {short_commit(s.header['git_commit'])}" if s.header.get("git_commit") else "")
        + ")"
        for s in run.resumes
    ]
    times = "once" if len(each) == 1 else f"{len(each)} times"
    return f"{times}: " + "; ".join(each) + "; Cumulative Time continues across the resumes (training time only)"


def _profile_keys(epochs: list[dict]) -> list[str]:
    """The numeric profile entries of any epoch, in order of first appearance."""
    keys: list[str] = []
    for e in epochs:
        profile = e.get("profile") if isinstance(e.get("profile"), dict) else {}
        keys += [key for key, value in profile.items() if is_number(value) and key not in keys]
    return keys


def _streak_marks(run: Run) -> list[str]:
    """Per epoch, the criterion's progress under the rule then in force: 'k/patience', '... , stop' where met."""
    from ..stopping import trailing_streak

    stop, (targets, patiences), at_stop = run_stop(run), run.rules, run_rule(run)
    marks = []
    for i in range(len(run.epochs)):
        target, patience = (
            (at_stop["target_accuracy"], at_stop["patience"]) if i == stop else (targets[i], patiences[i])
        )
        streak = trailing_streak(run.accuracies[: i + 1], target)
        marks.append(
            f"{streak}/{patience}, stop" if i == stop else (f"{min(streak, patience)}/{patience}" if streak else "")
        )
    return marks


def epoch_table(run: Run) -> Table | Text:
    if not run.epochs:
        return Text("_No epoch records: the run ended before its first epoch finished._")
    parts = _profile_keys(run.epochs)
    head = ["Epoch", "Cumulative Time (s)", "Epoch Time (s)", "Images/sec", "Train accuracy", "Val loss"]
    head += ["Val accuracy", f">= {run.target}"] + [f"{k} (s)" for k in parts]
    rows = []
    for e, mark in zip(run.epochs, _streak_marks(run)):
        profile = e.get("profile") if isinstance(e.get("profile"), dict) else {}
        rows.append(
            [
                e["epoch"],
                fmt(e["cumulative_time"]),
                fmt(e["epoch_time"]),
                fmt(e["images_per_sec"], 1),
                fmt(e.get("train_accuracy"), 4),  # logs before it was counted lack it
                fmt(e["val_loss"], 4),
                fmt(e["val_accuracy"], 4),
                mark,
            ]
            + [fmt(profile.get(k)) if is_number(profile.get(k)) else "–" for k in parts]
        )
    return Table(head, rows)


def _scaling_row(row: dict, speed: bool) -> list:
    r = row["run"]
    cells = [
        r.label,
        row["p"],
        f"{r.num_nodes} x {r.num_gpus}",
        fmt(row["time_to_target"], missing="not reached"),
        fmt(row["images_per_sec"], 1),
        fmt(row["final_accuracy"], 4),
    ]
    if speed:
        amdahl = row.get("amdahl", {})
        cells += [
            row["reference"].label if row.get("speedup") is not None else "none comparable",
            fmt(row.get("speedup")),
            fmt(row.get("efficiency")),
            fmt(row.get("karp_flatt"), 4),
        ]
        cells += [fmt(amdahl.get(n)) for n in AMDAHL_GPUS]
    return cells


def scaling_table(sc: Scaling) -> Table:
    """The scaling table, for report.md and the PDF alike."""
    speed = sc.basis is not None
    head = ["run", "processes (world size)", "nodes x per node", "Cumulative Time to target (s)", "mean Images/sec"]
    head += ["final val accuracy"]
    if speed:
        basis = "time to target" if sc.basis == "time" else "images/sec"
        head += ["compared with", f"speedup ({basis})", "efficiency", "Karp-Flatt e"]
        head += [f"Amdahl S({n})" for n in AMDAHL_GPUS]
    return Table(head, [_scaling_row(row, speed) for row in sc.rows])


BASIS = {
    "time": "**Speedup basis: Cumulative Time to target.** Every run reached the target, so "
    "S = T(1 process) / T(p), T(1) from the run it is compared with. This includes any change in the "
    "number of epochs needed (a larger global batch can need more or fewer).",
    "throughput": "**Speedup basis: mean Images/sec** (not every run reached the target, so time to target "
    "cannot be compared): S = R(p) / R(1 process), R(1) from the run it is compared with. This "
    "measures raw training speed only, not how many epochs each run needs.",
}
SPEEDUP_TERMS = (
    "**efficiency** E = S / p. **Karp-Flatt** serial fraction e = (1/S − 1/p) / (1 − 1/p): the "
    "share of the 1-process work that behaves as if it could not be parallelised (communication, "
    "synchronisation, serial work); a constant e across p suggests a true serial part, a growing e "
    "suggests overhead that grows with p.",
    "**Amdahl S(n)** = 1 / (e + (1 − e) / n): the speedup on n GPUs predicted from that run's e.",
    "**Compared with**: a run is compared only with a 1-process run of the same recipe, data "
    "(training and validation images), model and device type, differing in the process count alone.",
)


# The headings other sections point to ("Scaling", "Time profile"), the same in report.md and the PDF.
SCALING_TITLE = "Scaling: one process against N (speedup, efficiency, Karp-Flatt serial fraction, Amdahl's law)"
PROFILE_TITLE = "Time profile"


def scaling_section(sc: Scaling, runs: list[Run]) -> Section:
    """The scaling table, then what each column means and the notes on the comparison."""
    targets = sorted({(r.target, r.patience) for r in runs})
    items = [
        "**Cumulative Time to target**: the Cumulative Time (training only, validation excluded, rank "
        "0's clock) at the first epoch where validation accuracy has been >= the target for `patience` "
        "consecutive epochs: the epoch the trainers stop at. Target, patience from each header's recipe: "
        + ", ".join(f"{t} x {p}" for t, p in targets)
        + ".",
        "**mean Images/sec**: each epoch's Images/sec is the sum over all processes (as logged); the "
        "table shows the arithmetic mean over all logged epochs of the run, epoch 1 (warm-up) included.",
    ]
    if sc.basis in BASIS:
        items.append(BASIS[sc.basis])
    if sc.basis is not None:
        items += SPEEDUP_TERMS
    return Section("scaling", SCALING_TITLE, [scaling_table(sc), Bullets(short_runs(runs) + items + sc.notes)])


def profile_section(group: list[Run], runs: list[Run] = ()) -> Section | None:
    """The profiles of the featured run's `group`; where none has one (a printed log has none), those of the
    other `runs`, said to be apart from it (README's checklist profiles the project's trainer for the student)."""
    parts, keys = profiled(group)
    what = "Mean seconds per epoch of each part, over the epochs that carry a profile."
    if not parts:
        parts, keys = profiled([r for r in runs if r not in group])
        names = ", ".join(code(r.label) for r, _ in parts)
        what += f" No run of the featured run's kind has one: these are of {names}, a run of another kind."
    if not parts:
        return None
    rows = [[r.label] + [fmt(p.get(k)) for k in keys] + [fmt(sum(p.values()))] for r, p in parts]
    return Section("profile", PROFILE_TITLE, [Text(what), Table(["run"] + keys + ["sum"], rows)])
