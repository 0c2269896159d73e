"""Live progress during an epoch, for a terminal: a tqdm bar for the training steps and one for validation.

Both entry points use it the same way, on the process that prints (rank 0), on stderr, and only when
`show` is true (cli.show_progress: --progress auto = stderr is a terminal; on; off). When `show` is false
nothing is created or written and the per-step call returns at once, so Slurm output files, CI logs and
`| tee` keep exactly the epoch lines (stdout), without a carriage return.

    bar = EpochBar(show, epoch + 1, steps_per_epoch, skip, global_batch_size)
    for step, (images, labels) in ...:
        ...                                     # forward, backward, optimizer step, step agreement
        bar.step(loss)
    bar.close()
    ...
    totals = evaluate(model, validation_bar(show, val_loader), ...)   # or: for batch in validation_bar(...)

and close_all() where an error is reported, so that the message does not run on after a half-drawn bar.

The training bar shows the step within the epoch (a resumed epoch starts at the steps it skips), the
images/sec of the whole run (tqdm's smoothed steps/sec times the images of one step over all processes)
and the mean training loss of the steps since the last refresh. The loss is read from the device only where
the trainers already wait for it: every CHECK_EVERY steps and at the epoch's last step, the steps of their
stop/non-finite agreement. In between, `step` only adds the loss to a sum on the device (asynchronous),
so the bar adds no host-device synchronisation to a step.
"""

import sys
import weakref

from tqdm import tqdm

from .errors import before_report
from .resilience import CHECK_EVERY  # the steps where the trainers agree, and so wait for the device

# tqdm's monitor thread (it wakes every 10 s to fix a stalled miniters) is of no use to a bar updated every
# step, and a stray thread is unwelcome in processes that fork DataLoader workers and handle signals.
tqdm.monitor_interval = 0

TRAIN_FORMAT = (
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {img_rate} img/s{postfix}]"
)

_open_bars: "weakref.WeakSet[tqdm]" = weakref.WeakSet()
DEFAULT_COLUMNS = 100  # where the terminal reports no width (a pty nobody sized, as `script -c` gives)


class _Bar(tqdm):
    """tqdm that draws DEFAULT_COLUMNS wide where the terminal reports 0 columns and rows: tqdm would take
    them as -1 and draw nothing at all (its display() skips a bar positioned below the last row)."""

    def _sized(self) -> None:
        if self.ncols is not None and self.ncols <= 0:
            self.ncols, self.nrows = DEFAULT_COLUMNS, None

    def display(self, msg=None, pos=None):
        self._sized()
        return super().display(msg, pos)

    @property
    def format_dict(self):
        fields = super().format_dict  # reads the terminal's size again (dynamic_ncols)
        self._sized()
        fields.update(ncols=self.ncols, nrows=self.nrows)
        return fields


class _TrainBar(_Bar):
    """tqdm with one more field for bar_format: {img_rate}, steps/sec times the images of one step."""

    def __init__(self, *args, images_per_step: int = 1, **kwargs):
        self.images_per_step = images_per_step  # before tqdm's __init__, which already draws the bar
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
    # leave=False: a finished bar erases itself, so the terminal shows the epoch lines and the live bar only.
    return dict(desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


class EpochBar:
    """The training steps of one epoch. With show=False every method does nothing."""

    def __init__(
        self,
        show: bool,
        epoch: int,
        steps_per_epoch: int,
        start_step: int = 0,
        images_per_step: int = 1,
        check_every: int = CHECK_EVERY,
    ):
        self.step_number = start_step  # steps of the epoch done, counting those a resumed run skips
        self.steps_per_epoch, self.check_every = steps_per_epoch, check_every
        self._loss_sum, self._losses = None, 0  # on the device: the losses since the last refresh
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
        """After each optimizer step, with the step's loss tensor. Reads it (.item()) only at the agreement steps."""
        if self._bar is None:
            return
        self.step_number += 1
        loss = loss.detach().float()
        # Accumulate on the device: a queued addition, no wait for the device.
        self._loss_sum = loss.clone() if self._loss_sum is None else self._loss_sum.add_(loss)
        self._losses += 1
        self._bar.update(1)  # redraws at most every 0.1 s (tqdm's mininterval)
        if self.step_number % self.check_every == 0 or self.step_number == self.steps_per_epoch:
            # An agreement step: the trainer has just waited for the device, so this copy waits for nothing.
            mean = self._loss_sum.item() / self._losses
            self._loss_sum, self._losses = None, 0
            self._bar.set_postfix_str(f"loss={mean:.3f}")  # and redraw: the new loss, and the epoch's last step

    def close(self) -> None:
        """Erase the bar (call after the step loop; calling it twice is harmless)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def validation_bar(show: bool, loader, desc: str = "validation"):
    """`loader` itself when show is false; else a tqdm over it (one tick per batch; total = len(loader) when it
    has one). Iterate it exactly like the loader: it yields the loader's batches and erases itself at the end."""
    if not show:
        return loader
    bar = _Bar(loader, unit="batch", **_common(desc))
    _open_bars.add(bar)
    return bar


@before_report  # cifar_wrn/errors.py runs it before printing an error
def close_all() -> None:
    """Erase every bar still drawn: for an error path, so that a message printed to stderr after a failure in
    the middle of an epoch starts on a clean line instead of after the bar."""
    for bar in list(_open_bars):
        bar.close()
