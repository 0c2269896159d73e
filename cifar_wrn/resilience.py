"""Stop signals and non-finite losses, agreed by all ranks through the entry point's collective.

Each agreement costs a GPU sync, yet they stay ~STOP_LATENCY s apart: Slurm kills 30 s after SIGTERM.
"""

import os
import signal
from time import monotonic

import torch

from .errors import RunStopped

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the Slurm scripts requeue on it
CHECK_EVERY = 10  # most steps between agreements
STOP_LATENCY = 2.0  # seconds
INTERVALS = (10, 5, 2, 1)  # divisors of CHECK_EVERY, so every 10th step stays an agreement step

_stop_requested = False


def request_stop(signum=None, frame=None) -> None:
    global _stop_requested
    _stop_requested = True


def stop_requested() -> bool:
    return _stop_requested


def install_stop_handlers() -> None:
    """Both mean "checkpoint and stop", never "die now"."""
    signal.signal(signal.SIGUSR1, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def pass_on_stop_signals(processes: list) -> None:
    """The launching process: SIGUSR1 or SIGTERM to it goes on to each live rank as SIGUSR1 (checkpoint and stop)."""

    def pass_on(signum, frame):
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, pass_on)
    signal.signal(signal.SIGTERM, pass_on)


class StepGuard:
    """Flags: [stop signal, first non-finite step per rank (0 = none), seconds per step per rank].
    They accumulate on the device between agreements, so the host never waits for the GPU."""

    def __init__(self, rank: int, world_size: int, device):
        self.rank, self.world_size = rank, world_size
        self.flags = torch.zeros(1 + 2 * world_size, device=device)
        self.every = 1  # the first steps may be slow (compilation, warm-up)
        self.since = None  # (epoch, step, clock) of the last agreement

    def check(self, loss: torch.Tensor, epoch: int, step: int, steps_per_epoch: int, agree) -> bool:
        """Ranks write only their own slots, so agree() may MAX or SUM, in place or returned.
        True: stop and checkpoint; raises RunStopped on a non-finite loss."""
        first_bad = self.flags[1 + self.rank]
        self.flags[1 + self.rank] = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1, first_bad)
        if (step + 1) % self.every and step + 1 != steps_per_epoch:
            return False
        flags = self.flags.clone()
        flags[0] = float(stop_requested())
        if self.since is not None and self.since[0] == epoch and step > self.since[1]:  # not across validation
            flags[1 + self.world_size + self.rank] = (monotonic() - self.since[2]) / (step - self.since[1])
        agreed = agree(flags)
        agreed = (flags if agreed is None else agreed).tolist()
        self.since = (epoch, step, monotonic())
        seconds_per_step = max(agreed[1 + self.world_size :])  # the slowest rank: every rank picks the same
        if seconds_per_step > 0:
            self.every = next((n for n in INTERVALS if n * seconds_per_step <= STOP_LATENCY), 1)
        bad = {r: int(agreed[1 + r]) for r in range(self.world_size) if agreed[1 + r] > 0}
        if bad:
            raise RunStopped(
                f"non-finite loss in epoch {epoch + 1} on rank(s) "
                f"{', '.join(f'{r} (first at step {s})' for r, s in bad.items())}: "
                f"training diverged (try a lower learning rate or a longer warmup); "
                f"every rank stopped at step {step + 1}",
                1,
            )
        return agreed[0] > 0


def preempted(epoch: int, step: int, checkpoint_written: str | None) -> RunStopped:
    if checkpoint_written is None:
        return RunStopped(
            f"stopped by a signal at epoch {epoch + 1}, step {step + 1}; nothing saved (no --checkpoint-dir)", 1
        )
    return RunStopped(
        f"stopped by a signal at epoch {epoch + 1}, step {step + 1}: checkpoint written to "
        f"{checkpoint_written}; rerun with --resume to continue",
        PREEMPTED_EXIT,
    )
