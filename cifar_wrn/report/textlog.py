"""Reading a text log: rank 0's printed epoch lines, as course/cifar10.py and course/cifar10_ddp.py (and the
trainers) print them, with or without Training Accuracy: a Slurm job's runs/<job id>/train.log, or any file of
rank 0's output. One such file is one Run, like a JSON log.

What the lines cannot say comes from the job's banner in train.log (slurm/job.sh print_banner: world size,
nodes, device, hosts, git, torch) and the GPUs from topology.txt beside it; without a banner, the world size
from --world-size and the device from --device (named in the run's notes). A text log holds no recipe: the
stopping rule is taken as the course's (0.85 twice in a row, the scripts' defaults), the run compared only
with other text logs.
"""

import math
import re
from collections import Counter
from pathlib import Path

from ..runlog import EPOCH_RECORD
from .logs import FRACTIONS, RUN_LOG, TEXT_LOG, LogError, Run, _check_value, read_run, read_text

EPOCH = re.compile(r"\bEpoch = *(\d+): (.*)")
# as printed: the epoch record's key (runlog.EPOCH_RECORD's labelled fields, the epoch itself aside)
FIELDS = {f.label: f.key for f in EPOCH_RECORD[1:] if f.label}
OPTIONAL = {f.label for f in EPOCH_RECORD if not f.required}  # Training Accuracy: the course's first script
PRINTED = re.compile(r"(Early stopping|Target accuracy|Safety net)\b")  # the lines after an epoch's, kept as printed
JOB_START = re.compile(r"^=== \S+ \S+ job \S+ \(")  # print_banner's first line, "job ID (NAME): ": a (re)start
BANNER = {  # print_banner's lines: the header entries they give
    "world": re.compile(r"^world size: (\d+) = (\d+) node\(s\) x (\d+) process\(es\), device (\w+)"),
    "hostname": re.compile(r"^hosts: (\S+)"),
    "git_commit": re.compile(r"^repo: .*, git (\S+)$"),
    "torch_version": re.compile(r"^torch (\S+), CUDA"),
    "command": re.compile(r"^\+ (.+)$"),  # run_preemptable's echo of the command it runs
}
GPU = re.compile(r"^GPU \d+: (.+?) \(UUID")  # nvidia-smi -L, in topology.txt and the banner
COURSE_RULE = {"target_accuracy": 0.85, "patience": 2}  # the course's criterion, the course scripts' defaults
SAMPLE = "Epoch =  1: Cumulative Time = ..., Images/sec = ..., Validation Accuracy = ..."


def is_text_log(path) -> bool:
    """A folder with a train.log and no log.jsonl, or a file not named .json/.jsonl whose first line is not JSON
    ('{'). Anything unreadable is left to read_run, which names the problem."""
    path = Path(path)
    if path.is_dir():
        return (path / TEXT_LOG).is_file() and not (path / RUN_LOG).is_file()
    if path.suffix in (".json", ".jsonl"):
        return False
    try:
        with path.open(encoding="utf-8") as file:
            first = next((line for line in file if line.strip()), "")
    except (OSError, UnicodeDecodeError):
        return False
    return not first.lstrip().startswith(("{", "["))


def _number(where: str, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LogError(f"{where}: {name} = {text} is not a number") from None
    if not math.isfinite(value):
        raise LogError(f"{where}: {name} = {text} is not a finite number")
    return value


def epoch_record(where: str, number: str, rest: str) -> dict:
    """The epoch record of one printed line; a LogError names what is missing (a line cut short) or not a number."""
    printed = dict(re.findall(r"([A-Za-z][\w/ ]*?) = ([^,\s]+)", rest))
    missing = [name for name in FIELDS if name not in printed and name not in OPTIONAL]
    if missing:
        raise LogError(f"{where}: an epoch line without {', '.join(missing)} (cut short?); expected {SAMPLE}")
    record = {"epoch": int(number)}
    record.update({key: _number(where, name, printed[name]) for name, key in FIELDS.items() if name in printed})
    if record["epoch"] < 1:
        raise LogError(f"{where}: epoch {number}: epochs count from 1")
    for key in FIELDS.values():  # what a JSON log's epoch may hold, a printed one too (a percentage is refused)
        if key in record:
            _check_value(where, key, record[key], fraction=key in FRACTIONS)
    return record


def _banner_line(line: str, facts: dict) -> None:
    """Fill `facts` from one line of the job's banner (the first value of each wins: the job's start)."""
    for key, pattern in BANNER.items():
        found = pattern.match(line)
        if found and key not in facts:
            facts[key] = found.groups() if key == "world" else found.group(1)


def _add_epoch(where: str, record: dict, epochs: dict, restarted: bool, printed: list, notes: list) -> None:
    """Add an epoch's record; after a job restart, the epochs it prints again replace the earlier ones (and
    their printed lines)."""
    last = max(epochs, default=0)
    if record["epoch"] <= last:
        if not restarted:
            raise LogError(
                f"{where}: epoch {record['epoch']} after epoch {last} with no job restart between them (every "
                "rank printing, R1.10? or two runs in one file); one run per file"
            )
        since = epochs[record["epoch"]]["log_line"]
        printed[:] = [(n, line) for n, line in printed if n < since]
        for e in [e for e in epochs if e >= record["epoch"]]:
            del epochs[e]
        notes.append(f"{where}: the job restarted and printed epoch {record['epoch']} again: the later lines count")
    epochs[record["epoch"]] = record


def read_lines(path: Path, text: str) -> tuple[dict, list[dict], list[str], list[str]]:
    """(banner facts, epoch records in order, the printed lines R3 shows, notes) of a text log."""
    facts: dict = {}
    epochs: dict[int, dict] = {}
    printed: list[tuple[int, str]] = []  # (line number, as printed)
    notes: list[str] = []
    restarted = False
    for number, line in enumerate(text.splitlines(), 1):
        found = EPOCH.search(line)
        if found:
            record = dict(epoch_record(f"{path}, line {number}", *found.groups()), log_line=number)
            _add_epoch(f"{path}, line {number}", record, epochs, restarted, printed, notes)
            printed.append((number, line[found.start() :].rstrip()))
            restarted = False
        elif PRINTED.match(line.strip()):
            printed.append((number, line.strip()))
        elif JOB_START.match(line):  # a requeued job prints its banner again
            restarted = bool(epochs)
        else:
            _banner_line(line, facts)
    if not epochs:
        raise LogError(f"{path}: not a run log: no epoch line found; expected a JSON log or lines as {SAMPLE}")
    return facts, [epochs[e] for e in sorted(epochs)], [line for _, line in printed], notes


def hardware(path: Path, text: str) -> str:
    """'2 x NVIDIA A30' from topology.txt beside the log (or the banner's own copy in it), else not known."""
    beside = path.parent / "topology.txt"
    lines = (beside.read_text(encoding="utf-8", errors="replace") if beside.is_file() else text).splitlines()
    names = Counter(found.group(1) for found in map(GPU.match, lines) if found)
    if names:
        return ", ".join(f"{count} x {name}" for name, count in names.items())
    return "no GPU in its topology.txt" if beside.is_file() else "not known (no topology.txt beside the log)"


def parse_layout(text: str) -> tuple[int, int]:
    """(nodes, processes per node) of a --world-size value: N (1 node x N) or NODESxN."""
    found = re.fullmatch(r"(?:(\d+)x)?(\d+)", text.strip())
    nodes, gpus = (int(found.group(1) or 1), int(found.group(2))) if found else (0, 0)
    if nodes < 1 or gpus < 1:
        raise LogError(f"--world-size {text}: expected N (processes on 1 node) or NODESxN, e.g. 2 or 2x4")
    return nodes, gpus


def read_text_run(path, layouts: list[str], device: str = "cuda") -> Run:
    """A text log as a Run: its epochs, and a header from the job's banner, else from the first of `layouts`
    (--world-size, taken from the list) and `device` (--device); a LogError when neither gives the world size."""
    path = Path(path)
    path = path / TEXT_LOG if path.is_dir() else path
    text = read_text(path)
    facts, epochs, printed, notes = read_lines(path, text)
    if "world" in facts:
        _, nodes, gpus, device = facts.pop("world")
        nodes, gpus = int(nodes), int(gpus)
    elif layouts:
        layout = layouts.pop(0)
        nodes, gpus = parse_layout(layout)
        notes.append(f"world size {nodes * gpus} ({nodes} x {gpus}) from --world-size {layout}, device {device}")
    else:
        raise LogError(
            f"{path}: a text log without the job's banner (`world size: ...`): give its world size, "
            "--world-size N (or NODESxN), one per such log in the order given"
        )
    header = {
        "kind": "header",
        "log_format": "text",
        "world_size": nodes * gpus,
        "num_nodes": nodes,
        "num_gpus": gpus,
        "backend": "nccl" if device == "cuda" else "gloo",
        "device": device,
        "recipe": dict(COURSE_RULE),
        "architecture": "not logged (a text log)",
        "hardware": hardware(path, text),
        "printed_lines": printed,
        **facts,
    }
    notes.append(
        "a text log: no recipe, model or data sizes; the stopping rule taken as the course's (0.85 twice in a "
        f"row), the backend as {header['backend']} for {device}; compared only with other text logs"
    )
    return Run(path, header, epochs, notes=notes)


def read_runs(paths: list, layouts: list[str], device: str) -> list[Run]:
    """Each path as a Run: a text log or a JSON log. The --world-size values go, in order, to the text logs
    without a banner; a LogError when there are too few or too many."""
    left = list(layouts)
    runs = [read_text_run(path, left, device) if is_text_log(path) else read_run(path) for path in paths]
    if left:
        raise LogError(f"--world-size {' '.join(left)}: more values than text logs without a job banner")
    return runs
