"""Around the training steps, never in them: warm-up, run log, timing, profiles, bars, stops, tracking."""

import sys
from pathlib import Path

import torch

from .agreement import agree_on_flags
from .bars import EpochBar
from .profiling import PhaseTimer, profile_table, synchronized_clock
from .resilience import StepGuard
from .runlog import EPOCH_KEYS, EPOCH_RECORD, JsonLog, open_run_log
from .startup import allreduce_cost, warm_up
from .stopping import Progress


def start_training(run, progress: Progress, options, launch: dict, tracker, step) -> "Watch":
    """The warm-up (of `step`, the entry point's train_step), the run log (its header with the trainer's `launch`
    fields), the timers and bars; `tracker(name, folder)`: the trainer's TensorBoard (--with-tracking).
    `options`: cli.Logging."""
    resumed = bool(progress.epoch or progress.step)
    startup = warm_up(run, step, resumed) if progress.epochs_left(run.recipe) else 0.0
    log = open_run_log(run, progress, options, **launch, startup_seconds=startup)
    for note in options.notes if run.is_main else ():
        print(f"note: {note}", flush=True)
    watch = Watch(run, log, step, options.profile, options.trace)
    if options.tracking_dir is not None and run.is_main:  # TensorBoard events in --project-dir/<the log's folder>
        watch.tracker = tracker(Path(log.file.name).resolve().parent.name, options.tracking_dir)
    return watch


class Watch:
    def __init__(self, run, log: JsonLog, step, profile: bool = False, trace: str | None = None):
        # the stop handlers: installed as the rank starts (resilience.report_failures)
        self.run, self.log, self.step, self.profile = run, log, step, profile
        self.guard = StepGuard(run.rank, run.world_size, run.device)
        self.timer = PhaseTimer(run.device, enabled=profile, trace_dir=trace, rank=run.rank)
        self.last_images, self.tracker = None, None  # tracker: the trainer's side's, with log and close
        if profile:
            self.timer.attach(run.model, getattr(run.optimizer, "optimizer", run.optimizer))
            run.model.register_forward_pre_hook(lambda module, inputs: setattr(self, "last_images", inputs[0]))

    def start_epoch(self, progress: Progress):
        self.progress, recipe, batches = progress, self.run.recipe, self.run.data.train_batches
        if recipe.prefetch_indices and batches is not None:
            batches.prepare()  # the epoch's batch indices on their way to the device, before the clock
        self.graphs = compiled_graphs(recipe)
        self.t0 = self.timer.start(self.run.device)
        steps = self.run.data.steps_per_epoch
        track = self.tracker and self.tracker.log
        self.bar = EpochBar(self.run.show, progress.epoch + 1, steps, progress.step, self.run.global_batch_size, track)

    def step_done(self, step: int, loss: torch.Tensor) -> bool:
        """True: every rank checkpoints and stops; RunStopped on a non-finite loss."""
        stop = self.guard.check(loss, self.progress.epoch, step, self.run.data.steps_per_epoch, agree_on_flags)
        if not stop:
            self.bar.step(loss)
        self.timer.mark("other")
        return stop

    def seconds(self) -> float:  # a resumed epoch's earlier part included
        return self.progress.epoch_time_so_far + synchronized_clock(self.run.device) - self.t0

    def end_epoch(self) -> float:
        """The epoch's training time."""
        self.bar.close()
        epoch_time = self.seconds()
        compiled = compiled_graphs(self.run.recipe) - self.graphs
        if compiled and self.run.is_main:  # a recompile: TORCH_LOGS=recompiles names the guard that failed
            where = f"inside epoch {self.progress.epoch + 1}'s clock: startup_steps compiles before it"
            print(f"warning: torch.compile made {compiled} graph(s) {where}", file=sys.stderr, flush=True)
        profile = self.timer.totals()  # also stops --trace's profiler
        self.extras = {}
        if self.profile:  # with DDP's all-reduce time in the epoch, timed again on the last batch
            run, images, steps = self.run, self.last_images, self.run.data.steps_per_epoch - self.progress.step
            comm = (
                steps * allreduce_cost(run, self.step, images)
                if run.ddp is not None and images is not None and steps
                else 0.0
            )
            self.extras = {"profile": profile, "comm_estimate": comm}
        return epoch_time

    def log_epoch(self, metrics: dict):
        if unknown := (metrics.keys() | self.extras.keys()) - EPOCH_KEYS:  # a new field: runlog.EPOCH_RECORD first
            raise ValueError(f"not in the epoch record: {', '.join(sorted(unknown))}")
        if self.profile and self.run.is_main:
            print(profile_table(**self.extras, epoch_time=metrics["epoch_time"], epoch=metrics["epoch"]), flush=True)
        self.log.write({"kind": "epoch", **metrics, **self.extras})
        if self.tracker:
            self.tracker.log({f.key: metrics[f.key] for f in EPOCH_RECORD if f.tracked}, metrics["epoch"])

    def close(self):
        self.log.close()
        if self.tracker:
            self.tracker.close()


def compiled_graphs(recipe) -> int:
    """The graphs torch.compile has made in this process so far (a recompile makes one); 0 without compile."""
    if not (recipe.compile or recipe.compile_optimizer):
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
