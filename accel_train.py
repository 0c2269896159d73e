r"""The same training as raw_ddp.py through Hugging Face Accelerate, function by function, for comparison.

Where Accelerate replaces a course step, `# A1.<n>` stands for raw_ddp.py's `# R1.<n>`:
    A1.1   processes and nodes: the launcher's config               parse_args
    A1.2   accelerator.num_processes, process_index                 setup
    A1.3   Accelerator() joins the launcher's group                 setup; end_training: train_process
    A1.4   local_main_process_first(): one download per node        build_data
    A1.5   accelerator.prepare(DataLoader) shards the batches       build_data
    A1.6   the prepared loader's set_epoch                          train_process
    A1.7   accelerator.device                                       setup
    A1.8   accelerator.prepare(model), accelerator.backward(loss)   build_model, train_epoch
    A1.9   accelerator.reduce, gather_for_metrics                   epoch_metrics, validate
    A1.10  only the main process prints                             train_process
    A1.11  the launcher starts one process per GPU                  __main__
Collectives that are not course steps say `# beyond R1: <why>` where this file calls them; they run in
    cifar_wrn/agreement.py every    errors, stop flags, training counts, BatchNorm buffers
    cifar_wrn/checkpoints.py resume  the checkpoint every rank resumes from (all_gather, Checkpointer.resume)
    cifar_wrn/accel_side.py write    a checkpoint: every rank's random streams and write problems (all_gather)
    cifar_wrn/resilience.py check   the stop flags' all_reduce, every few steps (called by watch.step_done)
    cifar_wrn/bn_recalibration.py recalibrate_bn  average_over_ranks, passed in (recipe key bn_recalibration)
    cifar_wrn/startup.py warm_up    train_step, passed in: DDP's forward and backward (recipe key startup_steps)
    cifar_wrn/startup.py allreduce_cost  train_step, timed with and without DDP's all-reduce (--profile)
    cifar_wrn/evaluation.py evaluate_run  gather_for_metrics, passed in (A1.9), on to:
    cifar_wrn/evaluation.py evaluate  which calls it on each batch's results
and DDP broadcasts rank 0's BatchNorm buffers in each training forward (SyncBatchNorm, recipe key sync_bn,
all-gathers in each one).

    # 1 node x 2 GPUs (installed by pip, from any folder: `-m accel_train` for `accel_train.py`, as below)
    accelerate launch --config_file accelerate_configs/two_gpus.yaml accel_train.py --data-dir data

    # 2 nodes x 4 GPUs: only --machine_rank differs
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank 0 --main_process_ip node0 \
        --main_process_port 29500 accel_train.py --data-dir data

    # Slurm: the job scripts in slurm/ (docs/slurm.md)

    # 2 CPU processes (gloo); installed by pip: the configs are in <pip show's Location>/cifar_wrn/accelerate_configs/
    accelerate launch --config_file accelerate_configs/two_cpus.yaml accel_train.py --device cpu --data-dir data \
        --train-subset 2000 --val-subset 1000 --epochs 2
    python accel_train.py --data-dir data                                  # 1 process, no launcher

    # the challenge recipe, resumable
    accelerate launch --config_file accelerate_configs/two_gpus.yaml accel_train.py --recipe fast \
        --checkpoint-dir ckpt --auto-resume

Preemption: SIGTERM to `accelerate launch` (SIGUSR1 kills its agent), or SIGUSR1 to the ranks.
"""

# ==== setup
import argparse
import os
import sys
from datetime import timedelta

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.utils import DDPCommunicationHookType, TorchDynamoPlugin, reduce
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn import accel_side
from cifar_wrn.agreement import all_or_none, buffers_from_rank_0, training_counts
from cifar_wrn.bn_recalibration import recalibrate_bn
from cifar_wrn.cifar_files import download_cifar10
from cifar_wrn.cli import Settings, add_training_flags, launch_commands, show_progress
from cifar_wrn.datasets import load_datasets
from cifar_wrn.errors import UserError
from cifar_wrn.evaluation import evaluate_run, exact_ratios
from cifar_wrn.loaders import SkipFirst, loader_options
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_training
from cifar_wrn.rendezvous import forming_group
from cifar_wrn.resilience import report_failures
from cifar_wrn.run import Data, Process, Run
from cifar_wrn.runlog import epoch_line
from cifar_wrn.stopping import final_line
from cifar_wrn.watch import start_training


def parse_args(argv=None) -> argparse.Namespace:
    # A1.1 command line: processes and nodes are the launcher's (its config file), not this script's
    what = "Accelerate training of the course WideResNet on CIFAR-10; processes and nodes: the launcher's config."
    p = argparse.ArgumentParser(
        description=what, epilog=launch_commands(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    launch = p.add_argument_group("launch")  # A1.1
    launch.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even where CUDA exists")  # A1.1
    launch.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="as raw_ddp.py's")
    add_training_flags(p, launch)
    return p.parse_args(argv)


def setup(local_rank: int, settings: Settings, recipe) -> Process:
    # A1.3 Accelerator(): joins the group the launcher formed, with DDP's options and the recipe's precision
    hook = DDPCommunicationHookType.BF16 if recipe.grad_compression == "bf16" else DDPCommunicationHookType.NO
    loading = DataLoaderConfiguration(
        use_seedable_sampler=True, data_seed=recipe.seed, non_blocking=True
    )  # A1.5 shuffle
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=settings.dist_timeout))  # A1.3
    with forming_group(settings):  # a group that does not form is one clear error
        accelerator = Accelerator(  # A1.3
            cpu=settings.device == "cpu",
            mixed_precision="bf16" if recipe.precision == "bf16" else "no",
            dataloader_config=loading,
            step_scheduler_with_optimizer=False,  # the schedule counts one process's steps
            dynamo_plugin=TorchDynamoPlugin(backend="inductor" if recipe.compile else "no", mode=recipe.compile_mode),
            log_with="tensorboard"
            if settings.logging.tracking_dir is not None
            else None,  # beyond R1: trackers opened later
            project_dir=settings.logging.tracking_dir,
            kwargs_handlers=[
                DistributedDataParallelKwargs(**recipe.ddp_options, comm_hook=hook),
                timeout,
            ],  # A1.8 DDP options
        )
    world_size, rank = accelerator.num_processes, accelerator.process_index  # A1.2 world size and rank
    device = accelerator.device  # A1.7 this process's device
    accel_side.check_accelerate_launch(accelerator, recipe)  # all joined; CPU threads, warnings
    return accel_side.AccelProcess(rank, local_rank, world_size, device, accelerator)  # A1.3 with its Accelerator


# ==== data
def build_data(settings: Settings, recipe, process: Process) -> Data:
    # A1.4 download: the node's main process first, the others wait for it
    with process.accelerator.local_main_process_first():  # A1.4
        fetched = download_cifar10(settings.data.data_dir) if process.local_rank == 0 else None  # A1.4
    # beyond R1: all ranks share their load problems (all_gather_object), so all stop together
    train_set, val_set = all_or_none(process.local_rank, load_datasets, settings.data, recipe, process, note=fetched)
    world_size, rank = process.world_size, process.rank
    options = loader_options(train_set, recipe, process)  # workers, pinned memory, their own random stream
    if recipe.data_pipeline == "device":  # A1.5 not here: raw_ddp.py's sampler (prepare() would shard again)
        train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=recipe.seed)
        val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
        train_batches = SkipFirst(BatchSampler(train_sampler, recipe.batch_size, drop_last=True))  # a resume skips
        val_batches = BatchSampler(val_sampler, recipe.eval_batch_size, drop_last=False)
        train_loader = DataLoader(train_set, batch_sampler=train_batches, **options)
        val_loader = DataLoader(val_set, batch_sampler=val_batches, **options)
        steps = len(train_batches.batches)
        return Data(train_set, val_set, train_loader, val_loader, steps, train_sampler, train_batches, val_sampler)
    train_loader = DataLoader(train_set, batch_size=recipe.batch_size, shuffle=True, drop_last=True, **options)
    val_loader = DataLoader(val_set, batch_size=recipe.eval_batch_size, **options)
    # A1.5 prepare(): each loader sharded, rank r gets batches r, r + W, ...
    train_loader, val_loader = process.accelerator.prepare(train_loader, val_loader)  # A1.5
    return Data(train_set, val_set, train_loader, val_loader, len(train_loader))


# ==== model
def build_model(settings: Settings, recipe, process: Process, data: Data) -> Run:
    torch.manual_seed(recipe.seed)  # the same initial weights on every rank
    raw_model = WideResNet(width=settings.model_width)
    if recipe.sync_bn:
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    raw_model = raw_model.to(process.device, memory_format=recipe.memory_format)
    global_batch_size = recipe.batch_size * process.world_size
    optimizer, scheduler, criterion, ema = build_training(recipe, raw_model, global_batch_size, data.steps_per_epoch)
    # A1.8 prepare(): the model in DDP, on its device; its optimizer and schedule wrapped to match
    model, optimizer, scheduler = process.accelerator.prepare(raw_model, optimizer, scheduler)  # A1.8
    raw_model = process.accelerator.unwrap_model(model)  # A1.8
    torch.backends.cudnn.benchmark = recipe.cudnn_benchmark  # each shape's fastest convolutions, timed once
    torch.manual_seed(recipe.seed + process.rank)  # from here on, each rank its own dropout
    show = show_progress(settings, process.is_main)
    return Run(
        recipe, process, data, model, raw_model, optimizer, scheduler, criterion, ema, show, settings.model_width
    )


# ==== train
def train_process(local_rank: int, settings: Settings, recipe) -> None:
    process = setup(local_rank, settings, recipe)  # A1.2, A1.3, A1.7
    # beyond R1: accel_train.py's own checkpoint format, DIR/state-<n> (cifar_wrn/accel_side.py)
    checkpointer = accel_side.AccelCheckpointer(settings.checkpoints.directory, settings.checkpoints.resume)
    try:
        data = build_data(settings, recipe, process)  # A1.4, A1.5
        run = build_model(settings, recipe, process, data)  # A1.8
        if (progress := checkpointer.resume(run)) is None:  # beyond R1: all ranks agree on the checkpoint
            return
        # beyond R1: the run log's launch fields and TensorBoard, Accelerate's
        launch, tracker = accel_side.log_fields(process.accelerator), accel_side.Tracker(process.accelerator)
        watch = start_training(run, progress, settings.logging, launch, tracker, train_step)  # warm-up, log
        for epoch in progress.epochs(recipe):  # until the stopping rule holds or the budget ends
            loader = accel_side.epoch_loader(run.data, epoch, progress.step)  # A1.6: set_epoch, a resume's skip
            watch.start_epoch(progress)
            correct = train_epoch(recipe, run, loader, progress, watch, checkpointer)  # A1.6 this epoch's loader
            # beyond R1 (recipe key bn_recalibration): BatchNorm statistics re-estimated, averaged
            recalibrate_bn(run.network, run.recalibration, run.autocast, average_over_ranks)
            epoch_time = watch.end_epoch()
            progress.cumulative_time += epoch_time
            # ==== evaluate
            metrics = epoch_metrics(run, recipe, progress, epoch_time, correct)  # A1.9 reduced over the ranks
            done = progress.end_epoch(metrics, recipe)
            if run.is_main:  # A1.10 only the main process prints
                print(epoch_line(metrics), flush=True)  # A1.10
            watch.log_epoch(metrics)
            checkpointer.save(run, progress, finished=done)  # beyond R1: save_state on every rank (with a DIR)
        if run.is_main:  # A1.10
            print(final_line(progress, recipe), flush=True)  # A1.10
        # ==== teardown
        if run.is_main and settings.save:
            torch.save(run.network.state_dict(), settings.save)
        watch.close()
    finally:
        accelerator, run, watch, checkpointer = process.accelerator, None, None, None  # DDP's cycle: freed now
        accelerator.free_memory()
        accelerator.end_training()  # A1.3


def train_epoch(recipe, run: Run, loader, progress, watch, checkpointer) -> torch.Tensor:
    """One epoch's training steps (the rest of it, on a resume); returns how many predictions were right."""
    run.model.train()
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    for step, (images, labels) in enumerate(loader, start=progress.step):
        images = images.to(run.device, non_blocking=True, memory_format=run.layout)
        labels = labels.to(run.device, non_blocking=True)
        outputs, loss = train_step(recipe, run, images, labels)
        correct += (outputs.argmax(1) == labels).sum()  # the course's training accuracy
        if watch.step_done(step, loss):  # beyond R1: every few steps, all_reduce of stop/non-finite flags
            checkpointer.save_and_stop(run, progress, step, correct, watch.seconds())
    return correct


def train_step(recipe, run: Run, images: torch.Tensor, labels: torch.Tensor) -> tuple:
    """One training step (the warm-up and --profile take it too); returns the outputs and the loss."""
    with torch.autocast(**run.autocast):
        outputs = run.model(images)
        loss = run.criterion(outputs, labels)
    run.optimizer.zero_grad(set_to_none=True)
    run.process.accelerator.backward(loss)  # A1.8: DDP all-reduces the gradients during the backward
    if recipe.grad_clip_norm:
        run.process.accelerator.clip_grad_norm_(run.model.parameters(), recipe.grad_clip_norm)  # A1.8
    run.optimizer_step()  # optimizer.step(), then the EMA's update where due (optim.build_step)
    run.scheduler.step()
    return outputs, loss


def epoch_metrics(run: Run, recipe, progress, epoch_time: float, correct) -> dict:
    """The numbers of the course's epoch line, the same on every rank."""
    # A1.9 images/sec: each rank's rate, summed by accelerator.reduce (on every rank): the throughputs add up
    rate = run.data.steps_per_epoch * recipe.batch_size / epoch_time
    images_per_sec = torch.tensor([rate], dtype=torch.float64, device=run.device)
    images_per_sec = run.process.accelerator.reduce(images_per_sec, reduction="sum")  # A1.9
    train = training_counts(progress, correct, run.data.steps_per_epoch, recipe.batch_size)  # beyond R1: summed
    val_loss, val_accuracy = validate(run, recipe)  # A1.9
    return {
        "epoch": progress.epoch + 1,
        "cumulative_time": progress.cumulative_time,
        "epoch_time": epoch_time,
        "images_per_sec": images_per_sec.item(),  # A1.9: every rank has the sum
        "train_accuracy": train["train_correct"] / train["train_seen"],  # every rank's images, in train mode
        **train,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
    }


def validate(run: Run, recipe) -> tuple[float, float]:
    """Exact validation loss and accuracy over the whole validation set, the same on every rank."""
    buffers_from_rank_0(run.network)  # beyond R1: broadcast, so every rank evaluates the same statistics
    if run.data.val_mask is None:  # A1.9 gather_for_metrics: every rank's results, the loader's padding dropped
        totals = evaluate_run(run, gather=run.process.accelerator.gather_for_metrics)  # A1.9
        return exact_ratios(totals, 1, run.data.val_images)
    totals = evaluate_run(run)  # this rank's (loss sum, correct, count) over its real images
    average_over_ranks(totals)  # A1.9
    return exact_ratios(totals, run.world_size, run.data.val_images)


def average_over_ranks(tensor: torch.Tensor) -> None:
    """The mean over the ranks, in place (accelerate.utils.reduce: all_reduce, then divide)."""
    tensor.copy_(reduce(tensor, reduction="mean"))  # A1.9


# ==== launch
def run_process(local_rank: int, settings: Settings, recipe) -> None:
    """One rank: train_process, any failure reported as one message and an exit status."""
    report_failures(train_process, local_rank, settings, recipe)


if __name__ == "__main__":
    try:
        settings, recipe = accel_side.resolve_accel_launch(parse_args())  # A1.1: checked before the group forms
    except UserError as exc:  # a bad launch: one line and exit status 2, never a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    # A1.11 the launcher (accelerate launch, torchrun) started one process per GPU: this is one of them
    run_process(int(os.environ.get("LOCAL_RANK", 0)), settings, recipe)  # A1.11
