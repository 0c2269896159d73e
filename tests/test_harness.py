"""The tests' own process helpers (tests/helpers.py): a timeout ends every process a test started."""

import os
import time

import psutil
import pytest
from helpers import finish, start, torchrun_command


@pytest.mark.slow
def test_a_timeout_kills_the_ranks_torchrun_put_in_sessions_of_their_own():
    """torchrun's agent starts each worker in a session of its own: killing the launcher's process group left the
    worker running and holding the test's pipes, and finish() waited for it, a hang past the timeout. Here the
    worker sleeps 600 s; finish() must fail the test soon after its 5 s timeout, and the worker be gone."""
    proc = start(torchrun_command("--no-python", "sleep", 600, nproc=1))
    deadline, workers = time.monotonic() + 120, []
    while not workers:
        assert time.monotonic() < deadline, "torchrun never started its worker"
        time.sleep(0.1)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "sleep"]
    [worker] = workers
    assert os.getsid(worker.pid) != os.getsid(proc.pid)  # what makes the group's kill miss it
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 5 s"):
        finish(proc, 5)
    assert time.monotonic() - t0 < 60
    worker.wait(timeout=10)  # gone; psutil.TimeoutExpired if it still runs
