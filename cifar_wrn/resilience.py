"""Stop signals and non-finite losses, agreed by all ranks; a rank's failure reported as one message."""

import os
import signal
from time import monotonic

import torch
import torch.distributed as dist

from .errors import RunStopped, run_reporting_failures

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the Slurm scripts requeue on it
INTERRUPTED_EXIT = 130  # Ctrl-C's, as a shell reports it (128 + SIGINT): not requeued
CHECK_EVERY = 10  # most steps between agreements: each costs a GPU sync
STOP_LATENCY = 2.0  # most seconds between agreements where steps allow: Slurm kills 30 s after SIGTERM
INTERVALS = (10, 5, 2, 1)  # divisors of CHECK_EVERY

_stop_requested = 0  # 1: a stop (SIGUSR1, SIGTERM), 2: Ctrl-C (SIGINT); after an agreement, the ranks' largest


def request_stop(signum=None, frame=None) -> None:
    global _stop_requested
    _stop_requested = max(_stop_requested, 2 if signum == signal.SIGINT else 1)


def stop_status(saved: bool) -> int:
    return INTERRUPTED_EXIT if _stop_requested > 1 else PREEMPTED_EXIT if saved else 1


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def install_stop_handlers() -> None:
    """SIGUSR1, SIGTERM and SIGINT (Ctrl-C) mean "checkpoint and stop", never "die now"."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, request_stop)


class StepGuard:
    """Flags [stop, first non-finite step per rank, seconds per step per rank], on the device between agreements."""

    def __init__(self, rank: int, world_size: int, device):
        self.rank, self.world_size = rank, world_size
        self.flags = torch.zeros(1 + 2 * world_size, device=device)
        self.every = 1  # the first steps may be slow (compilation, warm-up)
        self.since = (None, 0, 0.0)  # (epoch, step, clock) of the last agreement

    def check(self, loss: torch.Tensor, epoch: int, step: int, steps_per_epoch: int, agree) -> bool:
        """True: stop and checkpoint; RunStopped on a non-finite loss. agree(flags) reduces in place, by MAX or SUM:
        ranks write only their own slots."""
        first_bad = self.flags[1 + self.rank]
        self.flags[1 + self.rank] = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1, first_bad)
        if (step + 1) % self.every and step + 1 != steps_per_epoch:
            return False
        flags = self.flags.clone()
        flags[0] = float(_stop_requested)
        if self.since[0] == epoch and step > self.since[1]:  # not across validation
            flags[1 + self.world_size + self.rank] = (monotonic() - self.since[2]) / (step - self.since[1])
        agree(flags)
        agreed = flags.tolist()
        if agreed[0]:  # every rank exits with the status of the largest stop asked
            request_stop(signal.SIGINT if agreed[0] > 1 else None)
        self.since = (epoch, step, monotonic())
        seconds_per_step = max(agreed[1 + self.world_size :])  # the slowest rank: every rank picks the same
        if seconds_per_step > 0:
            self.every = next((n for n in INTERVALS if n * seconds_per_step <= STOP_LATENCY), 1)
        bad = [f"{r} (first at step {int(s)})" for r, s in enumerate(agreed[1 : 1 + self.world_size]) if s > 0]
        if bad:
            raise RunStopped(
                f"non-finite loss in epoch {epoch + 1} on rank(s) {', '.join(bad)}: "
                "training diverged (try a lower learning rate or a longer warmup); "
                f"every rank stopped at step {step + 1}",
                1,
            )
        return agreed[0] > 0


def preempted(epoch: int, step: int, checkpoint_written: str | None) -> RunStopped:
    where = f"stopped by a signal at epoch {epoch + 1}, step {step + 1}"
    if checkpoint_written is None:
        return RunStopped(f"{where}; nothing saved (no --checkpoint-dir)", stop_status(False))
    return RunStopped(
        f"{where}: checkpoint written to {checkpoint_written}; rerun with --resume to continue", stop_status(True)
    )


def report_failures(train, local_rank: int, settings, recipe) -> None:
    """One rank: train(local_rank, settings, recipe), any failure reported as one message and an exit status."""
    install_stop_handlers()  # a stop from now on, start-up included, checkpoints and stops at the first step
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # Launcher's ranks start with them blocked: now due
    rank = os.environ.get("RANK") or settings.first_rank + local_rank
    lost_contact = (dist.DistBackendError, dist.DistNetworkError)
    run_reporting_failures(lambda: train(local_rank, settings, recipe), rank, lost_contact)
