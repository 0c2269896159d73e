r"""Hand-written PyTorch DDP training of the course WideResNet on CIFAR-10.

The course's DDP steps, each tagged `# R1.<n>` where it happens, and the function that holds it:
    R1.1   the command line: --num-nodes --node-id --num-gpus       parse_args
    R1.2   world size and global rank                               setup
    R1.3   init_process_group: nccl on GPU, gloo on CPU             setup; destroy_process_group: train_process
    R1.4   download on one process per node, then a barrier         build_data
    R1.5   DistributedSampler: a disjoint shard per rank            build_data
    R1.6   set_epoch: a new shuffle every epoch                     train_process
    R1.7   one GPU per process: cuda:<local_rank>                   setup, build_model
    R1.8   DistributedDataParallel                                  build_model, train_epoch
    R1.9   reduce images/sec, all_reduce(AVG) validation            epoch_metrics, validate
    R1.10  only rank 0 prints                                       train_process
    R1.11  torch.multiprocessing.spawn under __main__               __main__
Collectives that are not course steps say `# beyond R1: <why>` where this file calls them; they run in
    cifar_wrn/agreement.py every    errors, stop flags, training counts, BatchNorm buffers
    cifar_wrn/checkpoints.py resume  the checkpoint every rank resumes from (all_gather, Checkpointer.resume)
    cifar_wrn/raw_side.py write    a checkpoint: every rank's random streams and write problems (all_gather)
    cifar_wrn/resilience.py check   the stop flags' all_reduce, every few steps (called by watch.step_done)
    cifar_wrn/bn_recalibration.py recalibrate_bn  average_over_ranks, passed in (recipe key bn_recalibration)
    cifar_wrn/startup.py warm_up    train_step, passed in: DDP's forward and backward (recipe key startup_steps)
    cifar_wrn/startup.py allreduce_cost  train_step, timed with and without DDP's all-reduce (--profile)
and DDP broadcasts rank 0's BatchNorm buffers in each training forward (SyncBatchNorm, recipe key sync_bn,
all-gathers in each one).

    # 1 node x 2 GPUs (installed by pip, from any folder: `python -m raw_ddp` for `python raw_ddp.py`, as below)
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --data-dir data

    # 2 CPU processes (gloo)
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --device cpu --data-dir data \
        --train-subset 2000 --val-subset 1000 --epochs 2

    # 2 nodes x 4 GPUs: only --node-id differs
    python raw_ddp.py --num-nodes 2 --node-id 0 --num-gpus 4 --master-addr node0 --master-port 29500
    python raw_ddp.py --num-nodes 2 --node-id 1 --num-gpus 4 --master-addr node0 --master-port 29500

    # or torchrun
    torchrun --nproc_per_node 2 raw_ddp.py --data-dir data

    # Slurm: the job scripts in slurm/ (docs/slurm.md)

    # the challenge recipe, resumable
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --recipe fast --checkpoint-dir ckpt --auto-resume
"""

# ==== setup
import argparse
import gc
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn import raw_side
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
from cifar_wrn.rendezvous import Launcher, forming_group
from cifar_wrn.resilience import report_failures
from cifar_wrn.run import Data, Process, Run
from cifar_wrn.runlog import epoch_line
from cifar_wrn.stopping import final_line
from cifar_wrn.watch import start_training


def parse_args(argv=None) -> argparse.Namespace:
    # R1.1 the command line: how many nodes, which one this is, how many GPUs (processes) on it
    what = "Hand-written DDP training of the course WideResNet on CIFAR-10."
    p = argparse.ArgumentParser(
        description=what, epilog=launch_commands(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    launch = p.add_argument_group("launch")
    launch.add_argument("--num-nodes", type=int, default=1, help="machines taking part")  # R1.1
    launch.add_argument("--node-id", type=int, default=0, help="this machine's index, 0 .. num-nodes-1")  # R1.1
    launch.add_argument("--num-gpus", type=int, default=1, help="processes on this machine (GPUs or CPU)")  # R1.1
    launch.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="node 0's address ($MASTER_ADDR)")
    launch.add_argument("--master-port", type=int, help="node 0's TCP port ($MASTER_PORT)")
    launch.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA, else CPU")
    launch.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="as --device cpu")
    add_training_flags(p, launch)
    return p.parse_args(argv)


def setup(local_rank: int, settings: Settings, recipe) -> Process:
    # R1.2 world size and global rank: node 0 holds ranks 0 .. num_gpus-1, node 1 the next ones, ...
    world_size = settings.num_nodes * settings.num_gpus  # R1.2
    rank = settings.node_id * settings.num_gpus + local_rank  # R1.2
    # R1.7 cuda:<local_rank>: each process its own GPU, set before any CUDA work
    if settings.device == "cuda":
        torch.cuda.set_device(local_rank)  # R1.7
        device, backend = torch.device(f"cuda:{local_rank}"), "nccl"  # R1.7
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // settings.num_gpus))  # the node's cores, shared
    # R1.3 init_process_group: every rank meets at node 0's address and port, read from the environment (env://)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = settings.master_addr, str(settings.master_port)  # R1.3
    timeout, device_id = timedelta(seconds=settings.dist_timeout), device if backend == "nccl" else None
    # one clear error if not every process joins; store None: env://, one node without a port: the parent's store
    with forming_group(settings, rank, world_size) as store:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
        )  # R1.3
    return Process(rank, local_rank, world_size, device)


# ==== data
def build_data(settings: Settings, recipe, process: Process) -> Data:
    # R1.4 one process per node downloads CIFAR-10; the others wait at the barrier
    fetched = download_cifar10(settings.data.data_dir) if process.local_rank == 0 else None  # R1.4
    dist.barrier()  # R1.4
    # beyond R1: all ranks share their load problems (all_gather_object), so all stop together
    train_set, val_set = all_or_none(process.local_rank, load_datasets, settings.data, recipe, process, note=fetched)
    # R1.5 DistributedSampler: each rank a disjoint 1/world_size of the images, padded to equal length
    world_size, rank = process.world_size, process.rank
    options = loader_options(train_set, recipe, process)  # workers, pinned memory, their own random stream
    train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=recipe.seed)  # R1.5
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)  # R1.5
    train_batches = SkipFirst(BatchSampler(train_sampler, recipe.batch_size, drop_last=True))  # a resume skips
    val_batches = BatchSampler(val_sampler, recipe.eval_batch_size, drop_last=False)
    train_loader = DataLoader(train_set, batch_sampler=train_batches, **options)  # R1.5
    val_loader = DataLoader(val_set, batch_sampler=val_batches, **options)  # R1.5
    steps = len(train_batches.batches)
    return Data(train_set, val_set, train_loader, val_loader, steps, train_sampler, train_batches, val_sampler)


# ==== model
def build_model(settings: Settings, recipe, process: Process, data: Data) -> Run:
    torch.manual_seed(recipe.seed)  # the same initial weights on every rank
    raw_model = WideResNet(width=settings.model_width)
    if recipe.sync_bn:
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    raw_model = raw_model.to(process.device, memory_format=recipe.memory_format)  # R1.7
    # R1.8 DistributedDataParallel: each backward all-reduces the gradients: every rank takes the same step
    device_ids = [process.local_rank] if process.device.type == "cuda" else None  # R1.7
    model = DDP(raw_model, device_ids=device_ids, **recipe.ddp_options)  # R1.8
    if recipe.grad_compression == "bf16":  # recipe key grad_compression: all-reduce in bf16
        model.register_comm_hook(None, bf16_compress_hook)
    global_batch_size = recipe.batch_size * process.world_size
    optimizer, scheduler, criterion, ema = build_training(recipe, raw_model, global_batch_size, data.steps_per_epoch)
    if recipe.compile:
        model = torch.compile(model, mode=recipe.compile_mode)  # the loss: build_training
    torch.backends.cudnn.benchmark = recipe.cudnn_benchmark  # each shape's fastest convolutions, timed once
    torch.manual_seed(recipe.seed + process.rank)  # from here on, each rank its own dropout
    show = show_progress(settings, process.is_main)
    return Run(
        recipe, process, data, model, raw_model, optimizer, scheduler, criterion, ema, show, settings.model_width
    )


# ==== train
def train_process(local_rank: int, settings: Settings, recipe) -> None:
    process = setup(local_rank, settings, recipe)  # R1.2, R1.3, R1.7
    # beyond R1: raw_ddp.py's own checkpoint format, DIR/checkpoint.pt (cifar_wrn/raw_side.py)
    checkpointer = raw_side.RawCheckpointer(settings.checkpoints.directory, settings.checkpoints.resume)
    try:
        data = build_data(settings, recipe, process)  # R1.4, R1.5
        run = build_model(settings, recipe, process, data)  # R1.8
        if (progress := checkpointer.resume(run)) is None:  # beyond R1: all ranks agree on the checkpoint
            return
        # beyond R1: the run log's launch fields and TensorBoard, raw_ddp.py's
        launch, tracker = raw_side.log_fields(settings, process.device), raw_side.TensorBoard
        watch = start_training(run, progress, settings.logging, launch, tracker, train_step)  # warm-up, log
        for epoch in progress.epochs(recipe):  # until the stopping rule holds or the budget ends
            run.data.train_sampler.set_epoch(epoch)  # R1.6 set_epoch: a new shuffle every epoch
            run.data.train_batches.skip = progress.step  # a resumed epoch goes on where it stopped
            run.data.train_set.set_epoch(epoch)  # each image augmented from (seed, epoch, index): resumes exact
            watch.start_epoch(progress)
            correct = train_epoch(recipe, run, run.data.train_loader, progress, watch, checkpointer)
            # beyond R1 (recipe key bn_recalibration): BatchNorm statistics re-estimated, averaged
            recalibrate_bn(run.network, run.recalibration, run.autocast, average_over_ranks)
            epoch_time = watch.end_epoch()
            progress.cumulative_time += epoch_time
            # ==== evaluate
            metrics = epoch_metrics(run, recipe, progress, epoch_time, correct)  # R1.9 reduced over the ranks
            done = progress.end_epoch(metrics, recipe)
            if run.is_main:  # R1.10 only rank 0 prints: one line per epoch, not one per process
                print(epoch_line(metrics), flush=True)  # R1.10
            watch.log_epoch(metrics)
            checkpointer.save(run, progress, finished=done)  # beyond R1: rank 0 gathers, writes (with a DIR)
        if run.is_main:  # R1.10
            print(final_line(progress, recipe), flush=True)  # R1.10
        # ==== teardown
        if run.is_main and settings.save:
            torch.save(run.network.state_dict(), settings.save)
        watch.close()
    finally:
        run = watch = checkpointer = None  # DDP's reference cycle holds the group: collected first, threads end
        gc.collect()
        dist.destroy_process_group()  # R1.3


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
    loss.backward()  # R1.8: DDP all-reduces the gradients during the backward
    if recipe.grad_clip_norm:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), recipe.grad_clip_norm)
    run.optimizer_step()  # optimizer.step(), then the EMA's update where due (optim.build_step)
    run.scheduler.step()
    return outputs, loss


def epoch_metrics(run: Run, recipe, progress, epoch_time: float, correct) -> dict:
    """The numbers of the course's epoch line: the same on every rank, but Images/sec (rank 0's)."""
    # R1.9 images/sec: the ranks' rates add up (dist.reduce SUM to rank 0)
    rate = run.data.steps_per_epoch * recipe.batch_size / epoch_time
    images_per_sec = torch.tensor([rate], dtype=torch.float64, device=run.device)
    dist.reduce(images_per_sec, dst=0, op=dist.ReduceOp.SUM)  # R1.9
    train = training_counts(progress, correct, run.data.steps_per_epoch, recipe.batch_size)  # beyond R1: summed
    val_loss, val_accuracy = validate(run, recipe)  # R1.9
    return {
        "epoch": progress.epoch + 1,
        "cumulative_time": progress.cumulative_time,
        "epoch_time": epoch_time,
        "images_per_sec": images_per_sec.item() if run.is_main else None,  # the sum reached rank 0 only
        "train_accuracy": train["train_correct"] / train["train_seen"],  # every rank's images, in train mode
        **train,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
    }


def validate(run: Run, recipe) -> tuple[float, float]:
    """Exact validation loss and accuracy over the whole validation set, the same on every rank."""
    buffers_from_rank_0(run.network)  # beyond R1: broadcast, so every rank evaluates the same statistics
    totals = evaluate_run(run)  # this rank's (loss sum, correct, count) over its real images
    # R1.9 all_reduce(AVG) of each rank's sums, then the exact ratios
    average_over_ranks(totals)  # R1.9
    return exact_ratios(totals, run.world_size, run.data.val_images)


def average_over_ranks(tensor: torch.Tensor) -> None:
    """dist.all_reduce with ReduceOp.AVG, in place; gloo has AVG only from torch 2.8 on, so before it SUM and divide."""
    if dist.get_backend() == "gloo" and torch.__version__ < "2.8":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # R1.9
        tensor /= dist.get_world_size()
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)  # R1.9


# ==== launch
def run_process(local_rank: int, settings: Settings, recipe) -> None:
    """One rank: train_process, any failure reported as one message and an exit status."""
    report_failures(train_process, local_rank, settings, recipe)


if __name__ == "__main__":
    try:
        settings, recipe = raw_side.resolve_raw_launch(parse_args())  # R1.1: checked before any process starts
    except UserError as exc:  # a bad launch: one line and exit status 2, never a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if settings.torchrun_local_rank is not None:  # torchrun started this process: it is one rank
        run_process(settings.torchrun_local_rank, settings, recipe)
        sys.exit(0)
    launcher = Launcher(settings)  # one node, no port: opens the rendezvous store itself; passes stop signals on
    settings = launcher.settings  # with the store's port
    # R1.11 torch.multiprocessing.spawn: one process per GPU, each runs run_process(local_rank, ...)
    context = mp.spawn(run_process, args=(settings, recipe), nprocs=settings.num_gpus, join=False)  # R1.11
    launcher.wait(context)  # exits as the ranks did
