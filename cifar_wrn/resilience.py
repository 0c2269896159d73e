"""Stopping together: stop signals, non-finite losses, and the test-only fault hooks, in one place.

Nothing here talks to other processes. Where the ranks must agree, the entry point passes in its own
collective (raw_ddp.py: dist.all_reduce; accel_train.py: accelerator.reduce), so every collective
stays visible there.

Preemption: Slurm signals the launcher (SIGUSR1 from `--signal=B:USR1@120`) or every process of the
step (SIGTERM at scancel, the time limit, a preemption); launchers pass stop signals on to their ranks.
Each rank only sets a flag. Every CHECK_EVERY steps, and at each epoch's end, the ranks agree on the
flags (StepGuard.check), rank 0 writes a checkpoint, and every rank exits with PREEMPTED_EXIT.
"""
import os
import signal

import torch

from .errors import RunStopped

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, try again; the Slurm scripts requeue on it
CHECK_EVERY = 10     # steps between agreements (each one costs a GPU synchronisation)

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


class TestFaults:
    """Test-only fault injection, read from the environment once (all unset in real runs):
    CIFAR_WRN_TEST_RAISE_IN_RANK=r        rank r raises before its first step
    CIFAR_WRN_TEST_NAN_AT=r,epoch,step    rank r's loss becomes NaN at that step (1-based)
    CIFAR_WRN_TEST_STOP_AT=epoch,step     every rank acts as if a stop signal arrived at that step
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.raise_in_rank = os.environ.get("CIFAR_WRN_TEST_RAISE_IN_RANK")
        self.nan_at = os.environ.get("CIFAR_WRN_TEST_NAN_AT", "")
        self.stop_at = os.environ.get("CIFAR_WRN_TEST_STOP_AT", "")

    @classmethod
    def for_rank(cls, rank: int) -> "TestFaults":
        """This rank's hooks, called before its first step (CIFAR_WRN_TEST_RAISE_IN_RANK raises here)."""
        faults = cls(rank)
        if faults.raise_in_rank is not None and int(faults.raise_in_rank) == rank:
            raise RuntimeError(f"injected test fault in rank {rank}")
        return faults

    def loss(self, loss: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        """`epoch` and `step` 0-based, as in the loops."""
        if self.stop_at == f"{epoch + 1},{step + 1}":
            request_stop()
        if self.nan_at == f"{self.rank},{epoch + 1},{step + 1}":
            return loss * float("nan")
        return loss


class StepGuard:
    """Every CHECK_EVERY steps and at each epoch's end, all ranks answer two questions together, so that
    they stop together at the same step: did any rank get a stop signal (slot 0), and at which step did
    each rank first see a non-finite loss (slot 1 + rank, 0 = never)? Between checks the flags only
    accumulate on the device, so the host never waits for the GPU."""

    def __init__(self, rank: int, world_size: int, device):
        self.rank, self.world_size = rank, world_size
        self.flags = torch.zeros(1 + world_size, device=device)

    def check(self, loss: torch.Tensor, epoch: int, step: int, steps_per_epoch: int, agree) -> bool:
        """After each step (0-based epoch and step). `agree(flags)` is the entry point's collective: each
        rank writes only its own slots, so a MAX or a SUM over ranks both give the answer; it may reduce
        in place (dist.all_reduce) or return the result (accelerator.reduce). Returns True when the ranks
        agreed to stop for a signal (the caller checkpoints); raises RunStopped on a non-finite loss."""
        first_bad = self.flags[1 + self.rank]
        self.flags[1 + self.rank] = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1,
                                                first_bad)
        if (step + 1) % CHECK_EVERY and step + 1 != steps_per_epoch:
            return False
        flags = self.flags.clone()
        flags[0] = float(stop_requested())
        agreed = agree(flags)
        agreed = flags if agreed is None else agreed  # the same answer on every rank
        if not agreed.any():
            return False
        bad = {r: int(agreed[1 + r]) for r in range(self.world_size) if agreed[1 + r] > 0}
        if bad:
            raise RunStopped(f"non-finite loss in epoch {epoch + 1} on rank(s) "
                             f"{', '.join(f'{r} (first at step {s})' for r, s in bad.items())}: "
                             f"training diverged (try a lower learning rate or a longer warmup); "
                             f"every rank stopped at step {step + 1}", 1)
        return True


def preempted(epoch: int, step: int, checkpoint_written: str | None) -> RunStopped:
    """The exception every rank raises after the agreed stop (and the checkpoint, when there is a folder)."""
    if checkpoint_written is None:
        return RunStopped(f"stopped by a signal at epoch {epoch + 1}, step {step + 1}; nothing saved "
                          f"(no --checkpoint-dir)", 1)
    return RunStopped(f"stopped by a signal at epoch {epoch + 1}, step {step + 1}: checkpoint written to "
                      f"{checkpoint_written}; rerun with --resume to continue", PREEMPTED_EXIT)
