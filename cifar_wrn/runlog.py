"""What a run writes: the course-style epoch line and a JSON-lines log (header, then one object per epoch)."""
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The commit the code came from, with '-dirty' when the working tree has changes."""
    try:
        run = lambda *cmd: subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=10)
        head = run("git", "rev-parse", "--verify", "HEAD")
        if head.returncode != 0:
            return "unknown"
        sha = head.stdout.strip()
        dirty = run("git", "status", "--porcelain", "--untracked-files=no").stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def epoch_line(m: dict) -> str:
    return (f"Epoch = {m['epoch']:2d}: Cumulative Time = {m['cumulative_time']:.3f}, "
            f"Epoch Time = {m['epoch_time']:.3f}, Images/sec = {m['images_per_sec']:.1f}, "
            f"Validation Loss = {m['val_loss']:.3f}, Validation Accuracy = {m['val_accuracy']:.3f}")


def run_header(**fields) -> dict:
    return {"kind": "header", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hostname": platform.node(),
            "git_commit": git_commit(), "torch_version": torch.__version__, **fields}


class JsonLog:
    """One JSON object per line, flushed at once, so a crash loses nothing already written."""

    def __init__(self, path, append: bool = False):
        self.file = open(path, "a" if append else "w") if path else None

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def read_log(path) -> tuple[dict, list[dict]]:
    """(header, epoch records) of a JSON-lines log."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    header = next((r for r in records if r.get("kind") == "header"), {})
    epochs = {}  # a resumed run appends: a repeated epoch number is the later (resumed) record
    for r in records:
        if r.get("kind") == "epoch":
            epochs[r["epoch"]] = r
    return header, [epochs[k] for k in sorted(epochs)]
