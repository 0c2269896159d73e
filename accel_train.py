"""Hugging Face Accelerate version of raw_ddp.py: the same training of the course WideResNet on CIFAR-10.

The launcher (accelerate launch, or torchrun) starts the processes; Accelerator() reads its environment,
joins the process group and picks the device; accelerator.prepare shards the data and wraps the model in
DDP. Sections mirror raw_ddp.py banner by banner (diff the two files); `# A1.<n>` marks what replaces the
hand-written step `# R1.<n>` there. docs/accelerate.md has the side-by-side table and the CPU traps.

Launch (configs in accelerate_configs/; the flags after accel_train.py are this script's):

    # 1 GPU
    accelerate launch --config_file accelerate_configs/single_gpu.yaml accel_train.py --data-dir data

    # 1 node x 2 GPUs, bf16 autocast: the benchmark setup
    accelerate launch --config_file accelerate_configs/two_gpus.yaml accel_train.py --data-dir data

    # 2 nodes x 4 GPUs: the same command on each node, only --machine_rank differs
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank 0 \
        --main_process_ip node0 --main_process_port 29500 accel_train.py --data-dir data
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank 1 \
        --main_process_ip node0 --main_process_port 29500 accel_train.py --data-dir data

    # Slurm, one task per node (MASTER_ADDR and MASTER_PORT exported by the batch script)
    srun --ntasks-per-node=1 bash -c 'accelerate launch --config_file accelerate_configs/multi_node.yaml \
        --machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
        accel_train.py --data-dir data'

    # 2 CPU processes (gloo), a small smoke run. --cpu is needed: see "CPU traps" in docs/accelerate.md
    accelerate launch --config_file accelerate_configs/two_cpus.yaml accel_train.py --cpu --data-dir data \
        --train-subset 2000 --val-subset 1000 --epochs 2
    # the same, with the environment instead of --cpu; or with torchrun instead of accelerate launch
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/two_cpus.yaml accel_train.py ...
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 accel_train.py ...

    # 1 process, no launcher
    python accel_train.py --data-dir data

Every recipe key works as in raw_ddp.py (--recipe fast included). --checkpoint-dir/--resume/--auto-resume use
accelerator.save_state/load_state (a folder, published atomically through DIR/LATEST). Preemption: send SIGUSR1 to
the ranks, or SIGTERM to the `accelerate launch` process (its torchrun agent passes SIGTERM on; SIGUSR1 to it would
kill it and orphan the ranks); the ranks checkpoint within 10 steps and exit 75, accelerate launch then exits 1.
--profile and --trace as in raw_ddp.py. Details: docs/accelerate.md.
"""
# ============================================================================ setup
import argparse
import contextlib
import dataclasses
import errno
import os
import shutil
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta

import accelerate
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.utils import DDPCommunicationHookType, broadcast, gather_object, parse_flag_from_env, set_seed
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn.checkpoint import (check_writable, load_accelerator_state, read_training_state, resume_disagreement,
                                  resume_problem, save_training_state, what_was_seen)
from cifar_wrn.data import (CIFAR10, DeviceBatches, SkipFirst, dataset_present, download_cifar10, evaluate,
                            ignore_stop_signal, load_splits, real_sample_mask)
from cifar_wrn.ema import build_ema, evaluated_network
from cifar_wrn.errors import RunStopped, UserError, agreed_problem
from cifar_wrn.profiling import PhaseTimer, backward_seconds, profile_table, state_restored
from cifar_wrn.model import COURSE_WIDTH, WideResNet, count_parameters
from cifar_wrn.cli import add_training_flags, recipe_from_args
from cifar_wrn.recipe import as_dict, build_optimizer, build_scheduler, scaled_lr
from cifar_wrn.runlog import JsonLog, epoch_line, run_header


# The recipe keys this trainer implements: all of cifar_wrn.recipe.Recipe's. A key added there later (an
# optimisation raw_ddp.py may offer) must keep its default here: refused rather than silently trained without.
SUPPORTED_RECIPE_KEYS = frozenset({
    "epochs", "target_accuracy", "patience", "batch_size", "base_lr", "lr_scaling", "reference_batch_size",
    "lr_schedule", "warmup_epochs", "momentum", "nesterov", "weight_decay", "label_smoothing", "precision",
    "channels_last", "cudnn_benchmark", "data_pipeline", "augment", "num_workers", "eval_batch_size", "seed",
    "grad_clip_norm", "ema_decay", "ddp_bucket_view", "ddp_static_graph", "grad_compression", "sync_bn", "compile",
    "tta_flip"})

# Where launchers put the number of processes they started (torchrun / accelerate launch, then MPI).
WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def parse_args(argv=None) -> argparse.Namespace:  # A1.1
    p = argparse.ArgumentParser(description="Accelerate training of the course WideResNet on CIFAR-10. The number of "
                                            "processes, nodes and the mixed precision come from the launcher "
                                            "(accelerate launch --config_file accelerate_configs/<X>.yaml).")
    p.add_argument("--cpu", action="store_true",
                   help="train on the CPU (gloo) even where CUDA exists; needed for several CPU processes "
                        "(or set ACCELERATE_USE_CPU=1)")
    p.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds any collective (and the start-up rendezvous) may wait before failing (default 600)")
    add_training_flags(p)  # --data-dir, --recipe, --epochs, ... (cifar_wrn/cli.py)
    return p.parse_args(argv)


# Preemption, as in raw_ddp.py: a stop signal sets this flag; every CHECK_EVERY steps and at each epoch's end the
# ranks agree (one accelerator.reduce), write a checkpoint (save_state) and exit with PREEMPTED_EXIT.
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, try again
CHECK_EVERY = 10  # steps between agreements on stop signals and non-finite losses (each costs a GPU sync)
stop_requested = False


def request_stop(signum, frame) -> None:
    global stop_requested
    stop_requested = True


# A checkpoint is a folder written by accelerator.save_state (model, optimizer, scheduler, every rank's random
# state) and training_state.pt (the run's position, history, recipe and EMA weights: a plain dict, see
# cifar_wrn/checkpoint.py for why it is not registered with Accelerate) plus DIR/LATEST, a one-line file naming the
# folder. save_state writes into DIR/.incomplete; only when every rank has finished is it renamed to state-<n> and
# LATEST replaced (os.replace, atomic), so a failed or interrupted write leaves the previous checkpoint in force.
LATEST = "LATEST"


def latest_checkpoint(directory) -> str | None:
    """The folder of DIR's newest complete checkpoint, or None."""
    pointer = os.path.join(directory, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        folder = os.path.join(directory, f.read().strip())
    return folder if os.path.isdir(folder) else None


def publish_checkpoint(directory, incomplete: str) -> str:
    """Main process: turn the finished folder `incomplete` into DIR's checkpoint, atomically; drop the old one."""
    previous = latest_checkpoint(directory)
    number = int(os.path.basename(previous).split("-")[1]) + 1 if previous else 1
    folder = os.path.join(directory, f"state-{number}")
    shutil.rmtree(folder, ignore_errors=True)  # a leftover of a run that died between the rename and the switch
    for name in os.listdir(incomplete):  # save_state does not fsync: make every rank's files durable first
        fd = os.open(os.path.join(incomplete, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.rename(incomplete, folder)
    tmp = os.path.join(directory, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(folder) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))  # the switch: before it the old checkpoint, after it the new
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if previous:
        shutil.rmtree(previous, ignore_errors=True)
    return folder


def launcher_world_size() -> int | None:
    """How many processes the launcher started in all, from its environment (None: no launcher said)."""
    for key in WORLD_SIZE_VARS:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def launcher_name() -> str:
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ:  # set by accelerate launch only (it runs torchrun inside)
        return "accelerate launch"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "python"


def check_launch(args) -> None:
    """Every mistake we can see before joining the process group, as one clear UserError."""
    for flag in ("epochs", "batch_size", "train_subset", "val_subset", "model_width"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.dist_timeout <= 0:
        raise UserError(f"--dist-timeout must be > 0 seconds (got {args.dist_timeout})")
    for flag in ("save", "log_json"):
        path = getattr(args, flag)
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise UserError(f"--{flag.replace('_', '-')} {path}: the folder does not exist or is not writable")
    if (args.resume or args.auto_resume) and not args.checkpoint_dir:
        raise UserError("--resume and --auto-resume need --checkpoint-dir")
    if args.resume and args.auto_resume:
        raise UserError("use either --resume (a checkpoint must exist) or --auto-resume (start fresh without one)")
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir)
    if args.resume and latest_checkpoint(args.checkpoint_dir) is None:
        raise UserError(f"--resume: no checkpoint in {args.checkpoint_dir} (no {LATEST} naming a state-<n> folder; "
                        f"start without --resume, or use --auto-resume to start fresh when there is none). The "
                        f"folder must be visible from every node.")


def check_recipe_supported(recipe) -> None:
    defaults = type(recipe)()
    unsupported = [f"{f.name}={getattr(recipe, f.name)!r}" for f in dataclasses.fields(recipe)
                   if f.name not in SUPPORTED_RECIPE_KEYS and getattr(recipe, f.name) != getattr(defaults, f.name)]
    if unsupported:
        raise UserError(f"recipe key(s) {', '.join(unsupported)} are not implemented by accel_train.py (raw_ddp.py "
                        f"only); use a recipe that leaves them at their defaults")


def check_world_size(accelerator: Accelerator) -> None:
    """Refuse to train when Accelerate did not join the processes the launch started: each would train alone."""
    started = launcher_world_size()
    seen = accelerator.num_processes
    if started is not None and started != seen:
        raise UserError(
            f"the launcher started {started} processes (WORLD_SIZE={started}) but Accelerate sees {seen} "
            f"(distributed_type {accelerator.distributed_type.value}, device {accelerator.device.type}): each process "
            f"would train alone. Without CUDA, a MULTI_GPU launch must be told to use the CPU: add --cpu after "
            f"accel_train.py or set ACCELERATE_USE_CPU=1 (`use_cpu: true` in the config file does not reach the "
            f"processes of a MULTI_GPU launch). See docs/accelerate.md, CPU traps.")
    # accelerate launch's single-process launcher (distributed_type NO or MULTI_CPU, or --cpu) sets MASTER_PORT
    # only when it was asked for more than one process; it then starts one process all the same.
    if (started is None and seen == 1 and launcher_name() == "accelerate launch"
            and os.environ.get("MASTER_PORT")):
        raise UserError(
            "accelerate launch was asked for several processes but started only this one: `accelerate launch --cpu "
            "--num_processes N` and `distributed_type: MULTI_CPU` configs run a single process (accelerate "
            f"{accelerate.__version__}). For N CPU processes use `accelerate launch --config_file "
            "accelerate_configs/two_cpus.yaml accel_train.py --cpu ...` (a MULTI_GPU config, --num_processes N). "
            "If you meant one process and exported MASTER_PORT yourself, unset it.")


def train_process(args: argparse.Namespace, recipe) -> None:
    """Everything one process does, from joining the group to leaving it. The launcher runs it once per GPU."""
    signal.signal(signal.SIGUSR1, request_stop)  # sent to the ranks directly (see docs/accelerate.md, Preemption)
    # SIGTERM too: torchrun's agent passes it on to its workers, and Slurm sends it to every process of the step
    # (scancel, the time limit, a preemption). Dying of it would lose the epoch.
    signal.signal(signal.SIGTERM, request_stop)
    # A1.2 + A1.3 + A1.7: Accelerator() reads RANK/WORLD_SIZE/LOCAL_RANK from the launcher's environment,
    # joins the process group (nccl, or gloo on the CPU) and picks this process's device, cuda:<local_rank>.
    try:
        accelerator = Accelerator(
            cpu=args.cpu,
            mixed_precision="bf16" if recipe.precision == "bf16" else "no",  # autocast; weights stay fp32
            # A1.5 + A1.6: prepare() turns the shuffling sampler into a SeedableRandomSampler seeded with
            # recipe.seed + epoch (the same order on every rank, a new one each epoch) and shards its batches.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=recipe.seed,
                                                      non_blocking=True),
            # build_scheduler counts steps of one process; Accelerate would otherwise step the scheduler
            # num_processes times per optimizer step (it assumes a single-process schedule).
            step_scheduler_with_optimizer=False,
            # recipe.compile: prepare() wraps the DDP model in torch.compile (Accelerate's dynamo settings). The
            # recipe decides, not the launch config's dynamo_backend.
            dynamo_backend="inductor" if recipe.compile else "no",
            kwargs_handlers=[
                # A1.8: the DDP settings; those raw_ddp.py passes to DDP(...) and register_comm_hook by hand.
                DistributedDataParallelKwargs(
                    broadcast_buffers=True, bucket_cap_mb=25, find_unused_parameters=False,
                    gradient_as_bucket_view=recipe.ddp_bucket_view, static_graph=recipe.ddp_static_graph,
                    # half the bytes on the wire; the average is rounded to bf16
                    comm_hook=DDPCommunicationHookType.BF16 if recipe.grad_compression == "bf16"
                    else DDPCommunicationHookType.NO),
                InitProcessGroupKwargs(timeout=timedelta(seconds=args.dist_timeout)),  # A1.3: finite
            ])
    except dist.DistError as exc:
        raise UserError(f"the process group did not form at {os.environ.get('MASTER_ADDR')}:"
                        f"{os.environ.get('MASTER_PORT')} with world size {launcher_world_size()} within "
                        f"{args.dist_timeout:g} s: not every process joined. Start every node with the same config, "
                        f"--main_process_ip and --main_process_port. ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    try:
        check_world_size(accelerator)
        world_size = accelerator.num_processes
        rank = accelerator.process_index
        is_main = accelerator.is_main_process  # only rank 0 prints the epoch lines and writes files
        main_print = accelerator.on_main_process(print)  # A1.10; accelerator.print prints once per NODE
        device = accelerator.device
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if device.type == "cpu":
            # The processes on this node share its cores: without this each would start one thread
            # per core and the oversubscribed machine runs several times slower.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_processes))
            if not (args.cpu or parse_flag_from_env("ACCELERATE_USE_CPU")):
                warnings.warn("CUDA is not available: running on the CPU", stacklevel=1)
            if recipe.sync_bn:  # resolve() refuses it too where it can tell; this catches a launch without CUDA
                raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
        # =================================================================== data
        # A1.4: one process per node downloads (if needed); the others wait until it has left the block,
        # so that nobody reads a half-written file. (One per node, because nodes may not share a disk.)
        with accelerator.local_main_process_first():
            if accelerator.is_local_main_process and not dataset_present(args.data_dir):
                problem = download_cifar10(args.data_dir)
                if problem:
                    accelerator.print(f"rank {rank}: {problem}", file=sys.stderr, flush=True)  # once per node
        train_data, val_data, problem = load_splits(args.data_dir, args.train_subset, args.val_subset)
        # Every rank must have the data before any goes on: a rank that stopped alone would leave the others
        # waiting in prepare()'s DDP constructor (a collective) until --dist-timeout. So all ranks share their answer.
        problems = gather_object([problem and f"node {rank // local_processes}: {problem}"])
        if agreed_problem(problems):
            raise UserError(agreed_problem(problems))  # every rank stops, naming the node(s) and folder(s)

        per_device_batch_size = recipe.batch_size
        global_batch_size = per_device_batch_size * world_size
        on_device = recipe.data_pipeline == "device"
        if on_device:
            # The whole uint8 dataset lives on this process's device; batches are cut there. NOT prepared:
            # accelerator.prepare would wrap the BatchSampler in a BatchSamplerShard that deals whole batches out
            # to the ranks, so over a DistributedSampler each rank would get every W-th batch of its own shard
            # (1/W of its data). So the sharding stays explicit, as in raw_ddp.py: DistributedSampler (set_epoch
            # each epoch), SkipFirst for a mid-epoch resume, and the validation padding masked by real_sample_mask
            # (docs/accelerate.md, "Why the device pipeline's loaders are not prepared").
            train_set = DeviceBatches(*train_data, device, augment=recipe.augment, seed=recipe.seed + rank,
                                      channels_last=recipe.channels_last)
            val_set = DeviceBatches(*val_data, device, augment=False, channels_last=recipe.channels_last)
            train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                               seed=recipe.seed)
            val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
            val_mask = real_sample_mask(val_sampler)
            train_batches = SkipFirst(BatchSampler(train_sampler, per_device_batch_size, drop_last=True))
            train_loader = DataLoader(train_set, batch_size=None, sampler=train_batches)  # A1.5 (by hand, see above)
            val_loader = DataLoader(val_set, batch_size=None,
                                    sampler=BatchSampler(val_sampler, recipe.eval_batch_size, drop_last=False))
            steps_per_epoch = len(train_batches.batches)
        else:
            train_set = CIFAR10(*train_data, augment=recipe.augment)
            val_set = CIFAR10(*val_data, augment=False)
            # Worker processes feed a GPU; on a CPU run they would only take cores from training.
            num_workers = recipe.num_workers if device.type == "cuda" else 0
            # Plain loaders over the whole data set. drop_last: a short last batch would change the step size
            # of that step and can leave BatchNorm a single image.
            loader_options = dict(num_workers=num_workers, pin_memory=device.type == "cuda",
                                  persistent_workers=num_workers > 0, worker_init_fn=ignore_stop_signal)
            train_loader = DataLoader(train_set, batch_size=per_device_batch_size, shuffle=True, drop_last=True,
                                      **loader_options)
            val_loader = DataLoader(val_set, batch_size=recipe.eval_batch_size, shuffle=False, **loader_options)
            # A1.5: rank r gets batches r, r + W, r + 2W, ... of the shuffled order, moved to its device. The
            # validation loader is padded with repeats to equal length; gather_for_metrics drops them again.
            train_loader, val_loader = accelerator.prepare(train_loader, val_loader)  # A1.5
            steps_per_epoch = len(train_loader)
        if steps_per_epoch == 0:
            raise UserError(f"{len(train_set)} training images over {world_size} processes give less than one "
                            f"batch of {per_device_batch_size} per process: use more images or a smaller batch")

        # =================================================================== model
        set_seed(recipe.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        model = WideResNet(width=args.model_width)
        if recipe.sync_bn:  # batch statistics over the global batch, at the cost of a collective per BN layer
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        memory_format = torch.channels_last if recipe.channels_last else torch.contiguous_format
        model = model.to(device, memory_format=memory_format)  # prepare() would move it; the layout is ours
        torch.backends.cudnn.benchmark = recipe.cudnn_benchmark
        # The model the epoch loop evaluates and --save writes: the weights, or their moving average. Made before
        # prepare(), so that the copy is a plain WideResNet (prepare gives the model an autocast forward).
        ema_model = None if recipe.ema_decay == 0 else build_ema(model, recipe.ema_decay)  # warms up
        # Linear LR scaling: each step averages gradients over global_batch_size images.
        lr = scaled_lr(recipe, global_batch_size)
        optimizer = build_optimizer(model, recipe, lr)
        scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
        # A1.7 + A1.8: prepare moves the model to accelerator.device and wraps it in DDP (hooks that average
        # gradients over all ranks during backward; the bf16 comm hook; torch.compile with recipe.compile); with
        # bf16 its forward also runs under autocast.
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)  # A1.8
        raw_model = accelerator.unwrap_model(model)  # the plain WideResNet (autocast kept): evaluation, saving
        eval_model = ema_model or raw_model
        # A different random stream per rank (seed + rank) for augmentation and dropout: identical streams
        # would crop and drop the same way on every rank and waste part of the extra data.
        set_seed(recipe.seed, device_specific=True)

        criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
        autocast_dtype = torch.bfloat16 if recipe.precision == "bf16" else None  # evaluation of the EMA copy

        # Checkpoints: save_state/load_state handle the prepared model, optimizer, scheduler and every rank's
        # random state; the rest, EMA weights included, is a plain dict in training_state.pt beside them (nothing
        # is registered for checkpointing: load_state would unpickle it with weights_only=False).

        # Where this run starts: from scratch, or where a checkpoint left off.
        start_epoch, start_step, epoch_time_so_far = 0, 0, 0.0  # the epoch to run, steps of it already done
        cumulative_time, history, streak = 0.0, [], 0  # streak: consecutive epochs at or above the target
        data_sizes = {"train_images": len(train_set), "val_images": len(val_set), "steps_per_epoch": steps_per_epoch}
        resume_from = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
        if args.resume or args.auto_resume:
            # Each rank reads the checkpoint; rank 0's decides, and every rank must see the same one (or none):
            # never resume some ranks while others start from scratch.
            state, problem = None, None
            if resume_from is None and args.resume:
                problem = f"--resume: no checkpoint in {args.checkpoint_dir}"
            if resume_from:
                try:
                    state = read_training_state(resume_from)
                    problem = resume_problem(state, as_dict(recipe), world_size, args.model_width, data_sizes)
                except UserError as exc:
                    problem = str(exc)
            problem = resume_disagreement(gather_object([(what_was_seen(state), problem)]))
            if problem:
                raise UserError(f"cannot resume from {resume_from or args.checkpoint_dir}: {problem}")
        if resume_from and (args.resume or args.auto_resume):
            load_accelerator_state(accelerator, resume_from)  # every rank reads the weights and its own random state
            if ema_model is not None:
                ema_model.load_state_dict(state["ema"])
            if on_device:
                train_set.generator.set_state(state["pipeline"][rank])
            start_epoch, start_step, epoch_time_so_far = state["epoch"], state["step"], state["epoch_time_so_far"]
            cumulative_time, history, streak = state["cumulative_time"], state["history"], state["streak"]
            main_print(f"Resuming from {resume_from}: epoch {start_epoch + 1}, step {start_step} of "
                       f"{steps_per_epoch}, Cumulative Time = {cumulative_time:.3f}", flush=True)
            if state["finished"]:
                main_print("Nothing to do: that run had already finished", flush=True)
                return

        def save_checkpoint(epoch: int, step: int, epoch_time_so_far: float, finished: bool = False) -> None:
            """All ranks: save_state into DIR/.incomplete, then the main process publishes it (publish_checkpoint)."""
            pipeline = gather_object([train_set.generator.get_state() if on_device else None])  # every rank's
            training_state = {
                "epoch": epoch, "step": step, "epoch_time_so_far": epoch_time_so_far,
                "cumulative_time": cumulative_time, "history": history, "streak": streak, "finished": finished,
                "pipeline": pipeline, "recipe": as_dict(recipe), "world_size": world_size,
                "model_width": args.model_width, **data_sizes,
                "ema": ema_model.state_dict() if ema_model is not None else None}
            incomplete = os.path.join(args.checkpoint_dir, ".incomplete")
            if is_main:
                shutil.rmtree(incomplete, ignore_errors=True)  # a leftover of a write that failed
            accelerator.wait_for_everyone()
            failed = torch.zeros(1, device=device)
            try:
                accelerator.save_state(incomplete)  # each rank writes its random state; the main one the rest
                if is_main:
                    save_training_state(incomplete, training_state)
                if is_main and os.environ.get("CIFAR_WRN_TEST_ENOSPC_AT_EPOCH") == str(epoch):  # tests only
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), incomplete)
            except OSError as exc:
                print(f"error: rank {rank} could not write {incomplete}: {exc.strerror or exc}; the previous "
                      f"checkpoint is intact", file=sys.stderr, flush=True)
                failed.fill_(1)
            failed = accelerator.reduce(failed, reduction="sum")  # also the barrier: every rank has written
            if failed.item() == 0 and is_main:
                try:
                    publish_checkpoint(args.checkpoint_dir, incomplete)
                except OSError as exc:
                    print(f"error: could not publish {incomplete}: {exc.strerror or exc}; the previous checkpoint "
                          f"is intact", file=sys.stderr, flush=True)
                    failed.fill_(1)
            failed = accelerator.reduce(failed, reduction="sum")  # nobody goes on before LATEST names it
            if failed.item():
                if is_main:
                    shutil.rmtree(incomplete, ignore_errors=True)
                raise UserError(f"rank {rank}: stopping because the checkpoint could not be written")

        log = JsonLog(args.log_json if is_main else None, append=start_epoch > 0 or start_step > 0)
        log.write(run_header(
            world_size=world_size, num_nodes=world_size // local_processes, num_gpus=local_processes,
            backend=accelerator.state.backend or "none", device=device.type, launcher=launcher_name(),
            per_device_batch_size=per_device_batch_size, global_batch_size=global_batch_size, lr=lr,
            steps_per_epoch=steps_per_epoch, train_images=len(train_set), val_images=len(val_set),
            model_width=args.model_width, model_parameters=count_parameters(raw_model),
            recipe=as_dict(recipe), argv=sys.argv, trainer="accelerate", accelerate_version=accelerate.__version__,
            distributed_type=accelerator.distributed_type.value, mixed_precision=accelerator.mixed_precision,
            resumed_at={"epoch": start_epoch + 1, "step": start_step} if start_epoch or start_step else None))
        if args.precision_note:
            main_print(f"note: {args.precision_note}", flush=True)
        if args.model_width != COURSE_WIDTH:
            main_print(f"note: --model-width {args.model_width} is not the course model (width {COURSE_WIDTH})",
                       flush=True)

        # =================================================================== train
        fault_rank = os.environ.get("CIFAR_WRN_TEST_RAISE_IN_RANK")  # test-only fault injection
        if fault_rank is not None and int(fault_rank) == rank:
            raise RuntimeError(f"injected test fault in rank {rank}")
        nan_at = os.environ.get("CIFAR_WRN_TEST_NAN_AT", "")  # test-only: "rank,epoch,step" gets a NaN loss
        stop_at = os.environ.get("CIFAR_WRN_TEST_STOP_AT", "")  # test-only: "epoch,step" acts as a stop signal
        # Every CHECK_EVERY steps, and at the end of each epoch, all ranks agree on two questions so that
        # they stop together at the same step: did any rank get a stop signal (slot 0), and at which step
        # did each rank first see a non-finite loss (slot 1 + rank, 0 = never)? Each rank writes only its own
        # slots, so one accelerator.reduce(sum) answers both (accelerator.check_trigger would be a second
        # collective per check, and its single flag cannot say which rank saw what).
        step_flags = torch.zeros(1 + world_size, device=device)
        timer = PhaseTimer(device, enabled=args.profile)  # --profile: where the epoch's time goes
        tracer = torch.profiler.profile(  # --trace: every kernel of a few steps, for TensorBoard or Perfetto
            activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []),
            schedule=torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.trace, worker_name=f"rank{rank}"),
        ) if args.trace else None
        if tracer:
            tracer.start()
        for epoch in range(start_epoch, recipe.epochs):
            skip = start_step if epoch == start_epoch else 0  # steps of this epoch a checkpoint already holds
            if on_device:
                train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
                train_batches.skip = skip
                epoch_loader = train_loader
            else:
                # A1.6: set_epoch(epoch) seeds the SeedableRandomSampler with seed + epoch. (A `for` over the
                # prepared loader counts its passes and sets them itself; a resumed run starts counting at 0.)
                train_loader.set_epoch(epoch)
                # Mid-epoch resume: the same shuffled batches, less those already trained.
                epoch_loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            model.train()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            timer.start()
            for step, (images, labels) in enumerate(epoch_loader, start=skip):  # A1.7: batches on the device
                if recipe.channels_last and not on_device:
                    images = images.contiguous(memory_format=memory_format)
                timer.mark("data")
                loss = criterion(model(images), labels)  # autocast (bf16) is inside model.forward
                if nan_at == f"{rank},{epoch + 1},{step + 1}":
                    loss = loss * float("nan")
                if stop_at == f"{epoch + 1},{step + 1}":
                    request_stop(None, None)
                timer.mark("forward")
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)  # DDP all-reduces gradient buckets here, overlapped with backward
                timer.mark("backward")
                if recipe.grad_clip_norm:  # on the averaged gradient, so every rank clips by the same factor
                    accelerator.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm)
                optimizer.step()  # every rank applies the same averaged gradient: replicas stay identical
                timer.mark("optimizer")
                scheduler.step()
                if ema_model is not None:
                    ema_model.update_parameters(raw_model)

                first_bad = step_flags[1 + rank]
                step_flags[1 + rank] = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1,
                                                   first_bad)
                if (step + 1) % CHECK_EVERY == 0 or step + 1 == steps_per_epoch:
                    step_flags[0] = float(stop_requested)
                    agreed = accelerator.reduce(step_flags.clone(), reduction="sum")  # the same on every rank
                    if agreed.any():
                        bad = {r: int(agreed[1 + r]) for r in range(world_size) if agreed[1 + r] > 0}
                        if bad:
                            raise RunStopped(f"non-finite loss in epoch {epoch + 1} on rank(s) "
                                             f"{', '.join(f'{r} (first at step {s})' for r, s in bad.items())}: "
                                             f"training diverged (try a lower learning rate or a longer warmup); "
                                             f"every rank stopped at step {step + 1}", 1)
                        if not args.checkpoint_dir:
                            raise RunStopped(f"stopped by a signal at epoch {epoch + 1}, step {step + 1}; nothing saved "
                                             f"(no --checkpoint-dir)", 1)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        save_checkpoint(epoch, step + 1, epoch_time_so_far + time.perf_counter() - t0)
                        raise RunStopped(f"stopped by a signal at epoch {epoch + 1}, step {step + 1}: checkpoint written "
                                         f"to {latest_checkpoint(args.checkpoint_dir)}; rerun with --resume to continue",
                                         PREEMPTED_EXIT)
                timer.mark("other")
                if tracer:
                    tracer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the clock stops when the GPU has finished, not when it was told
            epoch_time = epoch_time_so_far + time.perf_counter() - t0  # training only: validation is outside
            epoch_time_so_far = 0.0
            cumulative_time += epoch_time
            if tracer:
                tracer.stop()
                tracer = None
            profile = timer.totals()  # {} unless --profile
            steps_run = steps_per_epoch - skip  # 0 after a resume at the epoch's last step
            if args.profile:  # outside the epoch's clock: a few extra backward passes on the last batch
                comm_estimate = allreduce_cost(accelerator, model, raw_model, images, labels, criterion,
                                               device) * steps_run if steps_run else 0.0

            # A1.9: images/sec is a SUM over ranks: they work on different images at the same time.
            images_per_sec = accelerator.reduce(torch.tensor([steps_per_epoch * per_device_batch_size / epoch_time],
                                                             dtype=torch.float64, device=device), reduction="sum")

            # =============================================================== evaluate
            # DDP broadcasts rank 0's BatchNorm statistics at the start of each forward, so after the
            # last step each rank's differ by one update. Take rank 0's, the ones --save writes.
            # (Only the network's buffers: an EMA's update counter is the same on every rank.)
            broadcast(list(evaluated_network(eval_model).buffers()), from_process=0)
            if on_device:  # the explicit DistributedSampler: sums over this rank's real samples, as raw_ddp.py
                totals = evaluate(eval_model, val_loader, val_mask, device, autocast_dtype, tta_flip=recipe.tta_flip)
                # A1.9: summing the sums and the counts over ranks keeps their ratio exact.
                totals = accelerator.reduce(totals, reduction="sum")  # A1.9
            else:
                eval_model.eval()
                totals = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, correct, count]
                with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                                     enabled=autocast_dtype is not None):
                    for images, labels in val_loader:
                        logits = eval_model(images)
                        if recipe.tta_flip:  # the mean over each image and its mirror image
                            logits = (logits + eval_model(images.flip(3))) / 2
                        losses = F.cross_entropy(logits.float(), labels, reduction="none").double()
                        correct = (logits.argmax(1) == labels).double()
                        # A1.9: every rank's per-image results, with the padding repeats of the last batch dropped.
                        losses, correct = accelerator.gather_for_metrics((losses, correct))  # A1.9
                        totals += torch.stack([losses.sum(), correct.sum(), torch.tensor(len(correct), device=device,
                                                                                         dtype=torch.float64)])
            if round(totals[2].item()) != len(val_set):  # exactness check: every image counted exactly once
                raise RuntimeError(f"validation counted {totals[2].item()} images, expected {len(val_set)}")
            val_loss = (totals[0] / totals[2]).item()
            val_accuracy = (totals[1] / totals[2]).item()

            metrics = {"epoch": epoch + 1, "cumulative_time": cumulative_time, "epoch_time": epoch_time,
                       "images_per_sec": images_per_sec.item(), "val_loss": val_loss, "val_accuracy": val_accuracy}
            main_print(epoch_line(metrics), flush=True)  # A1.10: one line per epoch, from rank 0 only
            if args.profile:
                main_print(profile_table(profile, epoch_time, comm_estimate, epoch + 1), flush=True)
                log.write({"kind": "epoch", **metrics, "profile": profile, "comm_estimate": comm_estimate})
            else:
                log.write({"kind": "epoch", **metrics})
            history.append(metrics)

            # Every rank holds the same gathered accuracy, so every rank takes the same decision
            # and none is left waiting alone in a collective.
            streak = streak + 1 if val_accuracy >= recipe.target_accuracy else 0
            if args.checkpoint_dir:
                save_checkpoint(epoch + 1, 0, 0.0, finished=streak >= recipe.patience)
            if streak >= recipe.patience:
                main_print(f"Early stopping after epoch {epoch + 1}", flush=True)  # A1.10
                break
        else:
            main_print(f"Target accuracy {recipe.target_accuracy} not reached {recipe.patience} epochs in a row "
                       f"within {recipe.epochs} epochs", flush=True)

        # =================================================================== teardown
        if args.save:  # main process only; no "module." prefix: loads into WideResNet
            weights = ema_model.module.state_dict() if ema_model is not None else accelerator.get_state_dict(model)
            accelerator.save(weights, args.save)
        log.close()
    finally:
        accelerator.end_training()  # A1.3: destroys the process group


def allreduce_cost(accelerator, model, raw_model, images, labels, criterion, device, repeats: int = 3) -> float:
    """Seconds per step that gradient synchronisation adds to backward (--profile): the same batch's
    backward timed with DDP's all-reduce and inside accelerator.no_sync(model) (no all-reduce). All ranks must
    call it together. BatchNorm statistics, random state and gradients are put back as they were."""
    def forward():
        return criterion(model(images), labels)  # autocast (bf16) is inside model.forward

    with state_restored(raw_model, device):
        seconds = []
        for context in (contextlib.nullcontext, lambda: accelerator.no_sync(model)):  # with the all-reduce, then without it
            seconds.append(backward_seconds(forward, accelerator.backward, context, device, repeats))
            model.zero_grad(set_to_none=True)
    return max(seconds[0] - seconds[1], 0.0)


def run_process(args, recipe) -> None:
    """train_process, with every failure reported by the rank it happened in, so nothing is lost
    whichever failed rank the launcher notices first: a UserError as one line (exit status 2),
    anything else with the rank number and its traceback (exit status 1)."""
    rank = os.environ.get("RANK", "0")  # the launcher's numbering, the same as accelerator.process_index
    try:
        train_process(args, recipe)
    except RunStopped as exc:
        if rank == "0":
            print(f"{'error: ' if exc.status == 1 else ''}{exc}", file=sys.stderr, flush=True)
        sys.exit(exc.status)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (dist.DistBackendError, dist.DistNetworkError) as exc:  # a collective broke: usually a peer died
        print(f"error: rank {rank} lost contact with another process, which probably failed (see its error "
              f"above or in its node's log): {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception:
        print(f"error: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


def resolve(args) -> tuple[argparse.Namespace, object]:
    """Read the recipe (flags and --set override it; so does bf16 from the launch config), check the flags."""
    recipe = recipe_from_args(args)
    check_recipe_supported(recipe)
    # accelerate launch passes the config's mixed_precision (or --mixed_precision) in this variable; 'no' is
    # also its default, so only bf16 counts as a request. It overrides the recipe like a flag would.
    launch_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    args.precision_note = None
    if launch_precision not in ("no", "bf16"):
        raise UserError(f"the launch asks for mixed precision {launch_precision!r}; this trainer supports bf16 or "
                        f"'no' (the recipe's precision decides): fix mixed_precision in the accelerate config")
    if launch_precision == "bf16" and recipe.precision != "bf16":
        args.precision_note = (f"mixed_precision bf16 from the accelerate launch overrides the recipe's precision "
                               f"{recipe.precision}")
        recipe = dataclasses.replace(recipe, precision="bf16")
    check_launch(args)
    if recipe.sync_bn and (args.cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()):
        raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
    return args, recipe


if __name__ == "__main__":
    try:
        args, recipe = resolve(parse_args())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    # A1.11: no spawning here: the launcher (accelerate launch / torchrun) started one process per GPU.
    run_process(args, recipe)
