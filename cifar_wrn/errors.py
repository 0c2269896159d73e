"""The exceptions the entry points turn into a plain message (no traceback) and an exit status.

The ground floor of cifar_wrn/: it imports no other module of the package (tests/test_imports.py checks
that no module imports one that imports it back). What must happen before an error is printed (progress.py
erases its bars) registers itself with before_report instead of being imported here.
"""

import sys
import traceback

_before_report: list = []  # callables, run before run_reporting_failures prints anything


def before_report(hook):
    """Register hook() to run before an error message is printed (usable as a decorator)."""
    _before_report.append(hook)
    return hook


class UserError(Exception):
    """Something the user can fix: bad input, missing data, a process group that did not form.

    Entry points catch it, print `error: <message>` and exit with status 2. Everything else is a
    bug or a crash and is reported with its traceback.
    """


class AgreedError(UserError):
    """A problem every rank finds alike (an all-gather of every rank's answer, see agreed_problem, or a fact of
    the launch every rank reads the same): every rank raises it and stops, and one process per node prints it
    (`shown`), so that it is read once per node instead of once per rank. `note`: what only the printing
    process knows (why its download failed, say)."""

    def __init__(self, message: str, shown: bool, note: str | None = None):
        super().__init__(f"{message} (this node: {note})" if note and shown else message)
        self.shown = shown


class RunStopped(Exception):
    """Every rank stops together at the same step; rank 0 prints why; all exit with `status`."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def agreed_problem(problems: list) -> str | None:
    """One message from every rank's answer to "can you go on?" (None = yes), collected by an all-gather
    in the entry point. Every rank holds the same list, so every rank takes the same decision: all go on,
    or all stop within seconds, instead of some waiting for the others until the collective times out."""
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


# What gloo and NCCL say when the process at the other end of a connection has gone away.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def run_reporting_failures(train, rank, lost_contact_types: tuple = ()) -> None:
    """train(), with every failure reported by the rank it happened in, so nothing is lost whichever
    failed rank the launcher notices first: RunStopped by rank 0 (all ranks stop together), a UserError
    as one line (exit status 2), a broken collective as "lost contact" (a peer probably failed), anything
    else with the rank number and its traceback (exit status 1)."""
    try:
        try:
            train()
        finally:
            for hook in _before_report:  # progress.close_all: a half-drawn bar must not swallow the message
                hook()
    except RunStopped as exc:
        if str(rank) == "0":  # 1 and 2 are failures (2: one the user can fix); 75, a preemption, is not
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
    """The error every rank reports when init_process_group times out or cannot reach node 0."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return UserError(
        f"{who}the process group did not form at {where} with world size {world_size} within "
        f"{timeout:g} s: not every process joined. {hint} ({type(exc).__name__}: {first})"
    )
