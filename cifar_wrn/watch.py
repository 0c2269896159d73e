"""Around the training steps, never in them: warm-up, run log, timing, profiles, bars, stops, tracking."""

from pathlib import Path

import torch

from .agreement import agree_on_flags
from .bars import EpochBar
from .launch import launch_fields
from .profiling import PhaseTimer, allreduce_cost, profile_table, synchronized_clock
from .resilience import StepGuard
from .runlog import JsonLog, Progress, open_run_log
from .startup import warm_up

TRACKED = ("train_accuracy", "val_accuracy", "val_loss", "images_per_sec", "cumulative_time")  # the epoch line's


def start_training(args, recipe, run, progress: Progress) -> "Watch":
    run.recalibration_batches()  # made now: a problem with them stops the run before it trains
    resumed = bool(progress.epoch or progress.step)
    startup = warm_up(run, recipe, resumed) if progress.epochs_left(recipe) else 0.0
    log = open_run_log(args, recipe, run, progress, **launch_fields(args, run), startup_seconds=startup)
    for note in getattr(args, "launch_notes", []) if run.is_main else []:  # accel_train.py's
        print(f"note: {note}", flush=True)
    watch = Watch(args, run, log)
    if args.with_tracking and run.is_main:  # TensorBoard events in --project-dir/<the run log's folder>
        name = Path(log.file.name).resolve().parent.name
        if run.accelerator:  # Accelerator(log_with="tensorboard"): accelerator.log writes, end_training closes
            run.accelerator.init_trackers(name)
            watch.tracker = run.accelerator
        else:
            from torch.utils.tensorboard import SummaryWriter  # the optional extra, checked before launch

            watch.tracker = SummaryWriter(str(Path(args.project_dir, name)))
    return watch


class Watch:
    def __init__(self, args, run, log: JsonLog):  # the stop handlers: installed as the rank starts (report_failures)
        self.run, self.log, self.profile = run, log, args.profile
        self.guard = StepGuard(run.rank, run.world_size, run.device)
        self.timer = PhaseTimer(run.device, enabled=args.profile, trace_dir=args.trace, rank=run.rank)
        self.last_images, self.tracker = None, None  # tracker: a SummaryWriter, or an Accelerator with trackers
        if args.profile:
            self.timer.attach(run.model, getattr(run.optimizer, "optimizer", run.optimizer))
            run.model.register_forward_pre_hook(lambda module, inputs: setattr(self, "last_images", inputs[0]))

    def start_epoch(self, progress: Progress):
        self.progress = progress
        self.t0 = self.timer.start(self.run.device)
        steps = self.run.data.steps_per_epoch
        track = self.tracker and self.track
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
        profile = self.timer.totals()  # also stops --trace's profiler
        self.extras = {}
        if self.profile:  # with DDP's all-reduce time in the epoch, timed again on the last batch
            run, images, steps = self.run, self.last_images, self.run.data.steps_per_epoch - self.progress.step
            comm = steps * allreduce_cost(run, images) if run.ddp is not None and images is not None and steps else 0.0
            self.extras = {"profile": profile, "comm_estimate": comm}
        return epoch_time

    def log_epoch(self, metrics: dict):
        if self.profile and self.run.is_main:
            print(profile_table(**self.extras, epoch_time=metrics["epoch_time"], epoch=metrics["epoch"]), flush=True)
        self.log.write({"kind": "epoch", **metrics, **self.extras})
        if self.tracker:
            self.track({key: metrics[key] for key in TRACKED}, metrics["epoch"])

    def track(self, values: dict, step: int):
        if hasattr(self.tracker, "add_scalar"):  # raw_ddp.py's SummaryWriter
            for tag, value in values.items():
                self.tracker.add_scalar(tag, value, step)
            self.tracker.flush()  # as Accelerate's tracker does: a crash loses nothing logged
        else:  # accel_train.py's Accelerator: accelerator.log
            self.tracker.log(values, step=step)

    def close(self):
        self.log.close()
        if hasattr(self.tracker, "add_scalar"):  # Accelerate's end_training closes its own
            self.tracker.close()
