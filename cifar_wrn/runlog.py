"""The course-style epoch line and the JSON-lines log (a header, then one object per epoch)."""

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The code's commit, with '-dirty' for local changes."""
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
    """The course's epoch line, then the safety net's note on a line of its own."""
    # logs from before training accuracy was counted lack it: their lines as they were printed
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


def criterion_met(accuracies: list, target: float, patience: int) -> bool:
    """The course's stopping rule: the last `patience` validation accuracies are all >= target."""
    return trailing_streak(accuracies, target) >= patience


def trailing_streak(accuracies: list, target: float) -> int:
    """How many of the last accuracies in a row are >= target: the one place the rule compares."""
    streak = 0
    for accuracy in reversed(accuracies):
        if not accuracy >= target:
            break
        streak += 1
    return streak


@dataclass
class Progress:
    """Where a run stands: what a checkpoint stores besides the weights, under the same keys."""

    epoch: int = 0  # next to run, 0-based
    step: int = 0  # of that epoch, already done
    epoch_time_so_far: float = 0.0
    cumulative_time: float = 0.0  # validation excluded
    history: list = field(default_factory=list)
    streak: int = 0  # consecutive epochs at the target, recounted from `history` under the recipe in force
    train_correct: int = 0  # this epoch's training images so far, every rank's: right, and seen
    train_seen: int = 0

    @classmethod
    def of(cls, checkpoint: dict) -> "Progress":
        """A checkpoint's progress; reading it checked that it has every field (cifar_wrn.checkpoint's KEYS)."""
        return cls(**{f.name: checkpoint[f.name] for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def mid_epoch(self, steps_done: int, seconds: float, train_correct: int, train_seen: int) -> "Progress":
        return dataclasses.replace(
            self, step=steps_done, epoch_time_so_far=seconds, train_correct=train_correct, train_seen=train_seen
        )

    def end_epoch(self, metrics: dict, recipe) -> bool:
        """Record a finished epoch; True when the target was met `patience` epochs in a row.
        Marks the safety net's epochs in `metrics`."""
        self.history.append(metrics)
        # recounted from every logged accuracy: a resume may have changed target_accuracy or patience
        accuracies = [m["val_accuracy"] for m in self.history]
        self.streak = trailing_streak(accuracies, recipe.target_accuracy)
        self.epoch, self.step, self.epoch_time_so_far = self.epoch + 1, 0, 0.0
        self.train_correct, self.train_seen = 0, 0
        if self.epoch > recipe.epochs:
            metrics["extra_epoch"] = self.epoch - recipe.epochs
        done = criterion_met(accuracies, recipe.target_accuracy, recipe.patience)
        if not done and self.epoch == recipe.epochs and self.safety_net_open(recipe):
            metrics["safety_net"] = {
                "budget": recipe.epochs,
                "extra_epochs": recipe.extra_epochs,
                "streak": self.streak,
                "patience": recipe.patience,
            }
        return done

    def safety_net_open(self, recipe) -> bool:
        """Can the target still be met `patience` epochs in a row within the extra epochs left?"""
        left = recipe.epochs + recipe.extra_epochs - self.epoch
        streak = trailing_streak([m["val_accuracy"] for m in self.history], recipe.target_accuracy)
        return left > 0 and streak + left >= recipe.patience

    def stopped_at(self, recipe) -> int | None:
        """The first epoch (1-based) after which the stopping rule in force held, or None."""
        accuracies = [m["val_accuracy"] for m in self.history]
        held = [
            n
            for n in range(1, len(accuracies) + 1)
            if criterion_met(accuracies[:n], recipe.target_accuracy, recipe.patience)
        ]
        return held[0] if held else None

    def epochs_left(self, recipe) -> bool:
        """Is there an epoch to train: the rule has not held yet (a resume may have changed it), and the budget,
        or the safety net, is open."""
        open_ = self.epoch < recipe.epochs or self.safety_net_open(recipe)
        return open_ and self.stopped_at(recipe) is None

    def epochs(self, recipe):
        """The epochs left: the budget's, then the safety net's while it is open; none once the rule held."""
        while self.epochs_left(recipe):
            yield self.epoch


def final_line(progress: Progress, recipe) -> str:
    """The course's last line: where the stopping rule held, or that it did not."""
    return final_text(progress.stopped_at(recipe), progress.epoch, recipe)


def final_text(stopped_at: int | None, epochs_run: int, recipe) -> str:
    extra = min((stopped_at or epochs_run) - recipe.epochs, recipe.extra_epochs)
    if stopped_at:
        note = f" ({extra} safety-net epoch(s) after the {recipe.epochs}-epoch budget)" if extra > 0 else ""
        return f"Early stopping after epoch {stopped_at}{note}"
    return (
        f"Target accuracy {recipe.target_accuracy} not reached {recipe.patience} epochs in a row within "
        f"{recipe.epochs} epochs" + (f" and {extra} safety-net epoch(s)" if extra > 0 else "")
    )


def run_header(**fields) -> dict:
    return {
        "kind": "header",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": platform.node(),
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        **fields,
    }


def run_log_path(log_json, recipe_name: str, layout: str, prefix: str = "") -> str:
    """--log-json, else a new folder under $RUNS_DIR (runs): not beside the checkpoints, whose disk may fill."""
    if log_json:
        return log_json
    name = f"{prefix}{Path(recipe_name).stem}-{layout}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 100):  # runs started in the same second
        folder = Path(os.environ.get("RUNS_DIR") or "runs", name if n == 1 else f"{name}-{n}")
        try:
            folder.mkdir(parents=True)
            return str(folder / "log.jsonl")
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run folder for {name}")


def open_run_log(args, recipe, run, progress: Progress, **launch) -> "JsonLog":
    """Rank 0's JSON log (appended to on a resume), opened with its header; `launch`: how the processes started."""
    from .model import ARCHITECTURE, COURSE_WIDTH, count_parameters

    layout, prefix = f"{launch['num_nodes']}x{launch['num_gpus']}", "accel-" if run.accelerator else ""
    path = run_log_path(args.log_json, args.recipe, layout, prefix) if run.is_main else None
    log = JsonLog(path, append=progress.epoch > 0 or progress.step > 0)
    if path:
        print(f"Run log: {path}", flush=True)
    log.write(
        run_header(
            world_size=run.world_size,
            **launch,
            per_device_batch_size=recipe.batch_size,
            global_batch_size=run.global_batch_size,
            lr=run.lr,
            steps_per_epoch=run.data.steps_per_epoch,
            train_images=len(run.data.train_set),
            val_images=run.data.val_images,
            model_width=run.model_width,
            architecture=ARCHITECTURE,
            model_parameters=count_parameters(run.raw_model),
            recipe=dataclasses.asdict(recipe),
            argv=sys.argv,
            resumed_at={"epoch": progress.epoch + 1, "step": progress.step}
            if progress.epoch or progress.step
            else None,
        )
    )
    if path and run.model_width != COURSE_WIDTH:
        print(f"note: --model-width {run.model_width} is not the course model (width {COURSE_WIDTH})", flush=True)
    return log


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
    epochs = {}  # a resumed run appends: the later record of an epoch wins
    for r in records:
        if r.get("kind") == "epoch":
            epochs[r["epoch"]] = r
    return header, [epochs[k] for k in sorted(epochs)]
