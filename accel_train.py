"""Hugging Face Accelerate version of raw_ddp.py, section by section; `# A1.<n>` marks what replaces `# R1.<n>` there.

    # 1 node x 2 GPUs
    accelerate launch --config_file accelerate_configs/two_gpus.yaml accel_train.py --data-dir data

    # 2 nodes x 4 GPUs: only --machine_rank differs
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank 0 --main_process_ip node0 \
        --main_process_port 29500 accel_train.py --data-dir data

    # Slurm, one task per node
    srun --ntasks-per-node=1 bash -c 'accelerate launch --config_file accelerate_configs/multi_node.yaml \
        --machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
        accel_train.py --data-dir data'

    # 2 CPU processes (gloo)
    accelerate launch --config_file accelerate_configs/two_cpus.yaml accel_train.py --device cpu --data-dir data \
        --train-subset 2000 --val-subset 1000 --epochs 2
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 accel_train.py ...
    python accel_train.py --data-dir data                                  # 1 process, no launcher

Preemption: SIGTERM to `accelerate launch` (SIGUSR1 kills its agent), or SIGUSR1 to the ranks.
"""

# ==== setup
import argparse
import dataclasses
import os
import sys
from datetime import timedelta

import accelerate
import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.utils import DDPCommunicationHookType, broadcast, gather_object, parse_flag_from_env, set_seed
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn import checkpoint as ckpt
from cifar_wrn.bars import EpochBar, validation_bar
from cifar_wrn.cli import (
    CPU_FALLBACK_WARNING,
    NO_CUDA,
    accelerate_launch_problem,
    add_training_flags,
    check_training_flags,
    launcher_name,
    launcher_world_size,
    local_world_size,
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
from cifar_wrn.evaluation import evaluate, real_sample_mask
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_training
from cifar_wrn.pipeline import make_datasets, recalibration_batches
from cifar_wrn.profiling import PhaseTimer, allreduce_cost, profile_table, synchronized_clock
from cifar_wrn.recipe import as_dict, autocast_options, memory_format, slow_bf16_warning
from cifar_wrn.resilience import StepGuard, install_stop_handlers, preempted
from cifar_wrn.runlog import JsonLog, Progress, epoch_line, final_line, open_run_log, run_log_path
from cifar_wrn.startup import warm_up


def parse_args(argv=None) -> argparse.Namespace:  # A1.1
    what = "Accelerate training of the course WideResNet on CIFAR-10; processes and nodes: the launcher's config."
    p = argparse.ArgumentParser(description=what)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (gloo) even where CUDA exists")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="as raw_ddp.py's")
    add_training_flags(p)
    args = p.parse_args(argv)
    # auto without CUDA: the CPU, after a warning
    args.cpu_fallback = args.device == "auto" and not args.cpu and not torch.cuda.is_available()
    args.cpu |= args.device == "cpu" or args.cpu_fallback
    return args


def join_process_group(args, recipe) -> tuple[Accelerator, int, int, torch.device]:
    """A1.2 + A1.3 + A1.7: Accelerator() joins the launcher's group and picks the device."""
    import torch._dynamo as _  # noqa: F401  (as in raw_ddp.py)

    # A1.5 + A1.6: the same shuffle on every rank, a new one each epoch
    loading = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.seed, non_blocking=True)
    hook = DDPCommunicationHookType.BF16 if recipe.grad_compression == "bf16" else DDPCommunicationHookType.NO
    ddp = dict(gradient_as_bucket_view=recipe.ddp_bucket_view, static_graph=recipe.ddp_static_graph, comm_hook=hook)
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout))  # A1.3
    try:
        accelerator = Accelerator(
            cpu=args.cpu,
            mixed_precision="bf16" if recipe.precision == "bf16" else "no",
            dataloader_config=loading,
            step_scheduler_with_optimizer=False,  # the schedule counts one process's steps
            dynamo_backend="inductor" if recipe.compile else "no",
            kwargs_handlers=[DistributedDataParallelKwargs(**ddp), group],  # A1.8, A1.3
        )
    except dist.DistError as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        hint = "Start every node with the same config, --main_process_ip and --main_process_port."
        raise group_not_formed("", where, launcher_world_size(), args.dist_timeout, exc, hint) from None
    device, world_size = accelerator.device, accelerator.num_processes
    problem = accelerate_launch_problem(
        world_size, accelerator.distributed_type.value, device.type, accelerate.__version__
    )
    if problem:
        raise AgreedError(problem, os.environ.get("LOCAL_RANK", "0") == "0")
    if device.type == "cpu":
        # the node's processes share its cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size(world_size)))
        if args.cpu_fallback and not parse_flag_from_env("ACCELERATE_USE_CPU"):
            accelerator.print(CPU_FALLBACK_WARNING, file=sys.stderr)
        if warning := slow_bf16_warning(device.type, recipe.precision):
            accelerator.print(warning, file=sys.stderr)
        if recipe.sync_bn:
            raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
    return accelerator, accelerator.process_index, world_size, device


# ==== data
def build_data(args, recipe, accelerator, rank: int, world_size: int, device) -> Loaders:
    # A1.4: one process per node downloads, the others wait
    with accelerator.local_main_process_first():
        downloads = accelerator.is_local_main_process and not dataset_present(args.data_dir)
        fetched = download_cifar10(args.data_dir) if downloads else None
    train_data, val_data, problem = load_splits(args.data_dir, args.train_subset, args.val_subset)
    # stop together, or the others wait until --dist-timeout
    problems = gather_object([problem and f"node {rank // local_world_size(accelerator.num_processes)}: {problem}"])
    if agreed_problem(problems):
        raise AgreedError(agreed_problem(problems), accelerator.is_local_main_process, fetched)
    train_set, val_set = make_datasets(train_data, val_data, recipe, device, rank)
    options = loader_options(recipe, device, rank)
    if recipe.data_pipeline == "device":
        # not prepared: prepare() would shard these already sharded batches again
        train_sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=recipe.seed)
        val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
        train_batches = SkipFirst(BatchSampler(train_sampler, recipe.batch_size, drop_last=True))
        val_batches = BatchSampler(val_sampler, recipe.eval_batch_size, drop_last=False)
        train_loader = DataLoader(train_set, batch_size=None, sampler=train_batches, **options)  # A1.5
        val_loader = DataLoader(val_set, batch_size=None, sampler=val_batches, **options)
        loaders = (train_set, train_loader, val_loader, len(val_set), len(train_batches.batches), train_sampler)
        data = Loaders(*loaders, train_batches, real_sample_mask(val_sampler))
    else:
        train_loader = DataLoader(train_set, batch_size=recipe.batch_size, shuffle=True, drop_last=True, **options)
        val_loader = DataLoader(val_set, batch_size=recipe.eval_batch_size, **options)
        # A1.5: rank r gets batches r, r + W, ...
        train_loader, val_loader = accelerator.prepare(train_loader, val_loader)  # A1.5
        data = Loaders(train_set, train_loader, val_loader, len(val_set), len(train_loader))
    require_a_step(data.steps_per_epoch, len(train_set), world_size, recipe.batch_size)
    data.recalibration = recalibration_batches(train_set, recipe, rank, world_size, device)
    return data


# ==== model
def build_model(args, recipe, accelerator, device):
    """The DDP model, the WideResNet inside it, and the model evaluated and saved."""
    set_seed(recipe.seed)
    model = WideResNet(width=args.model_width)
    if recipe.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=memory_format(recipe))
    torch.backends.cudnn.benchmark = recipe.cudnn_benchmark
    # before prepare(): a plain WideResNet copy
    ema_model = None if recipe.ema_decay == 0 else build_ema(model, recipe.ema_decay)
    # A1.7 + A1.8: to the device, in DDP
    model = accelerator.prepare(model)  # A1.8
    raw_model = accelerator.unwrap_model(model)
    set_seed(recipe.seed, device_specific=True)  # from here on, each rank augments differently
    return model, raw_model, ema_model or raw_model


# ==== train
@dataclasses.dataclass
class TrainingRun:  # one rank's training objects: what the loop and a checkpoint use
    rank: int
    world_size: int
    device: torch.device
    accelerator: Accelerator
    model: torch.nn.Module  # DDP(raw_model), prepared
    raw_model: torch.nn.Module
    eval_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    criterion: torch.nn.Module
    data: Loaders


def train_process(args: argparse.Namespace, recipe) -> None:
    install_stop_handlers()
    accelerator, rank, world_size, device = join_process_group(args, recipe)  # A1.2, A1.3, A1.7
    is_main, show = rank == 0, show_progress(args, rank == 0)
    try:
        data = build_data(args, recipe, accelerator, rank, world_size, device)  # A1.4, A1.5
        model, raw_model, eval_model = build_model(args, recipe, accelerator, device)  # A1.8
        global_batch_size = recipe.batch_size * world_size  # per_device_batch_size x world_size
        lr, optimizer, scheduler, criterion = build_training(raw_model, recipe, global_batch_size, data.steps_per_epoch)
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)  # A1.8
        autocast = autocast_options(recipe, device)
        run = TrainingRun(
            rank, world_size, device, accelerator, model, raw_model, eval_model, optimizer, scheduler, criterion, data
        )
        if (progress := resume(args, recipe, run)) is None:
            return
        # before the clock, then undone; DDP all-reduces in it
        startup = warm_up(model, raw_model, eval_model, optimizer, scheduler, criterion, recipe, device, autocast)
        log = open_log(args, recipe, run, lr, progress, startup)
        guard = StepGuard(rank, world_size, device)
        timer = PhaseTimer(device, enabled=args.profile, trace_dir=args.trace, rank=rank)
        done = False
        for epoch in progress.epochs(recipe):
            epoch_loader = epoch_batches(accelerator, data, epoch, progress.step)  # A1.6: a new shuffle each epoch
            t0 = timer.start(device)
            bar = EpochBar(show, epoch + 1, data.steps_per_epoch, progress.step, global_batch_size)
            correct, last = train_epoch(args, recipe, run, epoch_loader, progress, epoch, guard, timer, t0, bar)
            recalibrate_bn(eval_model, data.recalibration, autocast, lambda t: t.copy_(accelerator.reduce(t, "mean")))
            epoch_time = progress.epoch_time_so_far + synchronized_clock(device) - t0
            progress.cumulative_time += epoch_time
            profile = timer.totals()
            comm = allreduce_estimate(args, run, last, steps_run=data.steps_per_epoch - progress.step)
            # ==== evaluate
            metrics = epoch_metrics(run, recipe, progress, epoch, epoch_time, correct, show)  # A1.9
            done = progress.end_epoch(metrics, recipe)
            if is_main:  # A1.10
                print(epoch_line(metrics), flush=True)  # A1.10
                if args.profile:
                    print(profile_table(profile, epoch_time, comm, epoch + 1), flush=True)
            log.write({"kind": "epoch", **metrics, **({"profile": profile, "comm_estimate": comm} if profile else {})})
            if args.checkpoint_dir:
                save_checkpoint(args, recipe, run, progress, finished=done)
            if done:
                break
        if is_main:  # A1.10
            print(final_line(progress, recipe, done), flush=True)
        # ==== teardown
        if args.save:  # main process only
            accelerator.save(evaluated_network(eval_model).state_dict(), args.save)
        log.close()
    finally:
        model = run = None  # DDP's reference cycle holds the group: freed now, before the exit
        accelerator.free_memory()
        accelerator.end_training()  # A1.3


def train_epoch(args, recipe, run: TrainingRun, loader, progress: Progress, epoch: int, guard, timer, t0: float, bar):
    """One epoch's steps (the rest of it on a resume); returns the right predictions and the last batch."""
    accelerator, model, optimizer, data, device = run.accelerator, run.model, run.optimizer, run.data, run.device
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
        accelerator.backward(loss)  # DDP all-reduces the gradients here
        timer.mark("backward")
        if recipe.grad_clip_norm:
            accelerator.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm)
        optimizer.step()
        timer.mark("optimizer")
        run.scheduler.step()
        if run.eval_model is not run.raw_model:
            run.eval_model.update_parameters(run.raw_model)
        # a stop signal or a non-finite loss on any rank stops every rank at this step
        if guard.check(loss, epoch, step, data.steps_per_epoch, lambda f: accelerator.reduce(f, reduction="sum")):
            seconds = progress.epoch_time_so_far + synchronized_clock(device) - t0
            counts = training_counts(accelerator, progress, train_correct, step + 1, recipe)
            at = progress.mid_epoch(step + 1, seconds, **counts)
            raise preempted(epoch, step, args.checkpoint_dir and save_checkpoint(args, recipe, run, at))
        bar.step(loss)
        timer.mark("other")
    bar.close()
    return train_correct, (images, labels)


def epoch_metrics(run: TrainingRun, recipe, progress: Progress, epoch: int, epoch_time: float, train_correct, show):
    """The course's epoch line's numbers."""
    accelerator, data, device = run.accelerator, run.data, run.device
    rate = data.steps_per_epoch * recipe.batch_size / epoch_time
    images_per_sec = torch.tensor([rate], dtype=torch.float64, device=device)
    images_per_sec = accelerator.reduce(images_per_sec, reduction="sum")  # A1.9: throughputs add up
    train = training_counts(accelerator, progress, train_correct, data.steps_per_epoch, recipe)
    val_loss, val_accuracy = validate(accelerator, run.eval_model, data, device, recipe, show)  # A1.9
    return {
        "epoch": epoch + 1,
        "cumulative_time": progress.cumulative_time,
        "epoch_time": epoch_time,
        "images_per_sec": images_per_sec.item(),
        "train_accuracy": train["train_correct"] / train["train_seen"],
        **train,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
    }


# ==== helpers
def validate(accelerator, eval_model, data: Loaders, device, recipe, show: bool) -> tuple[float, float]:
    """Exact validation loss and accuracy, the same on every rank."""
    # BatchNorm buffers end a step apart: take rank 0's
    broadcast(list(evaluated_network(eval_model).buffers()), from_process=0)
    dtype = torch.bfloat16 if recipe.precision == "bf16" else None  # the EMA copy does not autocast
    # A1.9: sums over real images, or every rank's batches gathered
    bar, gather = validation_bar(show, data.val_loader), accelerator.gather_for_metrics
    gather = None if data.val_mask is not None else gather
    totals = evaluate(eval_model, bar, data.val_mask, device, dtype, recipe.tta_flip, gather=gather)  # A1.9
    if data.val_mask is not None:
        totals = accelerator.reduce(totals, reduction="sum")  # A1.9
    if round(totals[2].item()) != data.val_images:
        raise RuntimeError(f"validation counted {totals[2].item()} images, expected {data.val_images}")
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def training_counts(accelerator, progress: Progress, correct: torch.Tensor, step_end: int, recipe) -> dict:
    """This epoch's training images to `step_end`, every rank's (a resumed part included), and those right."""
    images = (step_end - progress.step) * recipe.batch_size
    counts = torch.stack([correct, torch.tensor(images, device=correct.device)])
    correct, images = accelerator.reduce(counts, reduction="sum").tolist()
    return {"train_correct": progress.train_correct + correct, "train_seen": progress.train_seen + images}


def epoch_batches(accelerator, data: Loaders, epoch: int, skip: int):
    """This epoch's batches, less the `skip` already trained."""
    if data.train_sampler is not None:
        data.train_sampler.set_epoch(epoch)
        data.train_batches.skip = skip
        return data.train_loader
    # A1.6: seed + epoch (the loader's own count restarts at 0 on resume)
    data.train_loader.set_epoch(epoch)
    return accelerator.skip_first_batches(data.train_loader, skip) if skip else data.train_loader


def allreduce_estimate(args, run: TrainingRun, last_batch, steps_run: int) -> float:
    """--profile: the seconds DDP's all-reduce added to this epoch, timed again on its last batch."""
    if not (args.profile and steps_run):
        return 0.0
    (images, labels), accelerator, model = last_batch, run.accelerator, run.model
    forward = lambda: run.criterion(model(images), labels)  # prepare() autocasts
    no_sync = lambda: accelerator.no_sync(model)
    backward = accelerator.backward
    return steps_run * allreduce_cost(forward, backward, no_sync, model.zero_grad, run.raw_model, run.device)


def open_log(args, recipe, run: TrainingRun, lr: float, progress: Progress, startup: float) -> JsonLog:
    accelerator, is_main = run.accelerator, run.accelerator.is_main_process
    per_node = local_world_size(accelerator.num_processes)
    num_nodes = accelerator.num_processes // per_node
    path = run_log_path(args.log_json, args.recipe, f"{num_nodes}x{per_node}", prefix="accel-") if is_main else None
    launch = dict(startup_seconds=startup, num_gpus=per_node, num_nodes=num_nodes, device=accelerator.device.type)
    launch.update(backend=accelerator.state.backend or "none", launcher=launcher_name(), trainer="accelerate")
    launch.update(accelerate_version=accelerate.__version__, mixed_precision=accelerator.mixed_precision)
    launch.update(distributed_type=accelerator.distributed_type.value)
    log = open_run_log(path, progress, run.data, run.raw_model, recipe, lr, run.world_size, args.model_width, **launch)
    if args.precision_note and is_main:
        print(f"note: {args.precision_note}", flush=True)
    return log


# ==== checkpoint
def resume(args, recipe, run: TrainingRun) -> Progress | None:
    """Where this run starts (None: it had finished); all ranks agree on the checkpoint."""
    rank, world_size, data = run.rank, run.world_size, run.data
    if not (args.resume or args.auto_resume):
        return Progress()
    folder, state, problem = ckpt.read_accel_for_resume(args.checkpoint_dir, required=args.resume)
    if state is not None:
        ema = run.eval_model if run.eval_model is not run.raw_model else None
        generator = data.train_set.generator if data.train_sampler is not None else None
        problem = ckpt.resume_problem(state, as_dict(recipe), world_size, args.model_width, data.sizes())
        problem = problem or ckpt.attempt(
            ckpt.restore_accel, run.accelerator, folder, state, run.device.type, ema, generator
        )
    problem = ckpt.resume_disagreement(gather_object([(ckpt.what_was_seen(state), problem)]))
    if problem:
        raise UserError(f"cannot resume from {folder or args.checkpoint_dir}: {problem}")
    if state is None:
        return Progress()
    progress = Progress.of(state)
    if rank == 0:
        print(ckpt.resuming_line(folder, progress, data.steps_per_epoch, state["finished"]), flush=True)
    return None if state["finished"] else progress


def save_checkpoint(args, recipe, run: TrainingRun, progress: Progress, finished: bool = False) -> str:
    """All ranks save_state into DIR/.incomplete, then the main process publishes it."""
    rank, data = run.rank, run.data
    pipeline = gather_object([data.train_set.generator.get_state() if data.train_sampler is not None else None])
    state = ckpt.accel_state(run, progress, finished, pipeline, as_dict(recipe), args.model_width)
    incomplete = os.path.join(args.checkpoint_dir, ".incomplete")
    leftover = incomplete if rank == 0 else None
    # each step's outcome to all ranks (also the barrier)
    problem = ckpt.attempt(ckpt.fresh_folder, incomplete) if rank == 0 else None
    ckpt.stop_unless_written(gather_object([problem]), args.checkpoint_dir)
    problem = ckpt.attempt(ckpt.write_folder, run.accelerator.save_state, incomplete, state if rank == 0 else None)
    ckpt.stop_unless_written(gather_object([problem]), args.checkpoint_dir, leftover)
    problem = ckpt.attempt(ckpt.publish_checkpoint, args.checkpoint_dir, incomplete) if rank == 0 else None
    ckpt.stop_unless_written(gather_object([problem]), args.checkpoint_dir, leftover)
    return ckpt.latest_checkpoint(args.checkpoint_dir)


# ==== launch
def run_process(args, recipe) -> None:
    rank = os.environ.get("RANK", "0")
    run_reporting_failures(lambda: train_process(args, recipe), rank, (dist.DistBackendError, dist.DistNetworkError))


def resolve(args) -> tuple[argparse.Namespace, object]:
    """Fill in what the launch implies, check it, read the recipe."""
    recipe = recipe_from_args(args)
    # 'no' is also the launcher's default: only bf16 overrides the recipe
    launch_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    args.precision_note = None
    if launch_precision not in ("no", "bf16"):
        raise UserError(
            f"the launch asks for mixed precision {launch_precision!r}; this trainer supports bf16 or "
            f"'no' (the recipe's precision decides): fix mixed_precision in the accelerate config"
        )
    if launch_precision == "bf16" and recipe.precision != "bf16":
        args.precision_note = f"the launch's mixed_precision bf16 overrides the recipe's precision {recipe.precision}"
        recipe = dataclasses.replace(recipe, precision="bf16")
    check_training_flags(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(NO_CUDA)
    if recipe.sync_bn and (args.cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()):
        raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
    return args, recipe


if __name__ == "__main__":
    try:
        args, recipe = resolve(parse_args())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    # A1.11: the launcher started one process per GPU
    run_process(args, recipe)
