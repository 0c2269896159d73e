"""Put on PYTHONPATH by the tests (helpers.exit_threads_env): every Python process started with it writes the
names of its threads still running at exit to $EXIT_THREADS_DIR/<pid>, one a line. A process group whose gloo
threads are still running then is torn down with the process, which now and then aborts it (SIGABRT) after its
last line. Nothing in the trainers knows of it."""

import atexit
import os
import runpy
from pathlib import Path

# Python imports one sitecustomize: this one shadows tests/lean_gc's, so run that one too (its exit handler,
# registered first, runs last).
runpy.run_path(str(Path(__file__).parents[1] / "lean_gc" / "sitecustomize.py"))


def record_threads():
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    (Path(os.environ["EXIT_THREADS_DIR"]) / str(os.getpid())).write_text("\n".join(sorted(names)))


atexit.register(record_threads)  # exit handlers run last first: this one after all the program registers
