"""tqdm bars for the training steps and validation, on rank 0's stderr when `show`.

The loss is read only at the trainers' agreement steps, so the bar adds no device synchronisation.
"""

import sys
import weakref

from tqdm import tqdm

from .errors import before_report
from .resilience import CHECK_EVERY

# No monitor thread: a stray thread is unwelcome in processes that fork and handle signals.
tqdm.monitor_interval = 0

TRAIN_FORMAT = (
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {img_rate} img/s{postfix}]"
)

_open_bars: "weakref.WeakSet[tqdm]" = weakref.WeakSet()
DEFAULT_COLUMNS = 100  # for a terminal that reports no width (an unsized pty)


class _Bar(tqdm):
    """tqdm that draws DEFAULT_COLUMNS wide on a 0-column terminal, where tqdm draws nothing."""

    def _sized(self) -> None:
        if self.ncols is not None and self.ncols <= 0:
            self.ncols, self.nrows = DEFAULT_COLUMNS, None

    def display(self, msg=None, pos=None):
        self._sized()
        return super().display(msg, pos)

    @property
    def format_dict(self):
        fields = super().format_dict  # re-reads the terminal size
        self._sized()
        fields.update(ncols=self.ncols, nrows=self.nrows)
        return fields


class _TrainBar(_Bar):
    """tqdm with an {img_rate} field (steps/sec times images per step)."""

    def __init__(self, *args, images_per_step: int = 1, **kwargs):
        self.images_per_step = images_per_step  # before tqdm's __init__, which draws
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        fields = super().format_dict
        rate = fields.get("rate")
        if rate:
            images = rate * self.images_per_step
            fields["img_rate"] = f"{images:.1f}" if images < 100 else f"{images:,.0f}"
        else:
            fields["img_rate"] = "?"
        return fields


def _common(desc: str) -> dict:
    return dict(desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


class EpochBar:
    """The training steps of one epoch; with show=False every method does nothing."""

    def __init__(
        self,
        show: bool,
        epoch: int,
        steps_per_epoch: int,
        start_step: int = 0,
        images_per_step: int = 1,
        check_every: int = CHECK_EVERY,
    ):
        self.step_number = start_step
        self.steps_per_epoch, self.check_every = steps_per_epoch, check_every
        self._loss_sum, self._losses = None, 0
        self._bar = None
        if show:
            self._bar = _TrainBar(
                total=steps_per_epoch,
                initial=start_step,
                unit="step",
                bar_format=TRAIN_FORMAT,
                images_per_step=images_per_step,
                **_common(f"epoch {epoch}"),
            )
            _open_bars.add(self._bar)

    def step(self, loss) -> None:
        """After each optimizer step; reads the loss (.item()) only at the agreement steps."""
        if self._bar is None:
            return
        self.step_number += 1
        loss = loss.detach().float()
        self._loss_sum = loss.clone() if self._loss_sum is None else self._loss_sum.add_(loss)
        self._losses += 1
        self._bar.update(1)
        if self.step_number % self.check_every == 0 or self.step_number == self.steps_per_epoch:
            mean = self._loss_sum.item() / self._losses
            self._loss_sum, self._losses = None, 0
            self._bar.set_postfix_str(f"loss={mean:.3f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def validation_bar(show: bool, loader, desc: str = "validation"):
    """`loader`, or when `show` a tqdm over it."""
    if not show:
        return loader
    bar = _Bar(loader, unit="batch", **_common(desc))
    _open_bars.add(bar)
    return bar


@before_report
def close_all() -> None:
    """Erase every open bar, so that an error message starts on a clean line."""
    for bar in list(_open_bars):
        bar.close()
