"""tqdm bars on rank 0's stderr; they read the loss only at the agreement steps: no device sync."""

import sys
import weakref

from tqdm import tqdm

from .errors import before_report
from .resilience import CHECK_EVERY

tqdm.monitor_interval = 0  # no thread: unwelcome in processes that fork and handle signals

_open_bars = weakref.WeakSet()
DEFAULT_COLUMNS = 100


class _Bar(tqdm):
    """On stderr, with {img_rate}; DEFAULT_COLUMNS wide where the terminal gives no width."""

    def __init__(self, *args, images_per_step: int = 1, **kwargs):
        self.images_per_step = images_per_step  # before tqdm's __init__, which draws
        super().__init__(*args, file=sys.stderr, leave=False, dynamic_ncols=True, **kwargs)
        _open_bars.add(self)

    def _sized(self):
        if self.ncols is not None and self.ncols <= 0:
            self.ncols, self.nrows = DEFAULT_COLUMNS, None

    def display(self, *args, **kwargs):
        self._sized()
        return super().display(*args, **kwargs)

    @property
    def format_dict(self):
        fields = super().format_dict  # re-reads the terminal size
        self._sized()
        images = (fields.get("rate") or 0) * self.images_per_step
        rate = "?" if not images else f"{images:.1f}" if images < 100 else f"{images:,.0f}"
        fields.update(ncols=self.ncols, nrows=self.nrows, img_rate=rate)
        return fields


class EpochBar:
    """One epoch's steps; with show=False and no `track` every method does nothing."""

    def __init__(self, show: bool, epoch: int, steps_per_epoch: int, start_step=0, images_per_step=1, track=None):
        self.step_number, self.steps_per_epoch, self.track = start_step, steps_per_epoch, track
        self.steps_before = (epoch - 1) * steps_per_epoch  # the global step of this epoch's first
        self._loss_sum, self._losses, self._bar = None, 0, None
        if show:
            self._bar = _Bar(
                total=steps_per_epoch,
                initial=start_step,
                unit="step",
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                "[{elapsed}<{remaining}, {img_rate} img/s{postfix}]",
                images_per_step=images_per_step,
                desc=f"epoch {epoch}",
            )

    def step(self, loss):
        if self._bar is None and self.track is None:
            return
        self.step_number += 1
        loss = loss.detach().float()
        self._loss_sum = loss.clone() if self._loss_sum is None else self._loss_sum.add_(loss)
        self._losses += 1
        if self._bar is not None:
            self._bar.update(1)
        if self.step_number % CHECK_EVERY == 0 or self.step_number == self.steps_per_epoch:
            mean = self._loss_sum.item() / self._losses  # after the agreement's host read: no extra sync
            self._loss_sum, self._losses = None, 0
            if self._bar is not None:
                self._bar.set_postfix_str(f"loss={mean:.3f}")
            if self.track:
                self.track({"train_loss": mean}, self.steps_before + self.step_number)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def validation_bar(show: bool, loader):
    if not show:
        return loader
    return _Bar(loader, unit="batch", desc="validation")


@before_report
def close_all():
    """An error message then starts on a clean line."""
    for bar in list(_open_bars):
        bar.close()
