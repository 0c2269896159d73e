"""Exceptions the entry points print as one message with an exit status.

Imports nothing from cifar_wrn; what must run before an error is printed registers with before_report.
"""

import sys
import traceback

_before_report: list = []


def before_report(hook):
    """Register hook() to run before an error is printed (a decorator)."""
    _before_report.append(hook)
    return hook


class UserError(Exception):
    """Something the user can fix: printed as `error: <message>`, exit status 2."""


class AgreedError(UserError):
    """A problem every rank finds alike; only the `shown` process (one per node) prints it."""

    def __init__(self, message: str, shown: bool, note: str | None = None):
        super().__init__(f"{message} (this node: {note})" if note and shown else message)
        self.shown = shown


class RunStopped(Exception):
    """Every rank stops at the same step; rank 0 prints why; all exit with `status`."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def agreed_problem(problems: list) -> str | None:
    """One message from every rank's all-gathered problem (or None), the same on every rank."""
    by_message: dict[str, list[int]] = {}
    for rank, problem in enumerate(problems):
        if problem:
            by_message.setdefault(problem, []).append(rank)
    if not by_message:
        return None
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {problem}"
        for problem, ranks in by_message.items()
    )


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def run_reporting_failures(train, rank, lost_contact_types: tuple = ()) -> None:
    """train(), any failure reported by the rank where it happened, and its exit status."""
    try:
        try:
            train()
        finally:
            for hook in _before_report:
                hook()
    except RunStopped as exc:
        if str(rank) == "0":  # 75, a preemption, is no error
            print(f"{'error: ' if exc.status in (1, 2) else ''}{exc}", file=sys.stderr, flush=True)
        sys.exit(exc.status)
    except UserError as exc:
        if getattr(exc, "shown", True):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as exc:
        if isinstance(exc, lost_contact_types) or any(text in str(exc) for text in PEER_LOST):
            print(
                f"error: rank {rank} lost contact with another process, which probably failed (see its error "
                f"above or in its node's log): {str(exc).splitlines()[0]}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"error: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


def group_not_formed(who: str, where: str, world_size, timeout: float, exc: Exception, hint: str) -> UserError:
    """The error when init_process_group times out or cannot reach node 0."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return UserError(
        f"{who}the process group did not form at {where} with world size {world_size} within "
        f"{timeout:g} s: not every process joined. {hint} ({type(exc).__name__}: {first})"
    )
