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

import torch

from .stopping import Progress


def git_commit() -> str:
    describe = ["git", "describe", "--always", "--dirty", "--abbrev=64", "--exclude=*"]
    try:
        done = subprocess.run(describe, cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


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
    # the report reads logs from before training accuracy was counted
    train = f"Training Accuracy = {m['train_accuracy']:.3f}, " if "train_accuracy" in m else ""
    line = (
        f"Epoch = {m['epoch']:2d}: Cumulative Time = {m['cumulative_time']:.3f}, "
        f"Epoch Time = {m['epoch_time']:.3f}, Images/sec = {m['images_per_sec']:.1f}, "
        f"{train}Validation Loss = {m['val_loss']:.3f}, Validation Accuracy = {m['val_accuracy']:.3f}"
    )
    if "safety_net" not in m:
        return line
    net = m["safety_net"]
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


def open_run_log(run, progress: Progress, log_json: str | None, recipe_name: str, **launch) -> "JsonLog":
    """Rank 0's log (the others' writes go nowhere), its header written: the run's launch, sizes and recipe."""
    from .model import ARCHITECTURE, COURSE_WIDTH, count_parameters

    recipe, layout = run.recipe, f"{launch['num_nodes']}x{launch['num_gpus']}"
    path = run_log_path(log_json, recipe_name, layout, run.trainer.log_prefix) if run.is_main else None
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
