"""The course's printed lines, its stopping rule, and the JSON-lines log."""

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch


def git_commit() -> str:
    describe = ["git", "describe", "--always", "--dirty", "--abbrev=64", "--exclude=*"]
    try:
        done = subprocess.run(describe, cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


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


def criterion_met(accuracies: list, target: float, patience: int) -> bool:
    return trailing_streak(accuracies, target) >= patience


def rule_text(recipe: dict) -> str:
    """The stopping rule of a recipe (as_dict's, or a checkpoint's) in its keys' words."""
    return f"target_accuracy {recipe['target_accuracy']}, patience {recipe['patience']}"


def trailing_streak(accuracies: list, target: float) -> int:
    return next((n for n, accuracy in enumerate(reversed(accuracies)) if not accuracy >= target), len(accuracies))


@dataclass
class Progress:
    """What a checkpoint stores besides the weights, under the same keys."""

    epoch: int = 0  # next to run, 0-based
    step: int = 0  # of that epoch, already done
    epoch_time_so_far: float = 0.0
    cumulative_time: float = 0.0
    history: list = field(default_factory=list)
    streak: int = 0  # consecutive epochs at the target
    train_correct: int = 0  # this epoch's, all ranks'
    train_seen: int = 0

    @classmethod
    def of(cls, checkpoint: dict) -> "Progress":
        return cls(**{f.name: checkpoint[f.name] for f in fields(cls)})

    def as_dict(self) -> dict:
        return asdict(self)

    def mid_epoch(self, steps_done: int, seconds: float, **train_counts) -> "Progress":
        return replace(self, step=steps_done, epoch_time_so_far=seconds, **train_counts)

    @property
    def accuracies(self) -> list:
        return [m["val_accuracy"] for m in self.history]

    def end_epoch(self, metrics: dict, recipe) -> bool:
        """True when the rule holds."""
        self.history.append(metrics)
        # recounted from every logged accuracy: a resume may have changed target_accuracy or patience
        self.streak = trailing_streak(self.accuracies, recipe.target_accuracy)
        self.epoch, self.step, self.epoch_time_so_far = self.epoch + 1, 0, 0.0
        self.train_correct, self.train_seen = 0, 0
        if self.epoch > recipe.epochs:
            metrics["extra_epoch"] = self.epoch - recipe.epochs
        done = self.streak >= recipe.patience
        if not done and self.epoch == recipe.epochs and self.safety_net_open(recipe):
            metrics["safety_net"] = dict(
                budget=recipe.epochs, extra_epochs=recipe.extra_epochs, streak=self.streak, patience=recipe.patience
            )
        return done

    def safety_net_open(self, recipe) -> bool:
        left = recipe.epochs + recipe.extra_epochs - self.epoch
        return left > 0 and trailing_streak(self.accuracies, recipe.target_accuracy) + left >= recipe.patience

    def rule_holds(self, recipe) -> bool:
        return criterion_met(self.accuracies, recipe.target_accuracy, recipe.patience)

    def epochs_left(self, recipe) -> bool:
        return not self.rule_holds(recipe) and (self.epoch < recipe.epochs or self.safety_net_open(recipe))

    def epochs(self, recipe):
        while self.epochs_left(recipe):
            yield self.epoch


def final_line(progress: Progress, recipe) -> str:
    return final_text(progress.epoch if progress.rule_holds(recipe) else None, progress.epoch, recipe)


def final_text(stopped_at: int | None, epochs_run: int, recipe) -> str:
    extra = min((stopped_at or epochs_run) - recipe.epochs, recipe.extra_epochs)
    if stopped_at:
        note = f" ({extra} safety-net epoch(s) after the {recipe.epochs}-epoch budget)" if extra > 0 else ""
        return f"Early stopping after epoch {stopped_at}{note}"
    return (
        f"Target accuracy {recipe.target_accuracy} not reached {recipe.patience} epochs in a row within "
        f"{recipe.epochs} epochs" + (f" and {extra} safety-net epoch(s)" if extra > 0 else "")
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
    resumed = bool(progress.epoch or progress.step)
    log = JsonLog(path, append=resumed)
    if path:
        print(f"Run log: {path}", flush=True)
    log.write(
        dict(
            kind="header",
            started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            hostname=platform.node(),
            git_commit=git_commit(),
            torch_version=torch.__version__,
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

    def __init__(self, path, append: bool = False):
        self.file = open(path, "a" if append else "w") if path else None

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
