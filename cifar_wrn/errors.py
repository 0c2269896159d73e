"""Errors printed as one message with an exit status; imports nothing from cifar_wrn."""

import contextlib
import gc
import multiprocessing
import os
import sys
import time
import traceback

_before_report: list = []


def before_report(hook):
    _before_report.append(hook)
    return hook


class UserError(Exception):
    """Something the user can fix: `error: <message>`, exit status 2."""


class AgreedError(UserError):
    """Found alike by every rank; only the `shown` process (one a node) prints it."""

    def __init__(self, message: str, shown: bool, note: str | None = None):
        super().__init__(f"{message} (this node: {note})" if note and shown else message)
        self.shown = shown


@contextlib.contextmanager
def said_by_one(wait: float = 10.0):
    """A UserError each process finds alone, alike: LOCAL_RANK 0 raises it; another waits for the launcher to end
    it (once one process exits), raising it only if still alive."""
    try:
        yield
    except UserError:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            time.sleep(wait)
        raise


class RunStopped(Exception):
    """Every rank stops at one step; rank 0 says why; all exit with `status`."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def agreed_problem(problems: list) -> str | None:
    by_message = {}
    for rank, problem in enumerate(problems):
        if problem:
            by_message.setdefault(problem, []).append(rank)
    return "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {p}" for p, r in by_message.items()) or None


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def run_reporting_failures(train, rank, lost_contact_types: tuple = ()):
    """train(), any failure reported by its rank, with an exit status."""
    say = lambda text: print(text, file=sys.stderr, flush=True)
    status = 0
    try:
        try:
            train()
        finally:
            for hook in _before_report:
                hook()
    except RunStopped as exc:
        if str(rank) == "0":  # 75, a preemption, is no error
            say(f"{'error: ' if exc.status in (1, 2) else ''}{exc}")
        status = exc.status
    except UserError as exc:
        if getattr(exc, "shown", True):
            say(f"error: {exc}")
        status = 2
    except Exception as exc:
        if isinstance(exc, lost_contact_types) or any(text in str(exc) for text in PEER_LOST):
            say(
                f"error: rank {rank} lost contact with another process, which probably failed (see its error "
                f"above or in its node's log): {str(exc).splitlines()[0]}"
            )
        else:
            say(f"error: rank {rank} failed:\n{traceback.format_exc()}")
        status = 1
    # Past the except clauses the failure's frames are freed, a DataLoader's workers with them: held to the
    # interpreter's exit, they would meet multiprocessing's SIGTERM, which they ignore, and the exit would wait.
    gc.collect()
    for child in multiprocessing.active_children():  # a DataLoader worker left ignores multiprocessing's SIGTERM
        child.kill()
    if status:
        sys.exit(status)
