"""Stopping together: stop signals and non-finite losses, in one place.

Nothing here talks to other processes. Where the ranks must agree, the entry point passes in its own
collective (raw_ddp.py: dist.all_reduce; accel_train.py: accelerator.reduce), so every collective
stays visible there.

Preemption: Slurm signals the launcher (SIGUSR1 from `--signal=B:USR1@120`) or every process of the
step (SIGTERM at scancel, the time limit, a preemption); launchers pass stop signals on to their ranks.
Each rank only sets a flag. At agreement steps, and at each epoch's end, the ranks agree on the
flags (StepGuard.check), rank 0 writes a checkpoint, and every rank exits with PREEMPTED_EXIT.

How often they agree: every CHECK_EVERY steps when steps are fast (each agreement costs a GPU
synchronisation), but never much more than STOP_LATENCY seconds apart. Slurm sends SIGKILL 30 s
(KillWait) after SIGTERM and torchrun's agent 30 s after passing SIGTERM on, so a fixed 10 steps
of 9.5 s (the real model on 2 CPU processes) would lose the epoch. The interval is measured, and
agreed: each rank times its own steps between agreements, the agreement carries every rank's time
per step, and every rank picks the next interval from the slowest one, so all ranks pick the same.
"""

import signal
from time import monotonic

import torch

from .errors import RunStopped

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, try again; the Slurm scripts requeue on it
CHECK_EVERY = 10  # the most steps between agreements (each one costs a GPU synchronisation)
STOP_LATENCY = 2.0  # seconds: the agreement interval is the longest of INTERVALS whose steps fit in it
INTERVALS = (10, 5, 2, 1)  # divisors of CHECK_EVERY: every 10th step stays an agreement step (progress.py)

_stop_requested = False


def request_stop(signum=None, frame=None) -> None:
    """Signal handler: remember the request; the ranks act on it together at the next check."""
    global _stop_requested
    _stop_requested = True


def stop_requested() -> bool:
    return _stop_requested


def install_stop_handlers() -> None:
    """SIGUSR1 (from the launcher, or Slurm's user signal) and SIGTERM (Slurm sends it to every process
    of the step; torchrun passes it on to its workers): both mean "checkpoint and stop", never "die now"."""
    signal.signal(signal.SIGUSR1, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


class StepGuard:
    """At agreement steps and at each epoch's end, all ranks answer three questions together, so that they
    stop together at the same step: did any rank get a stop signal (slot 0), at which step did each rank
    first see a non-finite loss (slot 1 + rank, 0 = never), and how many seconds did each rank's steps take
    since the last agreement (slot 1 + world_size + rank, 0 = not measured)? Between agreements the flags
    only accumulate on the device, so the host never waits for the GPU.

    Agreement steps: those where (step + 1) is a multiple of `every`, which starts at 1 (the first steps of
    a process may be slow: compilation, warm-up) and after each agreement becomes the longest of INTERVALS
    whose steps, at the slowest rank's measured pace, take at most STOP_LATENCY seconds. A stop signal
    therefore waits at most about max(STOP_LATENCY, one step) before the ranks act on it."""

    def __init__(self, rank: int, world_size: int, device):
        self.rank, self.world_size = rank, world_size
        self.flags = torch.zeros(1 + 2 * world_size, device=device)
        self.every = 1
        self.since = None  # (epoch, step, clock) at the end of the last agreement: where the next measurement starts

    def check(self, loss: torch.Tensor, epoch: int, step: int, steps_per_epoch: int, agree) -> bool:
        """After each step (0-based epoch and step). `agree(flags)` is the entry point's collective: each
        rank writes only its own slots, so a MAX or a SUM over ranks both give the answer; it may reduce
        in place (dist.all_reduce) or return the result (accelerator.reduce). Returns True when the ranks
        agreed to stop for a signal (the caller checkpoints); raises RunStopped on a non-finite loss."""
        first_bad = self.flags[1 + self.rank]
        self.flags[1 + self.rank] = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1, first_bad)
        if (step + 1) % self.every and step + 1 != steps_per_epoch:
            return False
        flags = self.flags.clone()
        flags[0] = float(stop_requested())
        if self.since is not None and self.since[0] == epoch and step > self.since[1]:  # not across validation
            flags[1 + self.world_size + self.rank] = (monotonic() - self.since[2]) / (step - self.since[1])
        agreed = agree(flags)
        agreed = (flags if agreed is None else agreed).tolist()  # the same answer on every rank; waits for it
        self.since = (epoch, step, monotonic())
        seconds_per_step = max(agreed[1 + self.world_size :])
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
    """The exception every rank raises after the agreed stop (and the checkpoint, when there is a folder)."""
    if checkpoint_written is None:
        return RunStopped(
            f"stopped by a signal at epoch {epoch + 1}, step {step + 1}; nothing saved (no --checkpoint-dir)", 1
        )
    return RunStopped(
        f"stopped by a signal at epoch {epoch + 1}, step {step + 1}: checkpoint written to "
        f"{checkpoint_written}; rerun with --resume to continue",
        PREEMPTED_EXIT,
    )
