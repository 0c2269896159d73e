"""When training stops: the course's rule (target_accuracy reached `patience` epochs in a row, within `epochs`,
plus the safety net's extra_epochs), where a run stands (Progress, which a checkpoint stores), and the last line."""

from dataclasses import asdict, dataclass, field, fields, replace


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
        # counted from every logged accuracy: a resume may have changed target_accuracy or patience
        streak = trailing_streak(self.accuracies, recipe.target_accuracy)
        self.epoch, self.step, self.epoch_time_so_far = self.epoch + 1, 0, 0.0
        self.train_correct, self.train_seen = 0, 0
        if self.epoch > recipe.epochs:
            metrics["extra_epoch"] = self.epoch - recipe.epochs
        done = streak >= recipe.patience
        if not done and self.epoch == recipe.epochs and self.safety_net_open(recipe):
            metrics["safety_net"] = dict(
                budget=recipe.epochs, extra_epochs=recipe.extra_epochs, streak=streak, patience=recipe.patience
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
