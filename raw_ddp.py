"""Hand-written PyTorch DDP training of the course WideResNet on CIFAR-10; `# R1.<n>` marks each course step.

    # 1 node x 2 GPUs
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --data-dir data

    # 2 CPU processes (gloo)
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --device cpu --data-dir data \
        --train-subset 2000 --val-subset 1000 --epochs 2

    # 2 nodes x 4 GPUs: only --node-id differs
    python raw_ddp.py --num-nodes 2 --node-id 0 --num-gpus 4 --master-addr node0 --master-port 29500
    python raw_ddp.py --num-nodes 2 --node-id 1 --num-gpus 4 --master-addr node0 --master-port 29500

    # Slurm, one task per node
    srun --ntasks-per-node=1 bash -c 'python raw_ddp.py --num-nodes $SLURM_NNODES --node-id $SLURM_NODEID --num-gpus 4'

    # or torchrun
    torchrun --nproc_per_node 2 raw_ddp.py --data-dir data

    # the challenge recipe, resumable
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --recipe fast --checkpoint-dir ckpt --auto-resume
"""

# ==== setup
import argparse
import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn import checkpoint as ckpt
from cifar_wrn.bars import EpochBar, validation_bar
from cifar_wrn.cli import (
    CPU_FALLBACK_WARNING,
    add_training_flags,
    check_launch,
    launched_by_torchrun,
    port_from_env,
    recipe_from_args,
    show_progress,
)
from cifar_wrn.data import (
    Loaders,
    SkipFirst,
    dataset_present,
    download_cifar10,
    load_splits,
    loader_options,
    require_a_step,
)
from cifar_wrn.ema import build_ema, evaluated_network, recalibrate_bn
from cifar_wrn.errors import AgreedError, UserError, agreed_problem, group_not_formed, run_reporting_failures
from cifar_wrn.evaluation import evaluate, exact_ratios, real_sample_mask
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_training
from cifar_wrn.pipeline import DeviceBatches, make_datasets, recalibration_batches
from cifar_wrn.profiling import PhaseTimer, allreduce_cost, profile_table, synchronized_clock
from cifar_wrn.recipe import as_dict, autocast_options, memory_format, slow_bf16_warning
from cifar_wrn.resilience import StepGuard, install_stop_handlers, pass_on_stop_signals, preempted
from cifar_wrn.runlog import JsonLog, Progress, epoch_line, final_line, open_run_log, run_log_path
from cifar_wrn.startup import warm_up


def parse_args(argv=None) -> argparse.Namespace:  # R1.1
    p = argparse.ArgumentParser(description="Hand-written DDP training of the course WideResNet on CIFAR-10.")
    p.add_argument("--num-nodes", type=int, default=1, help="machines taking part (default 1)")
    p.add_argument("--node-id", type=int, default=0, help="this machine's index, 0 .. num-nodes-1 (default 0)")
    p.add_argument("--num-gpus", type=int, default=1, help="processes on this machine: one per GPU (default 1)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="node 0's address ($MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=port_from_env(), help="node 0's TCP port ($MASTER_PORT)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA, else CPU + warning")
    p.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="as --device cpu (accel_train.py's)")
    add_training_flags(p)
    p.set_defaults(launcher_store=False)
    return p.parse_args(argv)


def world_size_and_rank(num_nodes: int, num_gpus: int, node_id: int, local_rank: int) -> tuple[int, int]:
    world_size = num_nodes * num_gpus  # R1.2
    rank = node_id * num_gpus + local_rank  # R1.2
    return world_size, rank


def join_process_group(local_rank: int, args) -> tuple[int, int, torch.device]:
    world_size, rank = world_size_and_rank(args.num_nodes, args.num_gpus, args.node_id, local_rank)  # R1.2
    # R1.7: pin to one GPU before any CUDA work
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)  # R1.7
        device, backend = torch.device(f"cuda:{local_rank}"), "nccl"  # R1.7
    else:
        device, backend = torch.device("cpu"), "gloo"  # R1.7
        # the node's processes share its cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.num_gpus))
    import torch._dynamo as _  # noqa: F401  now, before the group: imported later it can abort the exit

    # R1.3: every rank meets at node 0's address and port (through the launcher's store when it holds one)
    timeout = timedelta(seconds=args.dist_timeout)
    try:
        if launched_by_torchrun():
            meet = dict(init_method="env://")
        elif args.launcher_store:
            meet = dict(store=dist.TCPStore(args.master_addr, args.master_port, world_size, False, timeout=timeout))
        else:
            meet = dict(init_method=f"tcp://{args.master_addr}:{args.master_port}")
        meet["device_id"] = device if backend == "nccl" else None  # NCCL: connect eagerly, to this GPU
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **meet)  # R1.3
    except dist.DistError as exc:
        where = f"{os.environ.get('MASTER_ADDR', args.master_addr)}:{os.environ.get('MASTER_PORT', args.master_port)}"
        hint = "Start every node with the same --num-nodes, --num-gpus, --master-addr and --master-port."
        raise group_not_formed(f"rank {rank}: ", where, world_size, args.dist_timeout, exc, hint) from None
    return rank, world_size, device


# ==== data
def build_data(args, recipe, rank: int, world_size: int, local_rank: int, device) -> Loaders:
    # R1.4: one process per node downloads, the others wait
    fetched = download_cifar10(args.data_dir) if local_rank == 0 and not dataset_present(args.data_dir) else None
    dist.barrier()  # R1.4
    train_data, val_data, problem = load_splits(args.data_dir, args.train_subset, args.val_subset)
    # stop together, or the others wait until --dist-timeout
    problems = [None] * world_size
    dist.all_gather_object(problems, problem and f"node {args.node_id}: {problem}")
    if agreed_problem(problems):
        raise AgreedError(agreed_problem(problems), local_rank == 0, fetched)
    train_set, val_set = make_datasets(train_data, val_data, recipe, device, rank)
    # R1.5: disjoint shards, padded to the same number of steps
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=recipe.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_batches = SkipFirst(BatchSampler(train_sampler, recipe.batch_size, drop_last=True))
    val_batches = BatchSampler(val_sampler, recipe.eval_batch_size, drop_last=False)
    options = loader_options(recipe, device, rank)
    if recipe.data_pipeline == "device":
        train_loader = DataLoader(train_set, batch_size=None, sampler=train_batches, **options)  # R1.5
        val_loader = DataLoader(val_set, batch_size=None, sampler=val_batches, **options)  # R1.5
    else:
        train_loader = DataLoader(train_set, batch_sampler=train_batches, **options)  # R1.5
        val_loader = DataLoader(val_set, batch_sampler=val_batches, **options)  # R1.5
    steps = len(train_batches.batches)
    require_a_step(steps, len(train_set), world_size, recipe.batch_size)
    recalibration = recalibration_batches(train_set, recipe, rank, world_size, device)
    loaders = (train_set, train_loader, val_loader, len(val_set), steps, train_sampler, train_batches)
    return Loaders(*loaders, real_sample_mask(val_sampler), recalibration)


# ==== model
def build_model(args, recipe, rank: int, local_rank: int, device):
    """The DDP model, the WideResNet inside it, and the model evaluated and saved."""
    torch.manual_seed(recipe.seed)
    raw_model = WideResNet(width=args.model_width)
    if recipe.sync_bn:
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    raw_model = raw_model.to(device, memory_format=memory_format(recipe))
    torch.backends.cudnn.benchmark = recipe.cudnn_benchmark
    # R1.8: DDP averages the gradients over all ranks during backward
    model = DDP(
        raw_model,
        device_ids=[local_rank] if device.type == "cuda" else None,  # R1.8
        gradient_as_bucket_view=recipe.ddp_bucket_view,
        static_graph=recipe.ddp_static_graph,
    )
    if recipe.grad_compression == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    eval_model = raw_model if recipe.ema_decay == 0 else build_ema(raw_model, recipe.ema_decay)
    if recipe.compile:
        model = torch.compile(model)
    torch.manual_seed(recipe.seed + rank)  # from here on, each rank augments differently
    return model, raw_model, eval_model


# ==== train
@dataclass
class TrainingRun:  # one rank's training objects: what the loop and a checkpoint use
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module  # DDP(raw_model)
    raw_model: torch.nn.Module
    eval_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    criterion: torch.nn.Module
    data: Loaders


def train_process(local_rank: int, args: argparse.Namespace, recipe) -> None:
    install_stop_handlers()
    rank, world_size, device = join_process_group(local_rank, args)  # R1.2, R1.3, R1.7
    is_main, show = rank == 0, show_progress(args, rank == 0)
    try:
        data = build_data(args, recipe, rank, world_size, local_rank, device)  # R1.4, R1.5
        model, raw_model, eval_model = build_model(args, recipe, rank, local_rank, device)  # R1.8
        global_batch_size = recipe.batch_size * world_size  # per_device_batch_size x world_size
        lr, optimizer, scheduler, criterion = build_training(raw_model, recipe, global_batch_size, data.steps_per_epoch)
        autocast = autocast_options(recipe, device)
        run = TrainingRun(rank, world_size, device, model, raw_model, eval_model, optimizer, scheduler, criterion, data)
        if (progress := resume(args, recipe, run)) is None:
            return
        # before the clock, then undone: kernels, autotuning, DDP's buckets; DDP all-reduces in it
        startup = warm_up(model, raw_model, eval_model, optimizer, scheduler, criterion, recipe, device, autocast)
        log = open_log(args, recipe, run, lr, progress, startup)
        guard = StepGuard(rank, world_size, device)
        timer = PhaseTimer(device, enabled=args.profile, trace_dir=args.trace, rank=rank)
        done = False
        for epoch in progress.epochs(recipe):
            data.train_sampler.set_epoch(epoch)  # R1.6: a new shuffle each epoch
            data.train_batches.skip = progress.step
            t0 = timer.start(device)
            bar = EpochBar(show, epoch + 1, data.steps_per_epoch, progress.step, global_batch_size)
            correct, last = train_epoch(args, recipe, run, data.train_loader, progress, epoch, guard, timer, t0, bar)
            recalibrate_bn(eval_model, data.recalibration, autocast, average_over_ranks)
            epoch_time = progress.epoch_time_so_far + synchronized_clock(device) - t0
            progress.cumulative_time += epoch_time
            profile = timer.totals()
            comm = allreduce_estimate(args, recipe, run, last, steps_run=data.steps_per_epoch - progress.step)
            # ==== evaluate
            metrics = epoch_metrics(run, recipe, progress, epoch, epoch_time, correct, show)  # R1.9
            done = progress.end_epoch(metrics, recipe)
            if is_main:  # R1.10: only rank 0 prints
                print(epoch_line(metrics), flush=True)  # R1.10
                if args.profile:
                    print(profile_table(profile, epoch_time, comm, epoch + 1), flush=True)
            log.write({"kind": "epoch", **metrics, **({"profile": profile, "comm_estimate": comm} if profile else {})})
            if args.checkpoint_dir:
                save_checkpoint(args, recipe, run, progress, finished=done)
            if done:
                break
        if is_main:  # R1.10
            print(final_line(progress, recipe, done), flush=True)
        # ==== teardown
        if is_main and args.save:
            torch.save(evaluated_network(eval_model).state_dict(), args.save)
        log.close()
    finally:
        model = run = None  # DDP sits in a reference cycle holding the group: collected now, its threads end first
        gc.collect()
        dist.destroy_process_group()  # R1.3


def train_epoch(args, recipe, run: TrainingRun, loader, progress: Progress, epoch: int, guard, timer, t0: float, bar):
    """One epoch's steps (the rest of it on a resume); returns the right predictions and the last batch."""
    model, optimizer, data, device = run.model, run.optimizer, run.data, run.device
    autocast, layout = autocast_options(recipe, device), memory_format(recipe)
    model.train()
    train_correct = torch.zeros((), dtype=torch.int64, device=device)
    images = labels = None
    for step, (images, labels) in enumerate(loader, start=progress.step):
        images = images.to(device, non_blocking=True, memory_format=layout)
        labels = labels.to(device, non_blocking=True)
        timer.mark("data")
        with torch.autocast(**autocast):
            outputs = model(images)
            loss = run.criterion(outputs, labels)
        train_correct += (outputs.argmax(1) == labels).sum()  # the course's training accuracy
        timer.mark("forward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here
        timer.mark("backward")
        if recipe.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm)
        optimizer.step()
        timer.mark("optimizer")
        run.scheduler.step()
        if run.eval_model is not run.raw_model:
            run.eval_model.update_parameters(run.raw_model)
        # a stop signal or a non-finite loss on any rank stops every rank at this step
        if guard.check(loss, epoch, step, data.steps_per_epoch, lambda f: dist.all_reduce(f, op=dist.ReduceOp.MAX)):
            seconds = progress.epoch_time_so_far + synchronized_clock(device) - t0
            counts = training_counts(progress, train_correct, step + 1, recipe)
            at = progress.mid_epoch(step + 1, seconds, **counts)
            raise preempted(epoch, step, args.checkpoint_dir and save_checkpoint(args, recipe, run, at))
        bar.step(loss)
        timer.mark("other")
    bar.close()
    return train_correct, (images, labels)


def epoch_metrics(run: TrainingRun, recipe, progress: Progress, epoch: int, epoch_time: float, train_correct, show):
    """The numbers of the course's epoch line (the same on every rank, but Images/sec: rank 0's)."""
    data, device = run.data, run.device
    rate = data.steps_per_epoch * recipe.batch_size / epoch_time
    images_per_sec = torch.tensor([rate], dtype=torch.float64, device=device)
    dist.reduce(images_per_sec, dst=0, op=dist.ReduceOp.SUM)  # R1.9: throughputs add up
    train = training_counts(progress, train_correct, data.steps_per_epoch, recipe)
    val_loss, val_accuracy = validate(run.eval_model, data, device, recipe, show)  # R1.9
    return {
        "epoch": epoch + 1,
        "cumulative_time": progress.cumulative_time,
        "epoch_time": epoch_time,
        "images_per_sec": images_per_sec.item() if run.rank == 0 else None,  # the sum reached rank 0 only
        "train_accuracy": train["train_correct"] / train["train_seen"],  # every rank's images, in train mode
        **train,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
    }


# ==== helpers
def validate(eval_model, data: Loaders, device, recipe, show: bool) -> tuple[float, float]:
    """Exact validation loss and accuracy, the same on every rank."""
    # BatchNorm buffers end a step apart: take rank 0's
    for buffer in evaluated_network(eval_model).buffers():
        dist.broadcast(buffer, src=0)
    dtype = torch.bfloat16 if recipe.precision == "bf16" else None
    totals = evaluate(eval_model, validation_bar(show, data.val_loader), data.val_mask, device, dtype, recipe.tta_flip)
    # R1.9: the mean over ranks of each rank's (loss sum, correct, count)
    average_over_ranks(totals)  # R1.9
    return exact_ratios(totals, dist.get_world_size())


def average_over_ranks(tensor: torch.Tensor) -> None:
    """dist.all_reduce with ReduceOp.AVG, in place; gloo has AVG only from torch 2.8 on, so before it SUM and divide."""
    if dist.get_backend() == "gloo" and torch.__version__ < "2.8":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)  # R1.9


def training_counts(progress: Progress, correct: torch.Tensor, step_end: int, recipe) -> dict:
    """This epoch's training images to `step_end`, every rank's (a resumed part included), and those right."""
    images = (step_end - progress.step) * recipe.batch_size
    counts = torch.stack([correct, torch.tensor(images, device=correct.device)])
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, images = counts.tolist()
    return {"train_correct": progress.train_correct + correct, "train_seen": progress.train_seen + images}


def allreduce_estimate(args, recipe, run: TrainingRun, last_batch, steps_run: int) -> float:
    """--profile: the seconds DDP's all-reduce added to this epoch, timed again on its last batch."""
    if not (args.profile and steps_run):
        return 0.0
    images, labels = last_batch
    forward = torch.autocast(**autocast_options(recipe, run.device))(lambda: run.criterion(run.model(images), labels))
    backward, model = lambda loss: loss.backward(), run.model
    return steps_run * allreduce_cost(forward, backward, model.no_sync, model.zero_grad, run.raw_model, run.device)


def open_log(args, recipe, run: TrainingRun, lr: float, progress: Progress, startup: float) -> JsonLog:
    path = run_log_path(args.log_json, args.recipe, f"{args.num_nodes}x{args.num_gpus}") if run.rank == 0 else None
    launch = dict(num_nodes=args.num_nodes, num_gpus=args.num_gpus, backend=dist.get_backend(), device=run.device.type)
    launch.update(launcher="torchrun" if launched_by_torchrun() else "mp.spawn", startup_seconds=startup)
    return open_run_log(path, progress, run.data, run.raw_model, recipe, lr, run.world_size, args.model_width, **launch)


# ==== checkpoint
def resume(args, recipe, run: TrainingRun) -> Progress | None:
    """Where this run starts (None: it had finished); all ranks agree on the checkpoint."""
    rank, world_size, data = run.rank, run.world_size, run.data
    if not (args.resume or args.auto_resume):
        return Progress()
    saved, problem = ckpt.read_for_resume(args.checkpoint_dir, required=args.resume)
    if saved is not None:
        problem = ckpt.resume_problem(saved, as_dict(recipe), world_size, args.model_width, data.sizes())
        problem = problem or ckpt.attempt(ckpt.restore_raw, saved, run)
    seen = [None] * world_size
    dist.all_gather_object(seen, (ckpt.what_was_seen(saved), problem))
    problem = ckpt.resume_disagreement(seen)
    if problem:
        raise UserError(f"cannot resume from {ckpt.checkpoint_path(args.checkpoint_dir)}: {problem}")
    if saved is None:
        return Progress()
    progress = Progress.of(saved)
    if rank == 0:
        where = ckpt.checkpoint_path(args.checkpoint_dir)
        print(ckpt.resuming_line(where, progress, data.steps_per_epoch, saved["finished"]), flush=True)
    return None if saved["finished"] else progress


def save_checkpoint(args, recipe, run: TrainingRun, progress: Progress, finished: bool = False) -> str:
    """Rank 0 writes everything needed to continue at `progress`; all ranks wait for it."""
    generator = run.data.train_set.generator if isinstance(run.data.train_set, DeviceBatches) else None
    every_rng = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(ckpt.rank_rng(run.device, generator), every_rng, dst=0)  # each rank's random streams
    path, problem = ckpt.checkpoint_path(args.checkpoint_dir), None
    if run.rank == 0:
        state = ckpt.raw_state(run, progress, finished, every_rng, as_dict(recipe), args.model_width)
        problem = ckpt.attempt(ckpt.save_atomic, state, path)
    outcome = [problem]
    dist.broadcast_object_list(outcome, src=0)  # also the barrier
    ckpt.stop_unless_written(outcome, args.checkpoint_dir)
    return str(path)


# ==== launch
def resolve(args) -> tuple[argparse.Namespace, object]:
    """Fill in what the launch implies, check it, read the recipe."""
    recipe = recipe_from_args(args)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    node_main = os.environ.get("LOCAL_RANK", "0") == "0"
    if args.device == "auto":
        if cuda_count == 0 and node_main:
            print(CPU_FALLBACK_WARNING, file=sys.stderr)
        args.device = "cuda" if cuda_count else "cpu"
    if launched_by_torchrun():
        args.num_gpus = int(os.environ["LOCAL_WORLD_SIZE"])
        args.num_nodes = int(os.environ["WORLD_SIZE"]) // args.num_gpus
        args.node_id = int(os.environ["RANK"]) // args.num_gpus
        args.master_port = int(os.environ.get("MASTER_PORT", 0)) or None
    elif args.num_nodes == 1:
        args.master_addr = args.master_addr or "127.0.0.1"
    check_launch(args, cuda_count)  # R1.1
    if (warning := slow_bf16_warning(args.device, recipe.precision)) and node_main:
        print(warning, file=sys.stderr)
    if recipe.sync_bn and args.device == "cpu":
        raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
    return args, recipe


def run_process(local_rank: int, args, recipe) -> None:
    _, rank = world_size_and_rank(args.num_nodes, args.num_gpus, args.node_id, local_rank)
    run_reporting_failures(
        lambda: train_process(local_rank, args, recipe), rank, (dist.DistBackendError, dist.DistNetworkError)
    )


if __name__ == "__main__":
    try:
        args, recipe = resolve(parse_args())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if launched_by_torchrun():
        run_process(int(os.environ["LOCAL_RANK"]), args, recipe)
        sys.exit(0)
    # R1.11: one process per GPU; stop signals are passed on as SIGUSR1
    ranks = []
    pass_on_stop_signals(ranks)
    # R1.3: one node, no port: hold the store here, on a port nothing can take first
    args.launcher_store = args.master_port is None
    if args.launcher_store:
        store = dist.TCPStore(args.master_addr, 0, is_master=True, wait_for_workers=False)  # R1.3
        args.master_port = store.port
    try:
        context = mp.spawn(run_process, args=(args, recipe), nprocs=args.num_gpus, join=False)  # R1.11
        ranks.extend(context.processes)
        while not context.join(grace_period=10):
            pass
    except mp.ProcessExitedException as exc:
        if exc.signal_name:  # killed: it could not report itself
            _, failed = world_size_and_rank(args.num_nodes, args.num_gpus, args.node_id, exc.error_index)
            print(f"error: rank {failed} was killed by {exc.signal_name}", file=sys.stderr)
        sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)
