"""Reading run logs: the JSON-lines log of cifar_wrn/runlog.py (a header, then one object per epoch), checked,
as one Run however often it was resumed.

A log is one run: each `--auto-resume` appends a header with `resumed_at`, and the headers that a trainer
would have resumed as one run are read as its segments (epochs in order, Cumulative Time continuing).
Anything else in one file (another run's header) is refused, naming the line.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..runlog import EPOCH_RECORD

HEADER_FIELDS = ("world_size", "num_nodes", "num_gpus", "backend", "device")
EPOCH_FIELDS = tuple(f.key for f in EPOCH_RECORD if f.required)  # the trainers' epoch record: runlog.py
NUMBERS = tuple(f.key for f in EPOCH_RECORD if f.fmt and f.key != "epoch") + ("comm_estimate",)  # checked if present
HINT = "expected the JSON-lines log that raw_ddp.py / accel_train.py write with --log-json"
RUN_LOG = "log.jsonl"  # the trainers' log in a run folder: runs/<name>/log.jsonl
# The type of each header entry the report reads (beyond the counts _check_header checks): anything else is refused.
HEADER_TYPES = {
    **dict.fromkeys(("backend", "device", "hostname", "git_commit", "torch_version", "started_at"), str),
    **dict.fromkeys(("trainer", "launcher", "architecture"), str),
    **dict.fromkeys(("per_device_batch_size", "global_batch_size", "steps_per_epoch", "model_width"), int),
    **dict.fromkeys(("train_images", "val_images", "model_parameters"), int),
    **dict.fromkeys(("lr", "startup_seconds"), float),
}
# What an epoch record's numbers can be: accuracies are fractions, times, rates and losses are not negative.
FRACTIONS = ("val_accuracy", "train_accuracy")
TEXT_LOG = "train.log"  # a Slurm job's printed lines: runs/<job id>/train.log (textlog.py reads it)


class LogError(UserError):
    """A file that is missing, unreadable or not a run log."""


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
    def text_log(self) -> bool:
        """Read from printed lines (textlog.py): no recipe, model or data sizes."""
        return self.header.get("log_format") == "text"

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
    def accuracies(self) -> list[float]:
        return [e["val_accuracy"] for e in self.epochs]

    @property
    def config(self) -> tuple:
        return (self.num_nodes, self.num_gpus, self.header["backend"], self.header["device"])

    @property
    def resumes(self) -> list[Segment]:
        return self.segments[1:] if self.segments and self.segments[0].resumed_at is None else self.segments


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Keys that left the code (docs/record/optimizations.md, "Where the code went"), at the values that train as without
# them: older logs carry them.
RETIRED = {
    "anneal_epochs": 0.0,
    "residual_bn_init": 1.0,
    "crop_padding": 4,
    "tta_translate": 0,
    "lookahead_steps": 0,
    "lookahead_alpha": 0.5,
    "alternating_flip": False,
}


def full_recipe(recipe: dict) -> dict:
    """A header's recipe with the keys it lacks at their defaults (a key newer than the trainer that wrote the
    log had its default then: new keys default to the old behaviour), less the keys that left the code where
    they hold the value that left training unchanged."""
    from ..recipe import Recipe, as_dict  # torch, a dependency of the project anyway

    kept = {key: value for key, value in recipe.items() if key not in RETIRED or RETIRED[key] != value}
    return {**as_dict(Recipe()), **kept}


def read_text(path: Path, name: str = "", what: str = "a run log", error: type = LogError) -> str:
    """The text of `path`, or an `error` naming it (`name`: as the user gave it, the path by default) when it
    is missing, a folder, not text (not `what`) or unreadable."""
    name = name or str(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{name}: no such file") from None
    except IsADirectoryError:
        raise error(f"{name}: is a folder, not {what}") from None
    except UnicodeDecodeError:
        raise error(f"{name}: not {what} (not a text file)") from None
    except OSError as exc:
        raise error(f"{name}: cannot be read ({exc.strerror or exc})") from None


def _records(path: Path):
    """(line number, JSON object) of every non-blank line; a LogError names the file (and line)."""
    text = read_text(path)
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


def _check_value(where: str, what: str, value, fraction: bool = False) -> None:
    """A LogError unless `value` is a finite number, not negative (a fraction: in [0, 1])."""
    if not is_number(value) or not math.isfinite(value) or value < 0 or (fraction and value > 1):
        wanted = "a fraction in [0, 1]" if fraction else "a finite number >= 0"
        raise LogError(f"{where}: {what} must be {wanted} (got {value!r})")


def _check_types(where: str, record: dict) -> None:
    """Every header entry the report reads of the type the trainers write, its numbers finite."""
    for key, kind in HEADER_TYPES.items():
        value = record.get(key)
        if value is None:
            continue
        if not (is_number(value) if kind is float else isinstance(value, kind) and not isinstance(value, bool)):
            raise LogError(
                f"{where}: header {key} must be {'a number' if kind is float else kind.__name__}: got {value!r}"
            )
        if kind is not str:
            _check_value(where, f"header {key}", value)


def _check_header(where: str, record: dict) -> None:
    missing = [k for k in HEADER_FIELDS if k not in record]
    if missing:
        raise LogError(f"{where}: the header lacks {', '.join(missing)}")
    _check_types(where, record)
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
        or not is_number(recipe.get("target_accuracy"))
        or not isinstance(recipe.get("patience"), int)
    ):
        raise LogError(f"{where}: the header has no recipe with target_accuracy and patience")
    _check_value(where, "the recipe's target_accuracy", recipe["target_accuracy"], fraction=True)
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
    trainers' own rule for a resume (cifar_wrn/checkpoints.py resume_problem: the same world size, model,
    data and recipe, except the keys a resume may change), so the report reads as one run exactly what a
    trainer would have resumed as one. Keys one header lacks had their default (an older trainer)."""
    from ..checkpoints import resume_problem

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


def log_path(path) -> Path:
    """A run folder stands for the log.jsonl in it; a file is itself."""
    path = Path(path)
    if path.is_dir():
        if not (path / RUN_LOG).is_file():
            raise LogError(
                f"{path}: a folder without {RUN_LOG}: give a run log or a run folder that holds one (or {TEXT_LOG})"
            )
        return path / RUN_LOG
    return path


def _check_resume(where: str, segments: list[Segment], record: dict) -> None:
    """A later header must be a resume of the run the first one started."""
    start = segments[0]
    if record.get("resumed_at") is None:
        raise LogError(
            f"{where}: a second header without resumed_at: a new run starts here, not a "
            f"resume of the run of line {start.line}; one run per file"
        )
    problem = other_run(start.header, record)
    if problem:
        raise LogError(
            f"{where}: this header is not a resume of the run of line {start.line} ({problem}); one run per file"
        )


def _resume(segment: Segment, epochs: dict[int, dict], notes: list[str]) -> None:
    """Drop the epochs a resume trains again (its checkpoint was older than them) and note any gap."""
    resumed, number = segment.resumed_at["epoch"], segment.line
    redone = sorted(e for e in epochs if e >= resumed)
    for e in redone:
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


def _check_epoch(where: str, record: dict, epochs: dict[int, dict]) -> None:
    bad = [k for k in EPOCH_FIELDS if not is_number(record.get(k))]
    if bad:
        raise LogError(f"{where}: the epoch record lacks numeric {', '.join(bad)}")
    for key in NUMBERS:
        if key in record:
            _check_value(where, key, record[key], fraction=key in FRACTIONS)
    profile = record.get("profile")
    for key, value in profile.items() if isinstance(profile, dict) else ():
        if is_number(value):  # other entries are left alone (a newer trainer's)
            _check_value(where, f"profile {key}", value)
    if not isinstance(record["epoch"], int) or record["epoch"] < 1:
        raise LogError(f"{where}: the epoch record's epoch must be a whole number >= 1 (got {record['epoch']!r})")
    if epochs and record["epoch"] <= max(epochs):
        raise LogError(
            f"{where}: epoch {record['epoch']} after epoch {max(epochs)} with no resume "
            f"between them (two runs appended to one file?); one run per file"
        )


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
                _check_resume(where, segments, record)
            segment = Segment(number, record)
            if segment.resumed_at is not None:
                _resume(segment, epochs, notes)
            segments.append(segment)
        elif record.get("kind") == "epoch":
            if not segments:
                raise LogError(f"{where}: an epoch record before the header; {HINT}")
            _check_epoch(where, record, epochs)
            epochs[record["epoch"]] = dict(record, log_line=number)
        # other kinds of record (none today) are left alone: a newer trainer may add some
    if not segments:
        raise LogError(f"{path}: not a run log (no header record); {HINT}")
    return Run(path, segments[0].header, [epochs[e] for e in sorted(epochs)], segments=segments, notes=notes)


def label_runs(runs: list[Run]) -> None:
    """A short, unique name per run (the file name without .jsonl, the folder's for a run folder's log or a job's
    train.log), used in tables and figure names."""
    folder = lambda r: r.path.name in (RUN_LOG, TEXT_LOG) and r.path.parent.name
    names = [r.path.parent.name if folder(r) else r.path.stem for r in runs]
    for run, name in zip(runs, names):
        if names.count(name) > 1:
            name = f"{run.path.parent.name}/{name}" if run.path.parent.name else name
        run.label = name
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"
