"""Put on PYTHONPATH by tests/test_fast.py's host-read test: every Python process started with it counts the
reads of a tensor's value on the host (Tensor.item, .tolist, float(), int(), bool(), .numpy()) and the tensors
built from host data (torch.tensor, torch.as_tensor of a list or number), the operations that on a GPU make the
host wait for the device queue. Each is counted under the innermost line of the checkout that made it, and apart
when $HOST_READS_CLOCK's file:first-last lines (a timed epoch) are on the stack; at exit each process writes its
counts to $HOST_READS_DIR/<pid>.json. StepGuard's interval, which follows the machine's speed, is pinned at its
longest, so that the counts are the same on any machine. Nothing in the trainers knows of it."""

import atexit
import collections
import json
import os
import runpy
import sys
from pathlib import Path

# Python imports one sitecustomize: this one shadows tests/lean_gc's, so run that one too.
runpy.run_path(str(Path(__file__).parents[1] / "lean_gc" / "sitecustomize.py"))

REPO = str(Path(__file__).resolve().parents[2]) + os.sep
CLOCK_FILE, CLOCK_LINES = os.environ["HOST_READS_CLOCK"].rsplit(":", 1)
FIRST, LAST = map(int, CLOCK_LINES.split("-"))
counts = {"clock": collections.Counter(), "other": collections.Counter()}


def record(kind: str) -> None:
    frame, innermost, in_clock = sys._getframe(2), None, False
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(REPO) and "/tests/" not in name:
            innermost = innermost or f"{name[len(REPO) :]}:{frame.f_lineno}"
            in_clock |= name.endswith(CLOCK_FILE) and FIRST <= frame.f_lineno <= LAST
        frame = frame.f_back
    if innermost:
        counts["clock" if in_clock else "other"][f"{innermost} {kind}"] += 1


def counted(owner, name: str, kind: str, only=lambda *args, **kwargs: True):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if only(*args, **kwargs):
            record(kind)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def install() -> None:
    import torch

    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        counted(torch.Tensor, name, name)
    from_host = lambda data, *args, **kwargs: not isinstance(data, torch.Tensor)
    for name in ("tensor", "as_tensor"):
        counted(torch, name, f"torch.{name} from host data", from_host)
    from cifar_wrn import resilience

    resilience.STOP_LATENCY = float("inf")  # every CHECK_EVERY steps, however slow a step


def write() -> None:
    (Path(os.environ["HOST_READS_DIR"]) / f"{os.getpid()}.json").write_text(json.dumps(counts))


install()
atexit.register(write)
