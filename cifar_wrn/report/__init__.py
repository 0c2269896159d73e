"""The course's report from run logs: R3 and the Demonstrate items 1-6, tables, scaling numbers and figures.

    python -m cifar_wrn.report runs/baseline-1x1-20261202-130000 runs/baseline-1x2-20261202-131500 --out report
    python -m cifar_wrn.report runs/123456 runs/123457 --out report --pdf report.pdf --notes notes.yaml

Each input is a run folder (raw_ddp.py writes runs/<recipe>-<nodes>x<procs>-<YYYYmmdd-HHMMSS>/log.jsonl,
accel_train.py runs/accel-<recipe>-..., a Slurm job runs/<job id>/log.jsonl) or a log file (--log-json
PATH): the JSON-lines log of cifar_wrn/runlog.py, a header, then one object per epoch. It writes
DIR/report.md with PNG figures next to it:

- the DDP steps (R1): the line numbers of each `# R1.<n>` tag of the raw_ddp.py next to this module;
- the scaling table: time to the stopping criterion, images/sec, final accuracy, and, only between
  comparable runs (same recipe, data, model and device type, differing in world size), speedup, parallel
  efficiency, the Karp-Flatt serial fraction and Amdahl's predictions; other runs are named with what differs;
- Demonstrate 1-6 as facts: topology and the pinning/init_process_group lines, each rank's shard and
  padding, the gradient bytes and DDP buckets per step (and the measured all-reduce with --profile), the
  R1.9 aggregation lines with the reduced values, and the recipe's differences from baseline.yaml with
  before/after from the student's own logs (--compare BEFORE AFTER);
- per run: the header facts, the process topology (text and diagram) and the epoch log as a table;
- figures (matplotlib, the optional extra `plot`); without it the tables are still written;
- with `--pdf FILE`, the same in at most 4 pages (cifar_wrn/report/pdf.py, fpdf2).

Every explanation the course asks for is a marked slot, `[you write: ...]`, or the student's own text from
`--notes notes.yaml` (docs/report-example/notes.yaml shows the form). report.md holds nothing but what the
logs and the code give (no date, no absolute path unless given one), so the same inputs write the same file.

A log is one run, however often it was resumed: each `--auto-resume` appends a header with `resumed_at`,
and the headers that a trainer would have resumed as one run are read as its segments (epochs in order,
Cumulative Time continuing). Anything else in one file (another run's header) is refused, naming the line.
"""

import argparse
import json
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from ..errors import UserError

AMDAHL_GPUS = (2, 4, 8)  # the GPU counts Amdahl's law is asked about
HEADER_FIELDS = ("world_size", "num_nodes", "num_gpus", "backend", "device")
EPOCH_FIELDS = ("epoch", "cumulative_time", "epoch_time", "images_per_sec", "val_loss", "val_accuracy")
# Header entries that must agree for a speedup to compare like with like.
COMPARABLE = ("recipe", "train_images", "val_images", "model_width", "model_parameters", "device")
INSTALL_HINT = "pip install matplotlib, or pip install -e '.[plot]'"


class LogError(UserError):
    """A file that is missing, unreadable or not a run log."""


# ============================================================================ the arithmetic


def stopping_epoch(accuracies, target, patience) -> int | None:
    """Index (0-based) of the first epoch at which the trainers stop early (runlog.criterion_met, the course's
    rule), or None. `target` and `patience`: one value, or one per epoch (the values in force when it was
    logged: a resume may change them, Run.rules)."""
    from ..runlog import criterion_met

    targets = target if isinstance(target, list) else [target] * len(accuracies)
    patiences = patience if isinstance(patience, list) else [patience] * len(accuracies)
    for i in range(len(accuracies)):
        if criterion_met(accuracies[: i + 1], targets[i], patiences[i]):
            return i
    return None


def time_to_target(epochs: list[dict], target, patience) -> float | None:
    """Cumulative Time (seconds of training, validation excluded) at the stopping epoch, or None."""
    i = stopping_epoch([e["val_accuracy"] for e in epochs], target, patience)
    return None if i is None else float(epochs[i]["cumulative_time"])


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


def global_rank(node_id: int, num_gpus: int, local_rank: int) -> int:
    """The rank arithmetic of raw_ddp.py (R1.2): node 0 holds ranks 0..num_gpus-1, node 1 the next, ..."""
    return node_id * num_gpus + local_rank


# ============================================================================ reading logs


@dataclass
class Segment:
    """One stretch of a run in its log: from a header to the next. The first starts the run; each later one
    is a resume (`--auto-resume` after a preemption or a requeue), whose header carries `resumed_at`."""

    line: int  # the header's line number in the file
    header: dict

    @property
    def resumed_at(self) -> dict | None:
        return self.header.get("resumed_at")

    def where(self) -> str:
        """'epoch 3 step 60' for a resume, '' for the start of the run."""
        at = self.resumed_at
        return f"epoch {at.get('epoch')} step {at.get('step')}" if isinstance(at, dict) else ""


@dataclass
class Run:
    path: Path
    header: dict  # the first header: how the run started
    epochs: list[dict]  # in epoch order, one per epoch (a resume's record replaces an older one)
    label: str = ""
    segments: list[Segment] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the reader should know about the log itself

    @property
    def world_size(self) -> int:
        return self.header["world_size"]

    @property
    def num_nodes(self) -> int:
        return self.header["num_nodes"]

    @property
    def num_gpus(self) -> int:
        return self.header["num_gpus"]

    @property
    def recipe(self) -> dict:
        """The recipe the run ended with: a resume may change the stopping rule (RESUMABLE_CHANGES)."""
        return (self.segments[-1].header if self.segments else self.header)["recipe"]

    @property
    def target(self) -> float:
        return self.recipe["target_accuracy"]

    @property
    def patience(self) -> int:
        return self.recipe["patience"]

    @property
    def rules(self) -> tuple[list[float], list[int]]:
        """(targets, patiences), one per epoch: the stopping rule of the header in force when it was logged."""

        def rule(epoch: dict, key: str):
            line = epoch.get("log_line", 0)
            headers = [s.header for s in self.segments if s.line < line] or [self.header]
            return headers[-1]["recipe"][key]

        return [rule(e, "target_accuracy") for e in self.epochs], [rule(e, "patience") for e in self.epochs]

    @property
    def config(self) -> tuple:
        return (self.num_nodes, self.num_gpus, self.header["backend"], self.header["device"])

    @property
    def resumes(self) -> list[Segment]:
        return self.segments[1:] if self.segments and self.segments[0].resumed_at is None else self.segments


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


HINT = "expected the JSON-lines log that raw_ddp.py / accel_train.py write with --log-json"


def _records(path: Path):
    """(line number, JSON object) of every non-blank line; a LogError names the file (and line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LogError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LogError(f"{path}: is a folder, not a run log") from None
    except UnicodeDecodeError:
        raise LogError(f"{path}: not a run log (not a text file)") from None
    except OSError as exc:
        raise LogError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise LogError(f"{path}, line {number}: not JSON; {HINT}") from None
        if not isinstance(record, dict):
            raise LogError(f"{path}, line {number}: not a JSON object; {HINT}")
        yield number, record


def _check_header(where: str, record: dict) -> None:
    missing = [k for k in HEADER_FIELDS if k not in record]
    if missing:
        raise LogError(f"{where}: the header lacks {', '.join(missing)}")
    for key in ("world_size", "num_nodes", "num_gpus"):
        if not isinstance(record[key], int) or isinstance(record[key], bool) or record[key] < 1:
            raise LogError(f"{where}: header {key} must be a positive integer (got {record[key]!r})")
    if record["world_size"] != record["num_nodes"] * record["num_gpus"]:
        raise LogError(
            f"{where}: header world_size {record['world_size']} is not num_nodes x num_gpus = "
            f"{record['num_nodes']} x {record['num_gpus']}"
        )
    recipe = record.get("recipe")
    if (
        not isinstance(recipe, dict)
        or not _is_number(recipe.get("target_accuracy"))
        or not isinstance(recipe.get("patience"), int)
    ):
        raise LogError(f"{where}: the header has no recipe with target_accuracy and patience")
    at = record.get("resumed_at")
    if at is not None and not (
        isinstance(at, dict)
        and isinstance(at.get("epoch"), int)
        and at["epoch"] >= 1
        and isinstance(at.get("step"), int)
    ):
        raise LogError(f'{where}: resumed_at must be null or {{"epoch": N >= 1, "step": M}} (got {at!r})')


def other_run(first: dict, later: dict) -> str | None:
    """Why the header `later` does not continue the run that `first` started, or None when it does: the
    trainers' own rule for a resume (cifar_wrn/checkpoint.py resume_problem: the same world size, model,
    data and recipe, except the keys a resume may change), so the report reads as one run exactly what a
    trainer would have resumed as one. Keys one header lacks had their default (an older trainer)."""
    from ..checkpoint import resume_problem

    data = ("train_images", "val_images", "steps_per_epoch")
    started = {
        "world_size": first["world_size"],
        "model_width": first.get("model_width"),
        "architecture": first.get("architecture"),  # logs before the course's model lack it
        "recipe": full_recipe(first["recipe"]),
        **{k: first[k] for k in data if k in first},
    }
    return resume_problem(
        started,
        full_recipe(later["recipe"]),
        later["world_size"],
        later.get("model_width"),
        {k: later[k] for k in data if k in later and k in first},
        later.get("architecture"),
    )


RUN_LOG = "log.jsonl"  # the trainers' log in a run folder: runs/<name>/log.jsonl


def log_path(path) -> Path:
    """A run folder stands for the log.jsonl in it; a file is itself."""
    path = Path(path)
    if path.is_dir():
        if not (path / RUN_LOG).is_file():
            raise LogError(f"{path}: a folder without {RUN_LOG}: give a run log or a run folder that holds one")
        return path / RUN_LOG
    return path


def read_run(path) -> Run:
    """A run log, checked: a LogError names the file (and line) when it is not one. A log with several
    headers is one run resumed (each later header has `resumed_at` and continues the first one's run):
    its epochs are read in order, a resume's record of an epoch replacing any older one."""
    path = log_path(path)
    segments: list[Segment] = []
    epochs: dict[int, dict] = {}
    notes: list[str] = []
    for number, record in _records(path):
        where = f"{path}, line {number}"
        if record.get("kind") == "header":
            _check_header(where, record)
            if segments:
                start = segments[0]
                if record.get("resumed_at") is None:
                    raise LogError(
                        f"{where}: a second header without resumed_at: a new run starts here, not a "
                        f"resume of the run of line {start.line}; one run per file"
                    )
                problem = other_run(start.header, record)
                if problem:
                    raise LogError(
                        f"{where}: this header is not a resume of the run of line {start.line} "
                        f"({problem}); one run per file"
                    )
            segment = Segment(number, record)
            if segment.resumed_at is not None:
                resumed = segment.resumed_at["epoch"]
                redone = sorted(e for e in epochs if e >= resumed)
                for e in redone:  # logged, then lost: the checkpoint resumed from was older than them
                    del epochs[e]
                if redone:
                    notes.append(
                        f"line {number} resumes at {segment.where()}, before epoch(s) "
                        f"{', '.join(map(str, redone))} already logged: those were trained again; the "
                        f"table shows the later records"
                    )
                if resumed > max(epochs, default=0) + 1:
                    notes.append(
                        f"line {number} resumes at {segment.where()}, but this file holds no record of "
                        f"epoch(s) {max(epochs, default=0) + 1}..{resumed - 1}"
                    )
            segments.append(segment)
        elif record.get("kind") == "epoch":
            if not segments:
                raise LogError(f"{where}: an epoch record before the header; {HINT}")
            bad = [k for k in EPOCH_FIELDS if not _is_number(record.get(k))]
            if bad:
                raise LogError(f"{where}: the epoch record lacks numeric {', '.join(bad)}")
            if not isinstance(record["epoch"], int) or record["epoch"] < 1:
                raise LogError(
                    f"{where}: the epoch record's epoch must be a whole number >= 1 (got {record['epoch']!r})"
                )
            if epochs and record["epoch"] <= max(epochs):
                raise LogError(
                    f"{where}: epoch {record['epoch']} after epoch {max(epochs)} with no resume "
                    f"between them (two runs appended to one file?); one run per file"
                )
            epochs[record["epoch"]] = dict(record, log_line=number)
        # other kinds of record (none today) are left alone: a newer trainer may add some
    if not segments:
        raise LogError(f"{path}: not a run log (no header record); {HINT}")
    return Run(path, segments[0].header, [epochs[e] for e in sorted(epochs)], segments=segments, notes=notes)


def label_runs(runs: list[Run]) -> None:
    """A short, unique name per run (the file name without .jsonl, the folder's for a run folder's log), used
    in tables and figure names."""
    names = [r.path.parent.name if r.path.name == RUN_LOG and r.path.parent.name else r.path.stem for r in runs]
    for run, name in zip(runs, names):
        if names.count(name) > 1:
            name = f"{run.path.parent.name}/{name}" if run.path.parent.name else name
        run.label = name
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"


# ============================================================================ scaling


@dataclass
class Scaling:
    rows: list[dict]  # one per run, in the order of the table
    basis: str | None  # "time" (Cumulative Time to target), "throughput" (images/sec), None
    baseline: Run | None
    notes: list[str]


def scaling(runs: list[Run]) -> Scaling:
    """The numbers of the scaling table. Each N-process run is compared only with a 1-process run of the same
    experiment (COMPARABLE: recipe, data, model, device type), the first such one given; a run with none gets
    no speedup, efficiency, Karp-Flatt or Amdahl, and a note naming what differs. The basis is Cumulative Time
    to target when every compared run reached it, else mean images/sec (so all rows share one basis)."""
    ordered = sorted(runs, key=lambda r: (r.world_size, r.num_nodes))  # stable: ties keep the given order
    rows = [
        {
            "run": r,
            "p": r.world_size,
            "time_to_target": time_to_target(r.epochs, *r.rules),
            "images_per_sec": mean_images_per_sec(r.epochs),
            "final_accuracy": r.epochs[-1]["val_accuracy"] if r.epochs else None,
        }
        for r in ordered
    ]
    singles = [r for r in ordered if r.world_size == 1]
    if not singles:
        return Scaling(
            rows,
            None,
            None,
            [
                "There is no 1-process run (world size 1) among these logs, so no "
                "speedup, efficiency, Karp-Flatt or Amdahl columns: add one."
            ],
        )
    notes = []
    for row in rows:
        if row["p"] > 1:
            row["reference"] = next((s for s in singles if not differences([s, row["run"]])), None)
            if row["reference"] is None:
                notes.append(
                    f"**`{row['run'].label}` is not compared with a 1-process run**: against "
                    f"`{singles[0].label}` it differs in {'; '.join(differences([singles[0], row['run']]))}"
                    f", so no speedup, efficiency, Karp-Flatt or Amdahl is computed for it. Run the same "
                    f"recipe on the same data and device with 1 process."
                )
    paired = [row for row in rows if row.get("reference")]
    references = {id(row["reference"]) for row in paired}
    for row in rows:
        if id(row["run"]) in references:
            row["reference"] = row["run"]
    compared = [row for row in rows if row.get("reference")]
    if not paired:
        return Scaling(rows, None, singles[0], notes)
    epochs = lambda r: time_to_target(r.epochs, *r.rules)
    if all(row["time_to_target"] and epochs(row["reference"]) for row in compared):
        basis, value = "time", lambda row: speedup_by_time(epochs(row["reference"]), row["time_to_target"])
    elif all(row["images_per_sec"] and row["reference"].epochs for row in compared):
        basis = "throughput"
        value = lambda row: speedup_by_throughput(mean_images_per_sec(row["reference"].epochs), row["images_per_sec"])
    else:
        return Scaling(rows, None, singles[0], notes + ["A run has no epoch records: no speedup columns."])
    for row in compared:
        row["speedup"] = s = value(row)
        row["efficiency"] = parallel_efficiency(s, row["p"])
        if row["p"] == 1:
            continue
        if s < 1:
            notes.append(
                f"**Flag: `{row['run'].label}` is slower than `{row['reference'].label}`** (speedup "
                f"{s:.3f} < 1): {row['p']} processes trained fewer images per second than one."
            )
        if s > 0:
            row["karp_flatt"] = e = karp_flatt(s, row["p"])
            if 0 <= e <= 1:
                row["amdahl"] = {n: amdahl_speedup(e, n) for n in AMDAHL_GPUS}
            else:
                notes.append(
                    f"**Flag: `{row['run'].label}`'s serial fraction e = {e:.4f} is outside [0, 1]** "
                    + ("(a speedup above p: superlinear, or noise)" if e < 0 else "(a speedup below 1)")
                    + ": it is no serial fraction Amdahl's law can use, so no Amdahl predictions."
                )
    return Scaling(rows, basis, singles[0], notes)


def full_recipe(recipe: dict) -> dict:
    """A header's recipe with the keys it lacks at their defaults: a key newer than the trainer that wrote
    the log had its default then (new recipe keys default to the old behaviour)."""
    from ..recipe import Recipe, as_dict  # torch, a dependency of the project anyway

    return {**as_dict(Recipe()), **recipe}


def differences(runs: list[Run]) -> list[str]:
    """Header entries (COMPARABLE) that are not the same in every run."""
    out = []
    for key in COMPARABLE:
        values = [
            full_recipe(r.header[key]) if key == "recipe" and isinstance(r.header.get(key), dict) else r.header.get(key)
            for r in runs
        ]
        if all(v == values[0] for v in values):
            continue
        if key == "recipe" and all(isinstance(v, dict) for v in values):
            keys = sorted({k for v in values for k in v if len({json.dumps(x.get(k)) for x in values}) > 1})
            out.append("recipe (" + ", ".join(keys) + ")")
        else:
            out.append(f"{key} ({' vs '.join(dict.fromkeys(map(str, values)))})")
    return out


# ============================================================================ text


def fmt(value, digits: int = 3, missing: str = "–") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(md_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def topology_text(num_nodes: int, num_gpus: int, backend: str, device: str) -> str:
    """Nodes, the processes in each with local and global rank, and the ring 0 -> 1 -> ... -> 0."""
    world = num_nodes * num_gpus
    slot = "cuda:{l}" if device == "cuda" else "cpu"
    lines = [f"{num_nodes} node(s) x {num_gpus} process(es) per node = world size {world} ({backend} on {device})"]
    for node in range(num_nodes):
        cells = [
            f"[{slot.format(l=lr)} local_rank {lr} = rank {global_rank(node, num_gpus, lr)}]" for lr in range(num_gpus)
        ]
        lines.append(f"node {node}: " + " ".join(cells))
    if world == 1:
        lines.append("one process: no all-reduce")
    else:
        ring = "0"
        for rank in range(world):
            nxt = (rank + 1) % world
            ring += (" => " if rank // num_gpus != nxt // num_gpus else " -> ") + str(nxt)
        lines.append(f"ring: {ring}")
        lines.append(
            "(-> within a node, => between nodes; a simple picture of a ring all-reduce: "
            f"{backend} picks its own rings/trees)"
        )
    return "\n".join(lines)


def profile_parts(epochs: list[dict]) -> dict[str, float]:
    """Mean seconds per epoch of each numeric entry of the epochs' "profile" dicts ({} when none)."""
    sums: dict[str, float] = {}
    profiled = [e["profile"] for e in epochs if isinstance(e.get("profile"), dict)]
    for prof in profiled:
        for key, value in prof.items():
            if _is_number(value) and math.isfinite(value):
                sums[key] = sums.get(key, 0.0) + value
    return {key: total / len(profiled) for key, total in sums.items()}


def _profile_keys(epochs: list[dict]) -> list[str]:
    """The numeric profile entries of any epoch, in order of first appearance."""
    keys: list[str] = []
    for e in epochs:
        profile = e.get("profile") if isinstance(e.get("profile"), dict) else {}
        keys += [key for key, value in profile.items() if _is_number(value) and key not in keys]
    return keys


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
    optional = [
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
        ("started", "started_at"),
    ]
    facts += [[name, h[key]] for name, key in optional if key in h]
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


def epoch_table(run: Run) -> str:
    from ..runlog import trailing_streak

    if not run.epochs:
        return "_No epoch records: the run ended before its first epoch finished._"
    stop = stopping_epoch([e["val_accuracy"] for e in run.epochs], *run.rules)
    parts = _profile_keys(run.epochs)
    head = [
        "Epoch",
        "Cumulative Time (s)",
        "Epoch Time (s)",
        "Images/sec",
        "Train accuracy",
        "Val loss",
        "Val accuracy",
        f">= {run.target}",
    ] + [f"{k} (s)" for k in parts]
    rows, (targets, patiences) = [], run.rules
    accuracies = [e["val_accuracy"] for e in run.epochs]
    for i, e in enumerate(run.epochs):
        streak, patience = trailing_streak(accuracies[: i + 1], targets[i]), patiences[i]  # the rule then in force
        mark = f"{streak}/{patience}, stop" if i == stop else (f"{min(streak, patience)}/{patience}" if streak else "")
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
            + [fmt(profile.get(k)) if _is_number(profile.get(k)) else "–" for k in parts]
        )
    return md_table(head, rows)


def scaling_table(sc: Scaling) -> tuple[list[str], list[list]]:
    """(headings, rows) of the scaling table, for report.md and the PDF alike."""
    speed = sc.basis is not None
    head = [
        "run",
        "processes (world size)",
        "nodes x per node",
        "Cumulative Time to target (s)",
        "mean Images/sec",
        "final val accuracy",
    ]
    if speed:
        head += [
            "compared with",
            f"speedup ({'time to target' if sc.basis == 'time' else 'images/sec'})",
            "efficiency",
            "Karp-Flatt e",
        ] + [f"Amdahl S({n})" for n in AMDAHL_GPUS]
    rows = []
    for row in sc.rows:
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
        rows.append(cells)
    return head, rows


def scaling_section(sc: Scaling, runs: list[Run]) -> list[str]:
    speed = sc.basis is not None
    out = ["## Scaling", "", md_table(*scaling_table(sc)), ""]
    targets = sorted({(r.target, r.patience) for r in runs})
    out.append(
        "- **Cumulative Time to target**: the Cumulative Time (training only, validation excluded, rank "
        "0's clock) at the first epoch where validation accuracy has been >= the target for `patience` "
        "consecutive epochs: the epoch the trainers stop at. Target, patience from each header's recipe: "
        + ", ".join(f"{t} x {p}" for t, p in targets)
        + "."
    )
    out.append(
        "- **mean Images/sec**: each epoch's Images/sec is the sum over all processes (as logged); the "
        "table shows the arithmetic mean over all logged epochs of the run, epoch 1 (warm-up) included."
    )
    if sc.basis == "time":
        out.append(
            "- **Speedup basis: Cumulative Time to target.** Every run reached the target, so "
            "S = T(1 process) / T(p), T(1) from the run it is compared with. This includes any change in the "
            "number of epochs needed (a larger global batch can need more or fewer)."
        )
    elif sc.basis == "throughput":
        out.append(
            "- **Speedup basis: mean Images/sec** (not every run reached the target, so time to target "
            "cannot be compared): S = R(p) / R(1 process), R(1) from the run it is compared with. This "
            "measures raw training speed only, not how many epochs each run needs."
        )
    if speed:
        out.append(
            "- **efficiency** E = S / p. **Karp-Flatt** serial fraction e = (1/S − 1/p) / (1 − 1/p): the "
            "share of the 1-process work that behaves as if it could not be parallelised (communication, "
            "synchronisation, serial work); a constant e across p suggests a true serial part, a growing e "
            "suggests overhead that grows with p."
        )
        out.append("- **Amdahl S(n)** = 1 / (e + (1 − e) / n): the speedup on n GPUs predicted from that run's e.")
    if speed:
        out.append(
            "- **Compared with**: a run is compared only with a 1-process run of the same recipe, data "
            "(training and validation images), model and device type, differing in the process count alone."
        )
    out += [f"- {note}" for note in sc.notes]
    return out + [""]


def profile_section(runs: list[Run]) -> list[str]:
    profiled = [(r, profile_parts(r.epochs)) for r in runs]
    profiled = [(r, parts) for r, parts in profiled if parts]
    if not profiled:
        return []
    keys = []
    for _, parts in profiled:
        keys += [k for k in parts if k not in keys]
    rows = [[r.label] + [fmt(parts.get(k)) for k in keys] + [fmt(sum(parts.values()))] for r, parts in profiled]
    return [
        "## Time profile",
        "",
        "Mean seconds per epoch of each part, over the epochs that carry a profile.",
        "",
        md_table(["run"] + keys + ["sum"], rows),
        "",
    ]


# ============================================================================ the course's R3 report

REPO = Path(__file__).resolve().parents[2]
RAW_DDP = REPO / "raw_ddp.py"
WALKTHROUGH = "docs/ddp_walkthrough.md"
TAG = re.compile(r"#\s*(R1\.\d+\b.*)$")
BUCKET_CAP_MB, FIRST_BUCKET_MB = 25, 1  # DDP's defaults: bucket_cap_mb, and the smaller first bucket
MIB = 1024 * 1024
# What the course asks the student to explain, one slot per Demonstrate item (notes.yaml's `explain:`).
EXPLAIN = {
    "topology": "how the ranks map onto nodes and GPUs, and why each process is pinned to its own GPU",
    "partitioning": "why each rank gets a disjoint shard, why the sampler pads, and what set_epoch changes",
    "gradient_sync": "what DDP's all-reduce does during backward, and why every replica stays identical",
    "aggregation": "why images/sec is summed over the ranks while loss and accuracy are averaged",
    "scaling": "where the time goes (the bottleneck), and what Amdahl's law predicts for more GPUs",
    "optimisations": "why each change helps, judged from your before/after measurements",
}


def ddp_steps(source: Path = RAW_DDP) -> list[tuple[str, list[int]]]:
    """(step, line numbers) for each `# R1.<n>` tag in `source`, by step number. A line cites every step
    its comment names ("# R1.2, R1.3, R1.7" on a call counts for all three)."""
    lines: dict[str, list[int]] = {}
    for number, text in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        tag = TAG.search(text)
        for step in re.findall(r"R1\.\d+\b", tag.group(1)) if tag else []:
            lines.setdefault(step, []).append(number)
    return [(step, lines[step]) for step in sorted(lines, key=lambda step: int(step.split(".")[1]))]


def code_lines(step: str, containing: str = "", source: Path = RAW_DDP) -> list[str]:
    """The code lines (not the comment-only ones) tagged `step`, as 'NNN: code', optionally only those
    containing `containing`: quoted as they stand in the shipped file."""
    text = source.read_text(encoding="utf-8").splitlines()
    numbers = dict(ddp_steps(source)).get(step, [])
    return [
        f"{n}: {text[n - 1].strip()}"
        for n in numbers
        if not text[n - 1].lstrip().startswith("#") and containing in text[n - 1]
    ]


def statement_lines(opening: str, source: Path = RAW_DDP) -> list[str]:
    """Each statement whose first line contains `opening`, whole (to its closing bracket), as 'NNN: code': the
    DDP wrap quoted however the formatter splits it."""
    text, out = source.read_text(encoding="utf-8").splitlines(), []
    for n, line in enumerate(text, 1):
        if opening in line and not line.lstrip().startswith("#"):
            depth, m = 0, n
            while True:
                code = text[m - 1].split("#")[0]
                depth += code.count("(") + code.count("[") - code.count(")") - code.count("]")
                out.append(f"{m}: {text[m - 1].strip()}")
                if depth <= 0 or m == len(text):
                    break
                m += 1
    return out


def slot(notes: dict, section: str, key: str, what: str) -> str:
    """The student's own text from --notes, or a marked slot saying what to write there."""
    return notes.get(section, {}).get(key) or f"[you write: {what}]"


def shards(n: int, world: int, batch: int | None) -> dict:
    """DistributedSampler's arithmetic (drop_last=False): every rank takes ceil(n / world) indices, the list
    padded with repeats of its first ones; ranks n % world .. world-1 hold one repeat each. `steps`: the
    batches of `batch` per rank with BatchSampler's drop_last=True."""
    shard = math.ceil(n / world)
    padding = shard * world - n
    steps = shard // batch if batch else None
    return {
        "shard": shard,
        "padding": padding,
        "padded_ranks": list(range(world - padding, world)),
        "steps": steps,
        "dropped": shard - steps * batch if batch else None,
    }


def accelerate_shards(n: int, world: int, batch: int, drop_last: bool) -> dict:
    """Accelerate's prepare() of a plain DataLoader (accel_train.py's DataLoader path): the loader's batches dealt
    out in rounds, rank r taking batches r, r + W, ... With drop_last the short batch and a last incomplete
    round are dropped; without it (even_batches) the short batch and the last round are filled up with the first
    images again, which gather_for_metrics leaves out."""
    if drop_last:
        rounds = n // batch // world
        return {
            "shard": rounds * batch,
            "padding": 0,
            "padded_ranks": [],
            "steps": rounds,
            "unused": n - rounds * world * batch,
        }
    rounds = math.ceil(math.ceil(n / batch) / world)
    padded = [r for r in range(world) if any((j * world + r + 1) * batch > n for j in range(rounds))]
    return {
        "shard": rounds * batch,
        "padding": rounds * world * batch - n,
        "padded_ranks": padded,
        "steps": rounds,
        "unused": 0,
    }


def gradient_bytes(run: Run) -> tuple[int, int] | None:
    """(bytes all-reduced per step, estimated DDP buckets) from the header's parameter count: gradients in the
    parameters' dtype (fp32, also under bf16 autocast), half that with grad_compression bf16; buckets from
    DDP's default caps (the first FIRST_BUCKET_MB, then BUCKET_CAP_MB each), an estimate: DDP fills buckets
    with whole tensors."""
    params = run.header.get("model_parameters")
    if not isinstance(params, int):
        return None
    grads = params * 4
    buckets = 1 + math.ceil(max(0, grads - FIRST_BUCKET_MB * MIB) / (BUCKET_CAP_MB * MIB))
    return grads // (2 if run.recipe.get("grad_compression") == "bf16" else 1), buckets


def code_block(lines: list[str]) -> tuple:
    """Quoted lines 'NNN: code' in file order, each once."""
    lines = sorted(set(lines), key=lambda line: int(line.split(":")[0]))
    return ("code", lines or ["(no such tagged line in raw_ddp.py)"])


def demonstrate(runs: list[Run], sc: "Scaling", notes: dict, compare: list[tuple[Run, Run]]) -> list[tuple]:
    """The course's Demonstrate items 1-6 as blocks, facts from the logs and the shipped raw_ddp.py, the
    explanations as slots: ("h", title), ("p", text), ("table", head, rows), ("code", lines)."""
    explain = lambda key: ("p", "**Explanation:** " + slot(notes, "explain", key, EXPLAIN[key]))
    cite = f"The concepts: {WALKTHROUGH}."
    out = [
        ("h", "Demonstrate 1: process topology and rank assignment"),
        (
            "p",
            "Each run's layout (the diagrams and text topologies are in its section under Runs): "
            + "; ".join(
                f"`{r.label}` draws {r.num_nodes} node(s) x {r.num_gpus} "
                f"{'GPU(s)' if r.header['device'] == 'cuda' else 'CPU process(es)'}, "
                + (f"ranks 0-{r.world_size - 1}" if r.world_size > 1 else "rank 0")
                + f", {r.header['backend']}"
                for r in runs
            )
            + f". In raw_ddp.py, the ranks (R1.2), the GPU pinning (R1.7) and init_process_group (R1.3). {cite}",
        ),
        code_block(code_lines("R1.2") + code_lines("R1.7", "device") + code_lines("R1.3", "init_process_group")),
        explain("topology"),
        ("h", "Demonstrate 2: data partitioning"),
    ]
    rows, accelerate = [], False
    for r in runs:
        batch = r.header.get("per_device_batch_size")
        prepared = r.header.get("trainer") == "accelerate" and r.recipe.get("data_pipeline") != "device"
        accelerate |= prepared
        for split, key, b in (("train", "train_images", batch), ("validation", "val_images", None)):
            n = r.header.get(key)
            if isinstance(n, int) and prepared and isinstance(batch, int):
                eval_batch = r.recipe.get("eval_batch_size", 500)
                sh = accelerate_shards(n, r.world_size, b or eval_batch, drop_last=b is not None)
                steps = f"{sh['steps']} x {b} ({sh['unused']} unused: the short batch and the last round)"
                row = [r.label, split, n, r.world_size, sh["shard"], sh["padding"]]
                rows.append(row + [", ".join(map(str, sh["padded_ranks"])) or "none", "–" if b is None else steps])
            elif isinstance(n, int):
                sh = shards(n, r.world_size, b)
                rows.append(
                    [
                        r.label,
                        split,
                        n,
                        r.world_size,
                        sh["shard"],
                        sh["padding"],
                        ", ".join(map(str, sh["padded_ranks"])) or "none",
                        "–"
                        if b is None
                        else f"{sh['steps']} x {b} ({sh['dropped']} dropped)"
                        + (
                            ""
                            if r.header.get("steps_per_epoch") in (None, sh["steps"])
                            else f"; the log says {r.header['steps_per_epoch']}"
                        ),
                    ]
                )
    out += [
        (
            "p",
            "DistributedSampler (R1.5) gives each rank ceil(n / world size) indices; the padding "
            "(shard x world size - n) repeats the first indices, one each on the last ranks. Training "
            "batches drop the short last one (drop_last); validation leaves the repeats out of its sums. "
            + (
                "For accel_train.py's DataLoader path there is no DistributedSampler: Accelerate's prepare() (A1.5) "
                "deals the shuffled loader's batches out in rounds, rank r taking batches r, r + W, ... "
                "(training drops the short batch and a last incomplete round; validation completes it with "
                "repeats that gather_for_metrics leaves out). "
                if accelerate
                else ""
            )
            + "From each header's image counts and per-process batch:",
        ),
        (
            "table",
            ["run", "split", "images", "ranks", "per rank", "padding", "ranks holding a repeat", "steps per epoch"],
            rows,
        ),
        ("p", "The sampler and its new shuffle each epoch (R1.6):"),
        code_block(
            [
                f"{n}: {line.strip()}"
                for n, line in enumerate(RAW_DDP.read_text(encoding="utf-8").splitlines(), 1)
                if "= DistributedSampler(" in line
            ]
            + code_lines("R1.6")
        ),
        explain("partitioning"),
        ("h", "Demonstrate 3: gradient synchronisation"),
    ]
    rows = []
    for r in runs:
        sent = gradient_bytes(r)
        if sent is None or r.world_size == 1:
            continue
        comm = [e["comm_estimate"] for e in r.epochs if _is_number(e.get("comm_estimate"))]
        epoch = sum(e["epoch_time"] for e in r.epochs) / len(r.epochs) if r.epochs else None
        measured = (
            f"{sum(comm) / len(comm):.3f} s/epoch ({100 * sum(comm) / len(comm) / epoch:.1f}% of the epoch)"
            if comm and epoch
            else "not measured (run with --profile)"
        )
        rows.append(
            [
                r.label,
                r.header["model_parameters"],
                "bf16" if r.recipe.get("grad_compression") == "bf16" else "fp32",
                f"{sent[0] / MIB:.1f} MiB",
                f"~{sent[1]}",
                f"{2 * (r.world_size - 1) / r.world_size * sent[0] / MIB:.1f} MiB",
                measured,
            ]
        )
    out += [
        (
            "p",
            "DDP (R1.8) all-reduces every gradient once per step, in buckets, overlapped with backward. "
            "Bytes = parameters x 4 (gradients in the parameters' fp32, also under bf16 autocast; half with "
            f"grad_compression bf16). Buckets: an estimate from DDP's default caps ({FIRST_BUCKET_MB} MiB "
            f"first, then {BUCKET_CAP_MB} MiB). A ring all-reduce sends 2(N-1)/N of the bytes per rank. "
            "The measured cost is --profile's all-reduce estimate (the last batch's backward with and "
            "without synchronisation, times the steps).",
        ),
        (
            "table",
            [
                "run",
                "parameters",
                "gradients",
                "all-reduced per step",
                "buckets",
                "sent per rank (ring)",
                "measured all-reduce",
            ],
            rows,
        )
        if rows
        else ("p", "_No run with more than one process._"),
        code_block(statement_lines("= DDP(")),
        explain("gradient_sync"),
        ("h", "Demonstrate 4: aggregating metrics across ranks"),
        (
            "p",
            "The R1.9 lines of raw_ddp.py as they stand: images/sec is a SUM over the ranks (dist.reduce to "
            "rank 0), validation loss and accuracy an AVG (all_reduce of sums and counts).",
        ),
        code_block(code_lines("R1.9")),
        (
            "table",
            [
                "run",
                "last epoch",
                "images/sec (SUM over ranks)",
                "per rank (SUM / N)",
                "val loss (AVG)",
                "val accuracy (AVG)",
            ],
            [
                [
                    r.label,
                    r.epochs[-1]["epoch"],
                    fmt(r.epochs[-1]["images_per_sec"], 1),
                    fmt(r.epochs[-1]["images_per_sec"] / r.world_size, 1),
                    fmt(r.epochs[-1]["val_loss"], 4),
                    fmt(r.epochs[-1]["val_accuracy"], 4),
                ]
                for r in runs
                if r.epochs
            ],
        ),
        explain("aggregation"),
        ("h", "Demonstrate 5: 1 vs N processes, Amdahl's law and the bottleneck"),
        (
            "p",
            "The scaling table is above (Scaling), computed only between comparable runs; the time profile "
            "(with --profile) shows where an epoch's time goes.",
        ),
        explain("scaling"),
        ("h", "Demonstrate 6: optimisations"),
    ]
    run = main_run(runs)
    changes = optimisations(run)
    out += [
        (
            "p",
            f"The recipe keys where `{run.label}`'s recipe differs from recipes/baseline.yaml in what it computes:"
            if changes
            else f"None: `{run.label}` trained with the baseline recipe, unchanged.",
        ),
    ]
    if changes:
        out.append(
            (
                "table",
                ["recipe key", "baseline", "used", "why"],
                [[key, base, used, slot(notes, "optimisations", key, "why")] for key, base, used in changes],
            )
        )
    other = [c for c in recipe_changes(run) if c not in changes]
    if other:
        out.append(
            (
                "p",
                "Not optimisations (they set how long the run goes, when it stops or its random seed, not what "
                "it computes): " + "; ".join(f"{key} {base} -> {used}" for key, base, used in other) + ".",
            )
        )
    for before, after in compare:
        out += compare_blocks(before, after)
    if not compare:
        out.append(
            (
                "p",
                "**Before/after:** [you measure: pass the logs of a run without and with the change, "
                "`--compare BEFORE.jsonl AFTER.jsonl`]",
            )
        )
    return out + [explain("optimisations")]


def compare_blocks(before: Run, after: Run) -> list[tuple]:
    """A before/after table from two of the student's logs, and what else than the recipe differs."""
    keys = [
        k
        for k in sorted(set(full_recipe(before.recipe)) | set(full_recipe(after.recipe)))
        if full_recipe(before.recipe).get(k) != full_recipe(after.recipe).get(k)
    ]
    measure = lambda r: [
        fmt(time_to_target(r.epochs, *r.rules), missing="not reached"),
        fmt(mean_images_per_sec(r.epochs), 1),
        fmt(r.epochs[-1]["val_accuracy"], 4) if r.epochs else "–",
        len(r.epochs),
    ]
    other = [d for d in differences([before, after]) if not d.startswith("recipe")]
    if before.world_size != after.world_size:
        other.append(f"world size ({before.world_size} vs {after.world_size})")
    head = ["", "recipe change", "Cumulative Time to target (s)", "mean images/sec", "final val accuracy", "epochs"]
    change = (
        "; ".join(
            f"{k}: {json.dumps(full_recipe(before.recipe).get(k))} -> {json.dumps(full_recipe(after.recipe).get(k))}"
            for k in keys
        )
        or "none"
    )
    return [
        (
            "p",
            f"**Before/after** (`--compare {before.path} {after.path}`)"
            + (f"; **not like for like: they also differ in {'; '.join(other)}**" if other else "")
            + ":",
        ),
        (
            "table",
            head,
            [[f"before: {before.label}", change, *measure(before)], [f"after: {after.label}", "", *measure(after)]],
        ),
    ]


def blocks_markdown(blocks: list[tuple]) -> list[str]:
    out = []
    for block in blocks:
        if block[0] == "h":
            out += [f"## {block[1]}", ""]
        elif block[0] == "p":
            out += [block[1], ""]
        elif block[0] == "table":
            out += [md_table(block[1], block[2]), ""]
        else:
            out += ["```"] + block[1] + ["```", ""]
    return out


def where_text(name: str, numbers: list[int]) -> str:
    """'raw_ddp.py:86,88,89': the file and the lines of one step, with no spaces (one token to grep)."""
    return f"{name}:" + ",".join(map(str, numbers))


def steps_table(notes: dict) -> tuple[list[str], list[list]]:
    """Section 1: each R1 step's lines in the shipped raw_ddp.py, and the student's why (a slot)."""
    try:
        steps = ddp_steps()
    except OSError as exc:
        raise UserError(
            f"cannot read the raw_ddp.py whose step lines the report cites ({exc.strerror or exc}); "
            f"run it from a checkout of the project"
        ) from None
    return ["step", "where", "why"], [
        [step, where_text("raw_ddp.py", lines), slot(notes, "steps", step, f"why {step} is needed")]
        for step, lines in steps
    ]


def pdf_content(runs: list[Run], notes: dict, compare: list) -> SimpleNamespace:
    """Every text and table the PDF shows, computed here so that report/pdf.py only lays them out (and
    imports nothing of this module: no import circle)."""
    from ..runlog import git_commit

    run = main_run(runs)
    sc = scaling(runs)
    head, rows = scaling_table(sc)
    return SimpleNamespace(
        runs=runs,
        run=run,
        featured=featured_text(runs) or f"The run shown in sections 2 and 4: `{run.label}`.",
        printed=printed_lines(run),
        criterion=criterion_text(run),
        steps=steps_table(notes)[1],
        commit=short_commit(git_commit()),
        run_commit=short_commit(run.header.get("git_commit", "not logged")),
        resumed=resume_text(run) if run.resumes else "",
        scaling_head=head,
        scaling_rows=rows,
        scaling_basis=bool(sc.basis),
        scaling_notes=scaling_section(sc, runs),
        demonstrate=demonstrate(runs, sc, notes, compare),
    )


NOTES_HELP = "steps: {R1.<n>: why}, explain: {" + ", ".join(EXPLAIN) + "}, optimisations: {recipe key: why}"


def read_notes(path, runs: list[Run]) -> dict[str, dict[str, str]]:
    """The student's own words (docs/report-example/notes.yaml shows the form): each entry fills one slot;
    what is left out stays a [you write: ...] slot."""
    import yaml

    if path is None:
        return {}
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--notes {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except yaml.YAMLError as exc:  # its message spans lines: keep where and what
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(
            f"--notes {path}: cannot be read as YAML{where} ({getattr(exc, 'problem', None) or 'not YAML'})"
        ) from None
    allowed = {
        "steps": [step for step, _ in ddp_steps()],
        "explain": list(EXPLAIN),
        "optimisations": [key for key, _, _ in optimisations(main_run(runs))],
    }
    if not isinstance(raw, dict) or not set(raw) <= set(allowed):
        raise UserError(f"--notes {path}: expected {NOTES_HELP}")
    for section, entries in raw.items():
        if not isinstance(entries, dict):
            raise UserError(f"--notes {path}: {section}: expected KEY: TEXT entries")
        for key, text in entries.items():
            if key not in allowed[section]:
                raise UserError(
                    f"--notes {path}: {section}: {key!r} is not one of "
                    f"{', '.join(allowed[section]) or 'none (the run used the baseline recipe)'}"
                )
            if not isinstance(text, str) or not text.strip():
                raise UserError(f"--notes {path}: {section}: {key}: expected your text")
    return {section: {key: " ".join(text.split()) for key, text in entries.items()} for section, entries in raw.items()}


def _standing(run: Run, runs: list[Run]) -> tuple[bool, bool, bool]:
    """What makes a run the one to feature: 2 processes, a comparable 1-process run among `runs` (the pair
    the scaling table compares), the criterion met."""
    paired = run.world_size > 1 and any(s.world_size == 1 and not differences([s, run]) for s in runs)
    return run.world_size == 2, paired, time_to_target(run.epochs, *run.rules) is not None


def main_run(runs: list[Run]) -> Run:
    """The run whose epoch log and recipe the report features: a 2-process run with a comparable 1-process
    run, one that met the criterion, then the most processes and epochs; the same whatever the order of the
    logs on the command line (the last tie goes to the path's name)."""
    order = lambda r: (_standing(r, runs), r.world_size if r.world_size != 2 else 0, len(r.epochs))
    best = max(order(r) for r in runs)
    return min((r for r in runs if order(r) == best), key=lambda r: str(r.path))


def featured_text(runs: list[Run]) -> str:
    """Which run the report features and why, and why not each other 2-process run (empty with one run)."""
    run = main_run(runs)
    if len(runs) == 1:
        return ""
    _, paired, met = _standing(run, runs)
    why = [f"{run.world_size} process{'es' if run.world_size > 1 else ''}"]
    why += ["compared with a 1-process run of the same recipe, data, model and device"] if paired else []
    why += ["met the criterion"] if met else ["did not meet the criterion"]
    others = []
    for other in runs:
        if other is run or other.world_size != run.world_size:
            continue
        _, other_paired, other_met = _standing(other, runs)
        if paired and not other_paired:
            others.append(f"`{other.label}` (no comparable 1-process run)")
        elif met and not other_met:
            others.append(f"`{other.label}` (did not meet the criterion)")
        elif len(other.epochs) < len(run.epochs):
            others.append(f"`{other.label}` (fewer epochs)")
        else:
            others.append(f"`{other.label}` (equal standing: the first by path)")
    return (
        f"The featured run (its epoch log and Demonstrate 6): `{run.label}`: {', '.join(why)}"
        + (f"; chosen over {', '.join(others)}" if others else "")
        + "."
    )


def printed_lines(run: Run) -> list[str]:
    """What rank 0 printed, line for line from the log: each epoch's line and the final line (the trainers'
    own functions, cifar_wrn/runlog.py), or none when the log ends before the run did."""
    from types import SimpleNamespace

    from ..runlog import Progress, epoch_line, final_line

    lines = [epoch_line(e) for e in run.epochs]
    stop = stopping_epoch([e["val_accuracy"] for e in run.epochs], *run.rules)
    stopped = stop is not None and stop == len(run.epochs) - 1
    budget = run.recipe.get("epochs")
    ended = run.epochs and "safety_net" not in run.epochs[-1]  # the net fired there: the run went on
    if stopped or (isinstance(budget, int) and ended and run.epochs[-1]["epoch"] >= budget):
        recipe = SimpleNamespace(
            target_accuracy=run.target,
            patience=run.patience,
            epochs=budget,
            extra_epochs=run.recipe.get("extra_epochs", 0),
        )  # logs from before the safety net: 0
        lines.append(final_line(Progress(epoch=run.epochs[-1]["epoch"]), recipe, stopped))
    return lines


def criterion_text(run: Run) -> str:
    """The Cumulative Time at which the stopping criterion was first met, in words."""
    stop = stopping_epoch([e["val_accuracy"] for e in run.epochs], *run.rules)
    rule = f"validation accuracy >= {run.target} for {run.patience} epoch(s) in a row"
    if stop is None:
        return f"Not met: {rule} did not happen in the {len(run.epochs)} epoch(s) of this log."
    return (
        f"Cumulative Time at the criterion: {run.epochs[stop]['cumulative_time']:.3f} s, after epoch "
        f"{run.epochs[stop]['epoch']} ({rule})."
    )


# How long a run goes and when it stops, not what it computes: listed apart from the optimisations.
RUN_LENGTH = ("epochs", "extra_epochs", "target_accuracy", "patience", "seed")


def recipe_changes(run: Run) -> list[tuple[str, str, str]]:
    """(recipe key, baseline value, value used) for each key where the run's recipe differs from
    recipes/baseline.yaml; a key the header lacks had its default (an older trainer)."""
    from ..recipe import as_dict, load_recipe

    baseline = as_dict(load_recipe("baseline"))
    used = full_recipe(run.recipe)
    show = lambda value: value if isinstance(value, str) else json.dumps(value)  # true/false as in YAML
    return [
        (key, show(baseline[key]) if key in baseline else "(not a key of this code)", show(used[key]))
        for key in used
        if baseline.get(key, object()) != used[key]
    ]


def optimisations(run: Run) -> list[tuple[str, str, str]]:
    """The recipe changes that change the training computation; `epochs` among them only where it sets a
    schedule (under a constant one it only caps the run). The start-up warm-up's row names its cost."""
    schedule = full_recipe(run.recipe).get("lr_schedule") != "constant"
    seconds = run.header.get("startup_seconds")
    return [
        (
            key,
            base,
            f"{used} ({seconds:.1f} s of warm-up, before the clock)" if key == "startup_steps" and seconds else used,
        )
        for key, base, used in recipe_changes(run)
        if key not in RUN_LENGTH or (key == "epochs" and schedule)
    ]


# ============================================================================ figures


def load_matplotlib():
    """(Figure, FigureCanvasAgg), or None when matplotlib is not installed. The Agg canvas is attached to
    each figure directly: no pyplot, no global backend, nothing shown on a screen."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _save(mpl, fig, path: Path) -> Path:
    mpl[1](fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _legend_name(run: Run) -> str:
    return f"{run.label} ({run.num_nodes}x{run.num_gpus})"


def plot_accuracy(mpl, runs: list[Run], path: Path) -> Path:
    fig = mpl[0](figsize=(7, 4.5))
    ax = fig.add_subplot()
    for run in runs:
        xs = [e["cumulative_time"] for e in run.epochs]
        (line,) = ax.plot(xs, [e["val_accuracy"] for e in run.epochs], marker="o", ms=3, label=_legend_name(run))
        stop = stopping_epoch([e["val_accuracy"] for e in run.epochs], *run.rules)
        if stop is not None:
            ax.plot(
                [xs[stop]],
                [run.epochs[stop]["val_accuracy"]],
                marker="*",
                ms=14,
                color=line.get_color(),
                linestyle="none",
            )
    for target in sorted({r.target for r in runs}):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    times = [e["cumulative_time"] for r in runs for e in r.epochs if e["cumulative_time"] > 0]
    if times and max(times) > 100 * min(times):  # e.g. a GPU run and a CPU run: on a linear axis one is a dot
        ax.set_xscale("log")
        ax.set_xlabel("Cumulative Time (s, training only; log scale)")
    else:
        ax.set_xlim(left=0)
        ax.set_xlabel("Cumulative Time (s, training only)")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Validation accuracy against training time (* = stopping criterion met)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(mpl, fig, path)


def plot_throughput(mpl, runs: list[Run], path: Path) -> Path:
    fig = mpl[0](figsize=(7, 4.5))
    ax = fig.add_subplot()
    for run in runs:
        ax.plot(
            [e["epoch"] for e in run.epochs],
            [e["images_per_sec"] for e in run.epochs],
            marker="o",
            ms=3,
            label=_legend_name(run),
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("images/sec (sum over processes)")
    ax.set_title("Training throughput per epoch")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(mpl, fig, path)


def plot_profile(mpl, runs: list[Run], path: Path) -> Path | None:
    profiled = [(r, profile_parts(r.epochs)) for r in runs]
    profiled = [(r, parts) for r, parts in profiled if parts]
    if not profiled:
        return None
    keys = []
    for _, parts in profiled:
        keys += [k for k in parts if k not in keys]
    fig = mpl[0](figsize=(max(5, 1.3 * len(profiled) + 3), 4.5))
    ax = fig.add_subplot()
    x = list(range(len(profiled)))
    bottom = [0.0] * len(profiled)
    for key in keys:
        heights = [parts.get(key, 0.0) for _, parts in profiled]
        ax.bar(x, heights, bottom=bottom, label=key, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(x, [_legend_name(r) for r, _ in profiled], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per epoch (mean)")
    ax.set_title("Where an epoch's time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(mpl, fig, path)


def plot_topology(mpl, num_nodes: int, num_gpus: int, backend: str, device: str, path: Path) -> Path:
    """Nodes as boxes, one box per process inside with its local and global rank, and the ring drawn
    simply as arrows 0 -> 1 -> ... -> world_size-1 -> 0 (red where an arrow crosses between nodes)."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    from matplotlib.path import Path as MplPath

    world = num_nodes * num_gpus
    w, h, gap, pad, node_gap = 1.6, 1.0, 0.7, 0.45, 0.9  # process box, gaps, padding inside a node
    title_h = 0.35  # room for the node's name
    node_w = max(num_gpus * w + (num_gpus - 1) * gap + 2 * pad, 3.2)  # at least as wide as its name
    node_h = h + 2 * pad + title_h
    margin = 0.5  # room around the nodes for the closing arrow
    fig = mpl[0](figsize=(max(4.5, 0.9 * (node_w + 2 * margin)), 0.9 * (num_nodes * (node_h + node_gap)) + 0.8))
    ax = fig.add_subplot()
    ax.set_aspect("equal")
    ax.axis("off")
    box = {}  # rank -> (x0, y0) of its box
    for node in range(num_nodes):
        y0 = -node * (node_h + node_gap)
        ax.add_patch(
            FancyBboxPatch(
                (0, y0),
                node_w,
                node_h,
                boxstyle="round,pad=0.02,rounding_size=0.15",
                facecolor="#eef3fa",
                edgecolor="#35597f",
                linewidth=1.5,
            )
        )
        ax.text(
            pad,
            y0 + node_h - 0.25,
            f"node {node}" + (" (MASTER_ADDR)" if node == 0 else ""),
            ha="left",
            va="center",
            fontsize=9,
            fontweight="bold",
            color="#35597f",
        )
        for local in range(num_gpus):
            rank = global_rank(node, num_gpus, local)
            x0 = (node_w - num_gpus * w - (num_gpus - 1) * gap) / 2 + local * (w + gap)  # centred in the node
            ax.add_patch(
                FancyBboxPatch(
                    (x0, y0 + pad),
                    w,
                    h,
                    boxstyle="round,pad=0.02,rounding_size=0.08",
                    facecolor="#ffe9b3" if rank == 0 else "white",
                    edgecolor="black",
                )
            )
            where = f"cuda:{local}" if device == "cuda" else "CPU process"
            ax.text(
                x0 + w / 2,
                y0 + pad + h / 2,
                f"rank {rank}\nlocal_rank {local}\n{where}",
                ha="center",
                va="center",
                fontsize=8,
            )
            box[rank] = (x0, y0 + pad)

    def arrow(points, between):
        ax.add_patch(
            FancyArrowPatch(
                path=MplPath(points),
                arrowstyle="-|>",
                mutation_scale=12,
                linewidth=1.4,
                color="#c0392b" if between else "#2c7a3f",
                zorder=3,
            )
        )

    for rank in range(world if world > 1 else 0):
        nxt = (rank + 1) % world
        (x1, y1), (x2, y2) = box[rank], box[nxt]
        between = rank // num_gpus != nxt // num_gpus
        if world == 2 and num_gpus == 2:  # one node, two processes: two parallel arrows
            dy = 0.2 * h if nxt == 1 else -0.2 * h
            arrow(
                [(x1 + (w if nxt == 1 else 0), y1 + h / 2 + dy), (x2 + (0 if nxt == 1 else w), y2 + h / 2 + dy)], False
            )
        elif nxt == rank + 1 and not between:  # the next box in the same node
            arrow([(x1 + w, y1 + h / 2), (x2, y2 + h / 2)], False)
        elif nxt == rank + 1:  # last process of a node -> first of the next node
            arrow(
                [
                    (x1 + w / 2, y1),
                    (x1 + w / 2, y1 - pad - node_gap / 2),
                    (x2 + w / 2, y1 - pad - node_gap / 2),
                    (x2 + w / 2, y2 + h),
                ],
                True,
            )
        elif num_nodes == 1:  # close the ring under the row of one node
            low = y1 - pad / 2
            arrow([(x1 + w / 2, y1), (x1 + w / 2, low), (x2 + w / 2, low), (x2 + w / 2, y2)], False)
        else:  # close the ring around the nodes: right, top, left
            right, top, left = node_w + margin / 2, node_h + margin / 2, -margin / 2
            arrow(
                [
                    (x1 + w, y1 + h / 2),
                    (right, y1 + h / 2),
                    (right, top),
                    (left, top),
                    (left, y2 + h / 2),
                    (x2, y2 + h / 2),
                ],
                True,
            )
    ax.set_xlim(-margin, node_w + margin)
    ax.set_ylim(-(num_nodes - 1) * (node_h + node_gap) - 0.2, node_h + margin)
    if world == 1:
        ring = "one process: no all-reduce"
    elif world <= 8:
        ring = "ring all-reduce drawn simply: " + " → ".join(str(r) for r in [*range(world), 0])
    else:
        ring = f"ring all-reduce drawn simply: 0 → 1 → … → {world - 1} → 0"
    ax.set_title(
        f"{num_nodes} node(s) × {num_gpus} per node = world size {world}, {backend} on {device}\n{ring}\n"
        "global rank = node_id × num_gpus + local_rank" + ("; red: between nodes" if num_nodes > 1 else ""),
        fontsize=9,
    )
    return _save(mpl, fig, path)


# ============================================================================ the report


def topology_name(config: tuple) -> str:
    nodes, gpus, backend, device = config
    return f"topology_{nodes}x{gpus}_{safe_name(str(backend))}_{safe_name(str(device))}.png"


def write_report(
    runs: list[Run], out_dir, figures: bool = True, notes: dict | None = None, compare: list[tuple[Run, Run]] = ()
) -> tuple[Path, list[Path], str | None]:
    """Write out_dir/report.md (and the PNGs). Returns (report path, figure paths, why figures were skipped)."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot create the folder ({exc.strerror or exc})") from None
    label_runs(runs)
    for pair in compare:  # named apart from the reported runs: a before/after may be one of them
        label_runs(list(pair))
    notes = notes or {}
    sc = scaling(runs)
    mpl = load_matplotlib() if figures else None
    skipped = None if mpl else (f"matplotlib is missing ({INSTALL_HINT})" if figures else "--no-figures was given")

    written: list[Path] = []
    topology_png: dict[tuple, Path] = {}
    if mpl:
        with_epochs = [r for r in runs if r.epochs]
        if with_epochs:
            written.append(plot_accuracy(mpl, with_epochs, out_dir / "accuracy_vs_time.png"))
            written.append(plot_throughput(mpl, with_epochs, out_dir / "images_per_sec.png"))
        profile_png = plot_profile(mpl, runs, out_dir / "profile.png")
        if profile_png:
            written.append(profile_png)
        for run in runs:
            if run.config not in topology_png:
                nodes, gpus, backend, device = run.config
                topology_png[run.config] = plot_topology(
                    mpl, nodes, gpus, str(backend), str(device), out_dir / topology_name(run.config)
                )
                written.append(topology_png[run.config])

    lines = [
        "# Training report",
        "",
        f"{len(runs)} run(s): " + ", ".join(f"`{r.label}` ({r.path})" for r in runs) + ".",
        "",
    ]
    if len(runs) > 1:
        lines += [featured_text(runs), ""]
    if mpl:
        lines += [
            "Figures: [accuracy against time](accuracy_vs_time.png), [images/sec](images_per_sec.png)"
            + (", [time profile](profile.png)" if (out_dir / "profile.png") in written else "")
            + ", and a topology diagram per configuration (in each run's section).",
            "",
        ]
    else:
        lines += [f"**Figures skipped: {skipped}.** The tables and the text topology below are complete.", ""]
    lines += [
        "Text marked `[you write: ...]` is yours to write (or give it with `--notes notes.yaml`): this report "
        "states facts from the logs and the code, never the explanations.",
        "",
        "## The DDP steps (R1) in raw_ddp.py",
        "",
        "The line numbers of each `# R1.<n>` tag in the raw_ddp.py next to this report (they move with the code).",
        "",
        md_table(*steps_table(notes)),
        "",
    ]
    lines += scaling_section(sc, runs)
    if mpl and any(r.epochs for r in runs):
        lines += [
            "![validation accuracy against Cumulative Time](accuracy_vs_time.png)",
            "",
            "![images/sec per epoch](images_per_sec.png)",
            "",
        ]
    profile = profile_section(runs)
    if profile:
        lines += profile
        if mpl:
            lines += ["![time profile per run](profile.png)", ""]
    lines += blocks_markdown(demonstrate(runs, sc, notes, list(compare)))
    lines += ["## Runs", ""]
    for run in runs:
        lines += [
            f"### {run.label}",
            "",
            f"Log: `{run.path}`",
            "",
            md_table(["", ""], header_facts(run)),
            "",
            "Process topology:",
            "",
            "```",
            topology_text(*run.config),
            "```",
            "",
        ]
        if run.config in topology_png:
            lines += [f"![process topology of {md_cell(run.label)}]({topology_png[run.config].name})", ""]
        lines += [epoch_table(run), ""] + [f"- {note}" for note in run.notes] + ([""] if run.notes else [])
    report = out_dir / "report.md"
    try:
        report.write_text("\n".join(lines) + "\n")
    except OSError as exc:
        raise UserError(f"{report}: cannot write ({exc.strerror or exc})") from None
    return report, written, skipped


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m cifar_wrn.report",
        description="The course's report (R3, Demonstrate 1-6) from run logs: tables, scaling numbers and figures.",
    )
    p.add_argument(
        "logs",
        nargs="+",
        metavar="RUN",
        help="a run folder (runs/<name>/, holding the log.jsonl the "
        "trainers write) or a log file (--log-json PATH); one run each",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for report.md and the PNG figures")
    p.add_argument("--no-figures", action="store_true", help="tables only, even when matplotlib is installed")
    p.add_argument(
        "--pdf",
        metavar="FILE",
        help="also write the course's R3 report, at most 4 pages, to FILE (needs "
        "fpdf2, the extra `pdf`; the figures need matplotlib)",
    )
    p.add_argument(
        "--caption", metavar="TEXT", help="with --pdf: a line under the title (what the runs are, where they ran)"
    )
    p.add_argument(
        "--notes",
        metavar="NOTES.yaml",
        help=f"your own explanations for the report's slots ({NOTES_HELP})"
        "; docs/report-example/notes.yaml shows the form",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        action="append",
        default=[],
        metavar=("BEFORE", "AFTER"),
        help="an optimisation's before/after: your runs (folders or logs) without and with it (repeatable)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.caption and not args.pdf:
            raise UserError("--caption is for the PDF: give --pdf FILE too")
        if args.pdf:
            from .pdf import MAX_PAGES, load_fpdf, write_pdf

            load_fpdf()  # before any work: without fpdf2, one line saying how to install it
        runs = [read_run(path) for path in args.logs]
        compare = [(read_run(before), read_run(after)) for before, after in args.compare]
        notes = read_notes(args.notes, runs)
        report, figures, skipped = write_report(
            runs, args.out, figures=not args.no_figures, notes=notes, compare=compare
        )
        print(
            f"wrote {report}"
            + (f" and {len(figures)} figure(s)" if figures else "")
            + (f" (figures skipped: {skipped})" if skipped else "")
        )
        if args.pdf:
            shown = {
                "accuracy": report.parent / "accuracy_vs_time.png",
                "topology": report.parent / topology_name(main_run(runs).config),
            }
            pages = write_pdf(
                pdf_content(runs, notes, compare),
                args.pdf,
                {k: v for k, v in shown.items() if v in figures}
                | {"others": [f for f in figures if f not in shown.values()]},
                skipped,
                args.caption,
                "python -m cifar_wrn.report " + shlex.join(sys.argv[1:] if argv is None else map(str, argv)),
            )
            print(
                f"wrote {args.pdf} ({pages} page{'s' if pages > 1 else ''})"
                + (
                    f"; warning: more than the course's {MAX_PAGES}: report fewer runs at a time"
                    if pages > MAX_PAGES
                    else ""
                )
            )
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
