"""Hand-written PyTorch DistributedDataParallel (DDP): the course WideResNet on CIFAR-10.

One process per GPU (or per CPU share). Each required step is tagged `# R1.<n>`; grep for it.

Launch:

    # 1 node x 2 GPUs, the course's main job (mp.spawn starts 2 processes)
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --data-dir data

    # the same on a CPU-only machine: 2 processes, gloo, a small smoke run
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --device cpu --data-dir data \
        --train-subset 2000 --val-subset 1000 --epochs 2

    # 2 nodes x 4 GPUs: the same command on each node, only --node-id differs
    python raw_ddp.py --num-nodes 2 --node-id 0 --num-gpus 4 --master-addr node0 --master-port 29500
    python raw_ddp.py --num-nodes 2 --node-id 1 --num-gpus 4 --master-addr node0 --master-port 29500

    # Slurm, one task per node (slurm/raw_multinode.sbatch sets MASTER_ADDR and MASTER_PORT)
    srun --ntasks-per-node=1 bash -c 'python raw_ddp.py --num-nodes $SLURM_NNODES \
        --node-id $SLURM_NODEID --num-gpus 4'

    # torchrun instead of mp.spawn: RANK, LOCAL_RANK and WORLD_SIZE come from the environment
    torchrun --nproc_per_node 2 raw_ddp.py --data-dir data

    # the challenge recipe (docs/optimizations.md); checkpoints every epoch, resumable after preemption
    python raw_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --recipe fast --checkpoint-dir ckpt --auto-resume
"""
# ============================================================================ setup
import argparse
import contextlib
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn.checkpoint import (check_writable, checkpoint_path, read_for_resume, resume_disagreement,
                                  resume_problem, save_atomic, what_was_seen)
from cifar_wrn.data import (CIFAR10, DeviceBatches, SkipFirst, dataset_present, download_cifar10, evaluate,
                            ignore_stop_signal, load_splits, real_sample_mask)
from cifar_wrn.ema import build_ema, evaluated_network
from cifar_wrn.errors import RunStopped, UserError, agreed_problem
from cifar_wrn.profiling import PhaseTimer, backward_seconds, profile_table, state_restored
from cifar_wrn.model import COURSE_WIDTH, WideResNet, count_parameters
from cifar_wrn.cli import add_training_flags, recipe_from_args
from cifar_wrn.recipe import as_dict, build_optimizer, build_scheduler, scaled_lr
from cifar_wrn.runlog import JsonLog, epoch_line, run_header



def parse_args(argv=None) -> argparse.Namespace:  # R1.1
    p = argparse.ArgumentParser(description="Hand-written DDP training of the course WideResNet on CIFAR-10.")
    p.add_argument("--num-nodes", type=int, default=1, help="machines taking part (default 1)")
    p.add_argument("--node-id", type=int, default=0, help="this machine's index, 0 .. num-nodes-1 (default 0)")
    p.add_argument("--num-gpus", type=int, default=1,
                   help="processes on this machine: one per GPU, or CPU processes with --device cpu (default 1)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                   help="address of node 0 (default: $MASTER_ADDR, else 127.0.0.1 when there is one node)")
    p.add_argument("--master-port", type=int, default=int(os.environ["MASTER_PORT"]) if os.environ.get(
        "MASTER_PORT", "").isdigit() else None,
                   help="TCP port on node 0 (default: $MASTER_PORT, else a free port when there is one node)")
    p.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds any collective (and the start-up rendezvous) may wait before failing (default 600)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when available, else CPU with a warning (default auto)")
    add_training_flags(p)  # --data-dir, --recipe, --epochs, ... (cifar_wrn/cli.py)
    return p.parse_args(argv)


# Preemption: Slurm signals the launcher (SIGUSR1 from `--signal=B:USR1@120`, or SIGTERM); the launcher
# passes SIGUSR1 to its ranks; each rank sets this flag, and at the next step all ranks agree (MAX over
# ranks), rank 0 writes a checkpoint and every rank exits with PREEMPTED_EXIT: "requeue me".
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, try again
CHECK_EVERY = 10  # steps between agreements on stop signals and non-finite losses (each costs a GPU sync)
stop_requested = False


def request_stop(signum, frame) -> None:
    global stop_requested
    stop_requested = True


def world_size_and_rank(num_nodes: int, num_gpus: int, node_id: int, local_rank: int) -> tuple[int, int]:
    world_size = num_nodes * num_gpus  # R1.2: every process on every node
    rank = node_id * num_gpus + local_rank  # R1.2: node 0 holds ranks 0..num_gpus-1, node 1 the next, ...
    return world_size, rank


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def check_launch(args, cuda_device_count: int) -> None:
    """Every mistake we can see before starting processes, as one clear UserError."""
    if args.num_nodes < 1:
        raise UserError(f"--num-nodes must be >= 1 (got {args.num_nodes})")
    if not 0 <= args.node_id < args.num_nodes:
        raise UserError(f"--node-id must be in [0, {args.num_nodes - 1}] for --num-nodes {args.num_nodes} "
                        f"(got {args.node_id})")
    if args.num_gpus < 1:
        raise UserError(f"--num-gpus must be >= 1 (got {args.num_gpus})")
    if args.device == "cuda" and cuda_device_count == 0:
        raise UserError("--device cuda, but CUDA is not available here (use --device cpu or auto)")
    if args.device == "cuda" and args.num_gpus > cuda_device_count:
        raise UserError(f"--num-gpus {args.num_gpus}, but this node has only {cuda_device_count} CUDA device(s)")
    for flag in ("epochs", "batch_size", "train_subset", "val_subset", "model_width"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.dist_timeout <= 0:
        raise UserError(f"--dist-timeout must be > 0 seconds (got {args.dist_timeout})")
    if args.master_addr is None:
        raise UserError("--master-addr (or $MASTER_ADDR) is required with more than one node: the address of "
                        "node 0, which every node can reach")
    if args.master_port is None and args.num_nodes > 1:
        raise UserError("--master-port (or $MASTER_PORT) is required with more than one node, "
                        "so that every node meets at the same port")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UserError(f"--master-port must be in 1-65535 (got {args.master_port})")
    if args.master_port is not None and args.node_id == 0 and not launched_by_torchrun() \
            and not port_is_free(args.master_port):
        raise UserError(f"--master-port {args.master_port} is already in use on this machine "
                        f"(another run?); pick another port")
    for flag in ("save", "log_json"):
        path = getattr(args, flag)
        if path and args.node_id == 0 and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise UserError(f"--{flag.replace('_', '-')} {path}: the folder does not exist or is not writable")
    if (args.resume or args.auto_resume) and not args.checkpoint_dir:
        raise UserError("--resume and --auto-resume need --checkpoint-dir")
    if args.resume and args.auto_resume:
        raise UserError("use either --resume (a checkpoint must exist) or --auto-resume (start fresh without one)")
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir)


def train_process(local_rank: int, args: argparse.Namespace, recipe) -> None:
    """Everything one process does, from joining the group to leaving it. Runs once per GPU."""
    world_size, rank = world_size_and_rank(args.num_nodes, args.num_gpus, args.node_id, local_rank)  # R1.2
    is_main = rank == 0  # only rank 0 prints and writes files
    signal.signal(signal.SIGUSR1, request_stop)  # from our launcher (or directly from Slurm)
    # SIGTERM too: Slurm sends it to every process of the step (scancel, the time limit, a preemption),
    # not only to the launcher, and torchrun passes it on to its workers. Dying of it would lose the epoch.
    signal.signal(signal.SIGTERM, request_stop)

    # R1.7: pin this process to its own GPU, cuda:<local_rank>, before any CUDA work.
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)  # R1.7
        device = torch.device(f"cuda:{local_rank}")  # R1.7
        backend = "nccl"
    else:
        device = torch.device("cpu")  # R1.7: on CPU runs every process uses the CPU
        backend = "gloo"
        # The processes on this node share its cores: without this each would start one thread
        # per core and the oversubscribed machine runs several times slower.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.num_gpus))

    # R1.3: join the process group (nccl on GPUs, gloo on CPUs): every rank connects to node 0's address and port.
    init_method = "env://" if launched_by_torchrun() else f"tcp://{args.master_addr}:{args.master_port}"
    try:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,  # R1.3
                                timeout=timedelta(seconds=args.dist_timeout),  # finite: a lost peer ends the run
                                device_id=device if backend == "nccl" else None)
    except dist.DistError as exc:  # timed out waiting for peers, or could not reach node 0
        where = os.environ.get("MASTER_ADDR", args.master_addr) + ":" + str(
            os.environ.get("MASTER_PORT", args.master_port))
        raise UserError(f"rank {rank}: the process group did not form at {where} with world size {world_size} "
                        f"within {args.dist_timeout:g} s: not every process joined. Start every node with the "
                        f"same --num-nodes, --num-gpus, --master-addr and --master-port. ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    try:
        # =================================================================== data
        # R1.4: one process per node downloads (if needed); the rest wait at the barrier so that
        # nobody reads a half-written file. (One per node, because nodes may not share a disk.)
        if local_rank == 0 and not dataset_present(args.data_dir):
            problem = download_cifar10(args.data_dir)
            if problem:
                print(f"rank {rank}: {problem}", file=sys.stderr, flush=True)
        dist.barrier()  # R1.4
        train_data, val_data, problem = load_splits(args.data_dir, args.train_subset, args.val_subset)
        # Every rank must have the data before any goes on: a rank that stopped alone would leave the others
        # waiting in DDP's constructor (a collective) until --dist-timeout. So all ranks share their answer.
        problems = [None] * world_size
        dist.all_gather_object(problems, problem and f"node {args.node_id}: {problem}")
        if agreed_problem(problems):
            raise UserError(agreed_problem(problems))  # every rank stops, naming the node(s) and folder(s)
        on_device = recipe.data_pipeline == "device"
        if on_device:  # the whole uint8 dataset lives on this process's device; batches are cut there
            train_set = DeviceBatches(*train_data, device, augment=recipe.augment, seed=recipe.seed + rank,
                                      channels_last=recipe.channels_last)
            val_set = DeviceBatches(*val_data, device, augment=False, channels_last=recipe.channels_last)
        else:  # per-image transforms on the CPU, in DataLoader worker processes on GPU runs
            train_set = CIFAR10(*train_data, augment=recipe.augment)
            val_set = CIFAR10(*val_data, augment=False)

        # R1.5: each rank reads its own 1/world_size shard. The sampler shuffles with the same seed
        # on every rank (so the shards stay disjoint) and pads to equal length (so every rank runs
        # the same number of steps: DDP needs all ranks in every all-reduce).
        train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                           seed=recipe.seed)
        val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
        val_mask = real_sample_mask(val_sampler)  # the padding repeats are not counted in the metrics
        per_device_batch_size = recipe.batch_size
        global_batch_size = per_device_batch_size * world_size
        # drop_last: a short last batch would change the step size of that step and can leave
        # BatchNorm a single image; every step then has exactly global_batch_size images.
        # SkipFirst lets a run resumed in the middle of an epoch leave out the batches already trained.
        train_batches = SkipFirst(BatchSampler(train_sampler, per_device_batch_size, drop_last=True))
        val_batches = BatchSampler(val_sampler, recipe.eval_batch_size, drop_last=False)
        if on_device:
            # The dataset returns a whole batch per list of indices (batch_size=None: the DataLoader
            # does no collation and needs no workers).
            train_loader = DataLoader(train_set, batch_size=None, sampler=train_batches)  # R1.5
            val_loader = DataLoader(val_set, batch_size=None, sampler=val_batches)  # R1.5
        else:
            # Worker processes feed a GPU; on a CPU run they would only take cores from training.
            num_workers = recipe.num_workers if device.type == "cuda" else 0
            loader_options = dict(num_workers=num_workers, pin_memory=device.type == "cuda",
                                  persistent_workers=num_workers > 0, worker_init_fn=ignore_stop_signal)
            train_loader = DataLoader(train_set, batch_sampler=train_batches, **loader_options)  # R1.5
            val_loader = DataLoader(val_set, batch_sampler=val_batches, **loader_options)  # R1.5
        steps_per_epoch = len(train_batches.batches)
        if steps_per_epoch == 0:
            raise UserError(f"{len(train_set)} training images over {world_size} processes give less than one "
                            f"batch of {per_device_batch_size} per process: use more images or a smaller batch")

        # =================================================================== model
        torch.manual_seed(recipe.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        model = WideResNet(width=args.model_width)
        if recipe.sync_bn:  # batch statistics over the global batch, at the cost of a collective per BN layer
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        memory_format = torch.channels_last if recipe.channels_last else torch.contiguous_format
        model = model.to(device, memory_format=memory_format)
        torch.backends.cudnn.benchmark = recipe.cudnn_benchmark
        # R1.8: DDP registers hooks that average gradients over all ranks during backward.
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,  # R1.8
                    gradient_as_bucket_view=recipe.ddp_bucket_view, static_graph=recipe.ddp_static_graph)
        if recipe.grad_compression == "bf16":  # half the bytes on the wire; the average is rounded to bf16
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        raw_model = model.module  # the plain WideResNet: for evaluation and saving
        # The model the epoch loop evaluates and --save writes: the weights, or their moving average.
        eval_model = raw_model if recipe.ema_decay == 0 else build_ema(raw_model, recipe.ema_decay)  # warms up
        train_model = torch.compile(model) if recipe.compile else model
        # A different random stream per rank for augmentation and dropout: identical streams would
        # crop and drop the same way on every rank and waste part of the extra data.
        torch.manual_seed(recipe.seed + rank)

        # Linear LR scaling: each step averages gradients over global_batch_size images.
        lr = scaled_lr(recipe, global_batch_size)
        optimizer = build_optimizer(raw_model, recipe, lr)
        scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
        criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
        autocast_dtype = torch.bfloat16 if recipe.precision == "bf16" else None

        # Where this run starts: from scratch, or where a checkpoint left off.
        start_epoch, start_step, epoch_time_so_far = 0, 0, 0.0  # the epoch to run, steps of it already done
        cumulative_time, history, streak = 0.0, [], 0  # streak: consecutive epochs at or above the target
        checkpoint_file = checkpoint_path(args.checkpoint_dir) if args.checkpoint_dir else None
        data_sizes = {"train_images": len(train_set), "val_images": len(val_set), "steps_per_epoch": steps_per_epoch}
        checkpoint = None
        if args.resume or args.auto_resume:
            # Each rank reads the checkpoint; rank 0's decides, and every rank must see the same one (or none):
            # never resume some ranks while others start from scratch.
            checkpoint, problem = read_for_resume(args.checkpoint_dir, required=args.resume)
            if checkpoint is not None:
                problem = resume_problem(checkpoint, as_dict(recipe), world_size, args.model_width, data_sizes)
            seen = [None] * world_size
            dist.all_gather_object(seen, (what_was_seen(checkpoint), problem))
            problem = resume_disagreement(seen)
            if problem:
                raise UserError(f"cannot resume from {checkpoint_file}: {problem}")
        if checkpoint is not None:
            raw_model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            if eval_model is not raw_model:
                eval_model.load_state_dict(checkpoint["ema"])
            rng = checkpoint["rng"][rank]  # this rank's own random streams, exactly where they were
            torch.set_rng_state(rng["torch"])
            if device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], device)
            if on_device:
                train_set.generator.set_state(rng["pipeline"])
            start_epoch, start_step, epoch_time_so_far = (checkpoint["epoch"], checkpoint["step"],
                                                          checkpoint["epoch_time_so_far"])
            cumulative_time, history, streak = (checkpoint["cumulative_time"], checkpoint["history"],
                                                checkpoint["streak"])
            if is_main:
                print(f"Resuming from {checkpoint_file}: epoch {start_epoch + 1}, step {start_step} of "
                      f"{steps_per_epoch}, Cumulative Time = {cumulative_time:.3f}", flush=True)
            if checkpoint["finished"]:
                if is_main:
                    print("Nothing to do: that run had already finished", flush=True)
                return

        def save_checkpoint(epoch: int, step: int, epoch_time_so_far: float, finished: bool = False) -> None:
            """Rank 0 writes everything needed to continue at (epoch, step); all ranks wait for it."""
            rng = {"torch": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                   "pipeline": train_set.generator.get_state() if on_device else None}
            every_rng = [None] * world_size if is_main else None
            dist.gather_object(rng, every_rng, dst=0)  # each rank's random state, collected on rank 0
            ok = torch.ones(1, device=device)
            if is_main:
                state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(),
                         "ema": eval_model.state_dict() if eval_model is not raw_model else None,
                         "epoch": epoch, "step": step, "epoch_time_so_far": epoch_time_so_far,
                         "cumulative_time": cumulative_time, "history": history, "streak": streak,
                         "finished": finished, "rng": every_rng, "recipe": as_dict(recipe),
                         "world_size": world_size, "model_width": args.model_width, **data_sizes}
                try:
                    save_atomic(state, checkpoint_file,
                                simulate_enospc=os.environ.get("CIFAR_WRN_TEST_ENOSPC_AT_EPOCH") == str(epoch))
                except OSError as exc:
                    print(f"error: could not write {checkpoint_file}: {exc.strerror or exc}; the previous "
                          f"checkpoint is intact", file=sys.stderr, flush=True)
                    ok.zero_()
            dist.broadcast(ok, src=0)  # also the barrier: nobody goes on before the checkpoint is on disk
            if not ok.item():
                raise UserError(f"rank {rank}: stopping because the checkpoint could not be written")

        log = JsonLog(args.log_json if is_main else None, append=start_epoch > 0 or start_step > 0)
        log.write(run_header(
            world_size=world_size, num_nodes=args.num_nodes, num_gpus=args.num_gpus, backend=backend,
            device=device.type, launcher="torchrun" if launched_by_torchrun() else "mp.spawn",
            per_device_batch_size=per_device_batch_size, global_batch_size=global_batch_size, lr=lr,
            steps_per_epoch=steps_per_epoch, train_images=len(train_set), val_images=len(val_set),
            model_width=args.model_width, model_parameters=count_parameters(raw_model),
            recipe=as_dict(recipe), argv=sys.argv, resumed_at={"epoch": start_epoch + 1, "step": start_step}
            if start_epoch or start_step else None))
        if is_main and args.model_width != COURSE_WIDTH:
            print(f"note: --model-width {args.model_width} is not the course model (width {COURSE_WIDTH})", flush=True)

        # =================================================================== train
        fault_rank = os.environ.get("CIFAR_WRN_TEST_RAISE_IN_RANK")  # test-only fault injection
        if fault_rank is not None and int(fault_rank) == rank:
            raise RuntimeError(f"injected test fault in rank {rank}")
        nan_at = os.environ.get("CIFAR_WRN_TEST_NAN_AT", "")  # test-only: "rank,epoch,step" gets a NaN loss
        stop_at = os.environ.get("CIFAR_WRN_TEST_STOP_AT", "")  # test-only: "epoch,step" acts as a stop signal
        # Every CHECK_EVERY steps, and at the end of each epoch, all ranks agree on two questions so that
        # they stop together at the same step: did any rank get a stop signal (slot 0), and at which step
        # did each rank first see a non-finite loss (slot 1 + rank, 0 = never)? Between checks the flags
        # only accumulate on the device, so the host never waits for the GPU.
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
            train_sampler.set_epoch(epoch)  # R1.6: a new shuffle each epoch, the same on every rank
            train_batches.skip = start_step if epoch == start_epoch else 0
            model.train()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            timer.start()
            for step, (images, labels) in enumerate(train_loader, start=train_batches.skip):
                images = images.to(device, non_blocking=True, memory_format=memory_format)
                labels = labels.to(device, non_blocking=True)
                timer.mark("data")
                with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                    enabled=autocast_dtype is not None):
                    loss = criterion(train_model(images), labels)
                if nan_at == f"{rank},{epoch + 1},{step + 1}":
                    loss = loss * float("nan")
                if stop_at == f"{epoch + 1},{step + 1}":
                    request_stop(None, None)
                timer.mark("forward")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces gradient buckets here, overlapped with backward
                timer.mark("backward")
                if recipe.grad_clip_norm:  # on the averaged gradient, so every rank clips by the same factor
                    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm)
                optimizer.step()  # every rank applies the same averaged gradient: replicas stay identical
                timer.mark("optimizer")
                scheduler.step()
                if eval_model is not raw_model:
                    eval_model.update_parameters(raw_model)

                first_bad = step_flags[1 + rank]
                step_flags[1 + rank] = torch.where((first_bad == 0) & ~torch.isfinite(loss.detach()), step + 1,
                                                   first_bad)
                if (step + 1) % CHECK_EVERY == 0 or step + 1 == steps_per_epoch:
                    step_flags[0] = float(stop_requested)
                    dist.all_reduce(step_flags, op=dist.ReduceOp.MAX)  # the same answer on every rank
                    if step_flags.any():
                        bad = {r: int(step_flags[1 + r]) for r in range(world_size) if step_flags[1 + r] > 0}
                        if bad:
                            raise RunStopped(f"non-finite loss in epoch {epoch + 1} on rank(s) "
                                             f"{', '.join(f'{r} (first at step {s})' for r, s in bad.items())}: "
                                             f"training diverged (try a lower learning rate or a longer warmup); "
                                             f"every rank stopped at step {step + 1}", 1)
                        if not checkpoint_file:
                            raise RunStopped(f"stopped by a signal at epoch {epoch + 1}, step {step + 1}; nothing saved "
                                             f"(no --checkpoint-dir)", 1)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        save_checkpoint(epoch, step + 1, epoch_time_so_far + time.perf_counter() - t0)
                        raise RunStopped(f"stopped by a signal at epoch {epoch + 1}, step {step + 1}: checkpoint written "
                                         f"to {checkpoint_file}; rerun with --resume to continue", PREEMPTED_EXIT)
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
            steps_run = steps_per_epoch - train_batches.skip  # 0 after a resume at the epoch's last step
            if args.profile:  # outside the epoch's clock: a few extra backward passes on the last batch
                comm_estimate = allreduce_cost(model, raw_model, images, labels, criterion, autocast_dtype,
                                               device) * steps_run if steps_run else 0.0

            # R1.9: images/sec is a SUM over ranks: they work on different images at the same time.
            images_per_sec = torch.tensor([steps_per_epoch * per_device_batch_size / epoch_time],
                                          dtype=torch.float64, device=device)
            dist.reduce(images_per_sec, dst=0, op=dist.ReduceOp.SUM)  # R1.9

            # =============================================================== evaluate
            # DDP broadcasts rank 0's BatchNorm statistics at the start of each forward, so after the
            # last step each rank's differ by one update. Take rank 0's, the ones --save writes.
            # (Only the network's buffers: an EMA's update counter is the same on every rank.)
            for buffer in evaluated_network(eval_model).buffers():
                dist.broadcast(buffer, src=0)
            totals = evaluate(eval_model, val_loader, val_mask, device, autocast_dtype,  # [loss sum, correct, count]
                              tta_flip=recipe.tta_flip)
            # R1.9: averaging the sums and the count keeps their ratio exact (AVG divides both by world_size).
            dist.all_reduce(totals, op=dist.ReduceOp.AVG)  # R1.9
            val_loss = (totals[0] / totals[2]).item()
            val_accuracy = (totals[1] / totals[2]).item()

            metrics = {"epoch": epoch + 1, "cumulative_time": cumulative_time, "epoch_time": epoch_time,
                       "images_per_sec": images_per_sec.item(), "val_loss": val_loss, "val_accuracy": val_accuracy}
            if is_main:  # R1.10: one line per epoch, from rank 0 only
                print(epoch_line(metrics), flush=True)  # R1.10
            if args.profile:
                if is_main:
                    print(profile_table(profile, epoch_time, comm_estimate, epoch + 1), flush=True)
                log.write({"kind": "epoch", **metrics, "profile": profile, "comm_estimate": comm_estimate})
            else:
                log.write({"kind": "epoch", **metrics})
            history.append(metrics)

            # Every rank holds the same all-reduced accuracy, so every rank takes the same decision
            # and none is left waiting alone in a collective.
            streak = streak + 1 if val_accuracy >= recipe.target_accuracy else 0
            if checkpoint_file:
                save_checkpoint(epoch + 1, 0, 0.0, finished=streak >= recipe.patience)
            if streak >= recipe.patience:
                if is_main:
                    print(f"Early stopping after epoch {epoch + 1}", flush=True)  # R1.10
                break
        else:
            if is_main:
                print(f"Target accuracy {recipe.target_accuracy} not reached {recipe.patience} epochs in a row "
                      f"within {recipe.epochs} epochs", flush=True)

        # =================================================================== teardown
        if is_main and args.save:
            torch.save(evaluated_network(eval_model).state_dict(), args.save)  # no "module." prefix: loads into WideResNet
        log.close()
    finally:
        dist.destroy_process_group()  # R1.3


def allreduce_cost(model: DDP, raw_model, images, labels, criterion, autocast_dtype, device, repeats: int = 3) -> float:
    """Seconds per step that gradient synchronisation adds to backward (--profile): the same batch's
    backward timed with DDP's all-reduce and inside model.no_sync() (no all-reduce). All ranks must
    call it together. BatchNorm statistics, random state and gradients are put back as they were."""
    def forward():
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            return criterion(model(images), labels)

    with state_restored(raw_model, device):
        seconds = []
        for context in (contextlib.nullcontext, model.no_sync):  # with the all-reduce, then without it
            seconds.append(backward_seconds(forward, lambda loss: loss.backward(), context, device, repeats))
            model.zero_grad(set_to_none=True)
    return max(seconds[0] - seconds[1], 0.0)


def run_process(local_rank: int, args, recipe) -> None:
    """train_process, with every failure reported by the rank it happened in, so nothing is lost
    whichever failed rank the launcher notices first: a UserError as one line (exit status 2),
    anything else with the rank number and its traceback (exit status 1)."""
    _, rank = world_size_and_rank(args.num_nodes, args.num_gpus, args.node_id, local_rank)
    try:
        train_process(local_rank, args, recipe)
    except RunStopped as exc:
        if rank == 0:
            print(f"{'error: ' if exc.status == 1 else ''}{exc}", file=sys.stderr, flush=True)
        sys.exit(exc.status)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as exc:
        if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)) or any(
                text in str(exc) for text in PEER_LOST):  # a collective broke: usually a peer died
            print(f"error: rank {rank} lost contact with another process, which probably failed (see its error "
                  f"above or in its node's log): {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        else:
            print(f"error: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


# What gloo and NCCL say when the process at the other end of a connection has gone away.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def resolve(args) -> tuple[argparse.Namespace, object]:
    """Fill in what the launch implies (device, port, torchrun's ranks), check it, and read the recipe."""
    recipe = recipe_from_args(args)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        if cuda_count == 0:
            warnings.warn("CUDA is not available: running on the CPU with the gloo backend", stacklevel=1)
        args.device = "cuda" if cuda_count else "cpu"
    if launched_by_torchrun():  # torchrun decided the topology; take it from its environment
        args.num_gpus = int(os.environ["LOCAL_WORLD_SIZE"])
        args.num_nodes = int(os.environ["WORLD_SIZE"]) // args.num_gpus
        args.node_id = int(os.environ["RANK"]) // args.num_gpus
        args.master_port = int(os.environ.get("MASTER_PORT", 0)) or None
    elif args.num_nodes == 1:  # a single node can meet at home, on any free port
        args.master_addr = args.master_addr or "127.0.0.1"
        args.master_port = free_port() if args.master_port is None else args.master_port
    check_launch(args, cuda_count)
    if recipe.sync_bn and args.device == "cpu":
        raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
    return args, recipe


if __name__ == "__main__":
    try:
        args, recipe = resolve(parse_args())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if launched_by_torchrun():
        run_process(int(os.environ["LOCAL_RANK"]), args, recipe)
        sys.exit(0)
    # R1.11: start one process per GPU on this node; each runs run_process(local_rank, args, recipe).
    # A stop request to this launcher (Slurm's SIGUSR1 or SIGTERM) is passed on to the ranks as SIGUSR1,
    # so that they can agree on a step, write a checkpoint and exit with PREEMPTED_EXIT.
    ranks = []

    def pass_on_stop(signum, frame):
        for process in ranks:
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, pass_on_stop)
    signal.signal(signal.SIGTERM, pass_on_stop)
    try:
        context = mp.spawn(run_process, args=(args, recipe), nprocs=args.num_gpus, join=False)  # R1.11
        ranks.extend(context.processes)
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:  # a rank ended with an error; mp.spawn has stopped the others
        if exc.signal_name:  # killed (the OOM killer, say): it could not report anything itself
            _, failed = world_size_and_rank(args.num_nodes, args.num_gpus, args.node_id, exc.error_index)
            print(f"error: rank {failed} was killed by {exc.signal_name}", file=sys.stderr)
        sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)
