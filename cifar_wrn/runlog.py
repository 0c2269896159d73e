"""What a run records: the course's epoch line, and the JSON-lines log (header with the git commit, one record an
epoch)."""

import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from .stopping import Progress


def git_commit() -> str:
    describe = ["git", "describe", "--always", "--dirty", "--abbrev=64", "--exclude=*"]
    try:
        done = subprocess.run(describe, cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


class Field(NamedTuple):
    key: str
    label: str | None = None  # on the epoch line as `label = value`, formatted by `fmt`; None: in the log only
    fmt: str = ""
    tracked: bool = False  # a TensorBoard scalar (--with-tracking)
    required: bool = True  # in every epoch of a log the report reads


# The epoch record, defined once: the entry points' epoch_metrics fill it; the epoch line, the JSON log, TensorBoard,
# the checkpoint's history (stopping.Progress) and the report's readers (report/logs.py, report/textlog.py) follow.
EPOCH_RECORD = (
    Field("epoch", "Epoch", "2d"),
    Field("cumulative_time", "Cumulative Time", ".3f", tracked=True),
    Field("epoch_time", "Epoch Time", ".3f"),
    Field("images_per_sec", "Images/sec", ".1f", tracked=True),
    Field("train_accuracy", "Training Accuracy", ".3f", tracked=True, required=False),  # the course's first script
    Field("train_correct", required=False),  # did not count it
    Field("train_seen", required=False),
    Field("val_loss", "Validation Loss", ".3f", tracked=True),
    Field("val_accuracy", "Validation Accuracy", ".3f", tracked=True),
    Field("extra_epoch", required=False),  # stopping.Progress.end_epoch's, past the budget
    Field("safety_net", required=False),  # at the budget's end, training on
    Field("profile", required=False),  # --profile's (watch.Watch)
    Field("comm_estimate", required=False),
)
EPOCH_KEYS = {f.key for f in EPOCH_RECORD}


def versions(device) -> dict:
    """What a run's speed depends on: the software's versions and the chip (`device` on CUDA, else the CPU)."""
    import torchvision

    info = Path("/proc/cpuinfo")  # Linux: the CPU's model, where platform.processor() says "x86_64" or ""
    cpu = re.search(r"^model name\s*: (.+)", info.read_text(), re.M) if info.is_file() else None
    name = torch.cuda.get_device_name(device) if device else cpu[1] if cpu else platform.processor()
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    return dict(
        python_version=platform.python_version(),
        torchvision_version=torchvision.__version__,
        cuda_version=torch.version.cuda,
        cudnn_version=torch.backends.cudnn.version(),
        nccl_version=".".join(map(str, nccl)) if nccl else None,
        device_name=name or platform.machine(),
    )


def epoch_line(m: dict) -> str:
    """The course's line: `Epoch = n: Cumulative Time = ..., ...`, the labelled fields `m` holds."""
    (first, *rest), net = EPOCH_RECORD, m.get("safety_net")
    shown = ", ".join(f"{f.label} = {m[f.key]:{f.fmt}}" for f in rest if f.label and f.key in m)
    line = f"{first.label} = {m[first.key]:{first.fmt}}: {shown}"
    if not net:
        return line
    return (
        f"{line}\nSafety net: the target was met {net['streak']} of {net['patience']} epochs in a row when the "
        f"{net['budget']}-epoch budget ended; training on for up to {net['extra_epochs']} more epoch(s), "
        f"each at the learning rates of epoch {net['budget']} (recipe key extra_epochs)"
    )


def run_log_path(log_json, recipe_name: str, layout: str, prefix: str = "") -> str:
    """Not beside the checkpoints: their disk may fill."""
    if log_json:
        return log_json
    name = f"{prefix}{Path(recipe_name).stem}-{layout}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 100):  # runs started in the same second
        folder = Path(os.environ.get("RUNS_DIR") or "runs", name if n == 1 else f"{name}-{n}")
        try:
            folder.mkdir(parents=True)
            return str(folder / "log.jsonl")
        except FileExistsError:
            pass
    raise FileExistsError(f"no free run folder for {name}")


def open_run_log(run, progress: Progress, options, **launch) -> "JsonLog":
    """Rank 0's log (the others' writes go nowhere), its header written: the run's launch, sizes and recipe.
    `options`: cli.Logging."""
    from .model import ARCHITECTURE, COURSE_WIDTH, count_parameters

    recipe, layout = run.recipe, f"{launch['num_nodes']}x{launch['num_gpus']}"
    path = run_log_path(options.log_json, options.recipe_name, layout, options.folder_prefix) if run.is_main else None
    # a resume flag's run may start afresh on an earlier attempt's log: that run resumed at its start
    resumed = bool(progress.epoch or progress.step) or bool(path and os.path.isfile(path) and os.path.getsize(path))
    log = JsonLog(path)
    if path:
        print(f"Run log: {path}", flush=True)
    log.write(
        dict(
            kind="header",
            started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            hostname=platform.node(),
            git_commit=git_commit(),
            torch_version=torch.__version__,
            **versions(run.device if launch["device"] == "cuda" else None),
            world_size=run.world_size,
            **launch,
            per_device_batch_size=recipe.batch_size,
            global_batch_size=run.global_batch_size,
            lr=run.lr,
            **run.data.sizes(),
            model_width=run.model_width,
            architecture=ARCHITECTURE,
            model_parameters=count_parameters(run.raw_model),
            recipe=asdict(recipe),
            argv=sys.argv,
            resumed_at={"epoch": progress.epoch + 1, "step": progress.step} if resumed else None,
        )
    )
    if path and run.model_width != COURSE_WIDTH:
        print(f"note: --model-width {run.model_width} is not the course model (width {COURSE_WIDTH})", flush=True)
    return log


class JsonLog:
    """Flushed at once: a crash loses nothing written."""

    def __init__(self, path):
        self.file = open(path, "a") if path else None  # never truncated: a fresh run's is new or empty (cli.py)

    def write(self, record: dict):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        if self.file:
            self.file.close()


def read_log(path) -> tuple[dict, list[dict]]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    header = next((r for r in records if r.get("kind") == "header"), {})
    epochs = {r["epoch"]: r for r in records if r.get("kind") == "epoch"}  # a resume appends: the later record wins
    return header, [epochs[k] for k in sorted(epochs)]
