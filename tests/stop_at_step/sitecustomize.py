"""Put on PYTHONPATH by tests/test_exact_resume.py and test_start_up_stop.py: in every Python process started with it,
STOP_AT="E,S" asks for a stop in epoch E (1-based) at step S, as a SIGUSR1 arriving then would (the ranks agree
to stop at their next agreement, checkpoint and exit 75), and LOADER_WORKERS=N gives the loaders N
DataLoader worker processes on the CPU too (the trainers use workers only on GPUs), SLOW_START holds each rank
in its start-up, and SLOW_SPAWN holds mp.spawn 5 s after each process it starts. Nothing in the trainers knows
of it."""

import os
import runpy
from pathlib import Path

# Python imports one sitecustomize: this one shadows tests/lean_gc's, so run that one too.
runpy.run_path(str(Path(__file__).parents[1] / "lean_gc" / "sitecustomize.py"))

if os.environ.get("STOP_AT"):
    from cifar_wrn import resilience

    STOP_EPOCH, STOP_STEP = (int(n) for n in os.environ["STOP_AT"].split(","))
    check = resilience.StepGuard.check

    def check_after_a_signal(self, loss, epoch, step, *args, **kwargs):
        if (epoch + 1, step) == (STOP_EPOCH, STOP_STEP):
            resilience.request_stop()
        return check(self, loss, epoch, step, *args, **kwargs)

    resilience.StepGuard.check = check_after_a_signal

if os.environ.get("LOADER_WORKERS"):
    from cifar_wrn import loaders

    options = loaders.loader_options

    def with_workers(dataset, recipe, process):
        chosen = options(dataset, recipe, process)
        if recipe.data_pipeline == "dataloader":
            chosen.update(num_workers=int(os.environ["LOADER_WORKERS"]), persistent_workers=True)
        return chosen

    loaders.loader_options = with_workers

if os.environ.get("SLOW_START"):  # a folder: each rank writes rank-<r> there as it loads the data, then waits 3 s
    import time

    from cifar_wrn import datasets

    load = datasets.load_datasets

    def slow_load(source, recipe, process):
        Path(os.environ["SLOW_START"], f"rank-{process.rank}").touch()
        time.sleep(3)
        return load(source, recipe, process)

    datasets.load_datasets = slow_load

if os.environ.get("SLOW_SPAWN"):  # a folder: spawned-<n> written after each start, then 5 s
    import multiprocessing.context
    import time

    spawn_start = multiprocessing.context.SpawnProcess.start

    def slow_start(self):
        spawn_start(self)
        Path(os.environ["SLOW_SPAWN"], f"spawned-{len(multiprocessing.active_children())}").touch()
        time.sleep(5)

    multiprocessing.context.SpawnProcess.start = slow_start
