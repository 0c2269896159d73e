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
"""
# ============================================================================ setup
import argparse
import dataclasses
import os
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
from accelerate.utils import broadcast, parse_flag_from_env, set_seed
from torch.utils.data import DataLoader

from cifar_wrn.data import CIFAR10, dataset_present, download_cifar10, how_to_provide, load_split
from cifar_wrn.errors import UserError
from cifar_wrn.model import COURSE_WIDTH, WideResNet, count_parameters
from cifar_wrn.recipe import (as_dict, build_optimizer, build_scheduler, load_recipe, parse_set, scaled_lr)
from cifar_wrn.runlog import JsonLog, epoch_line, run_header

# Flags that are recipe keys: given on the command line they override the recipe file.
RECIPE_FLAGS = {"epochs": "epochs", "batch_size": "batch_size", "base_lr": "base_lr",
                "target_accuracy": "target_accuracy", "patience": "patience", "seed": "seed"}

# The recipe keys this trainer implements. Any other key (an optimisation raw_ddp.py may offer) must keep
# its default: a recipe asking for it is refused rather than silently trained without it.
SUPPORTED_RECIPE_KEYS = frozenset({
    "epochs", "target_accuracy", "patience", "batch_size", "base_lr", "lr_scaling", "reference_batch_size",
    "lr_schedule", "warmup_epochs", "momentum", "nesterov", "weight_decay", "label_smoothing", "precision",
    "augment", "num_workers", "eval_batch_size", "seed"})

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
    p.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py/ (default ./data)")
    p.add_argument("--recipe", default="baseline", help="recipe name in recipes/ or a YAML path (default baseline)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one recipe key, e.g. --set momentum=0.9 (repeatable)")
    p.add_argument("--epochs", type=int, help="maximum epochs (recipe: 40)")
    p.add_argument("--batch-size", type=int, help="images per process per step (recipe: 32)")
    p.add_argument("--base-lr", type=float, help="learning rate at the reference batch size (recipe: 0.01)")
    p.add_argument("--target-accuracy", type=float, help="validation accuracy to reach (recipe: 0.85)")
    p.add_argument("--patience", type=int, help="consecutive epochs at the target before stopping (recipe: 2)")
    p.add_argument("--seed", type=int, help="random seed (recipe: 0)")
    p.add_argument("--save", metavar="PATH", help="write the final weights (plain WideResNet state_dict)")
    p.add_argument("--log-json", metavar="PATH", help="write a JSON-lines log: a header, then one object per epoch")
    p.add_argument("--train-subset", type=int, metavar="N", help="train on the first N images only")
    p.add_argument("--val-subset", type=int, metavar="N", help="validate on the first N images only")
    p.add_argument("--model-width", type=int, default=COURSE_WIDTH,
                   help=f"tests only: first block width (default {COURSE_WIDTH}, the course model; never change it "
                        f"in a real run)")
    return p.parse_args(argv)


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
            kwargs_handlers=[
                # A1.8: the DDP settings raw_ddp.py gets from torch's defaults, spelled out.
                DistributedDataParallelKwargs(broadcast_buffers=True, bucket_cap_mb=25,
                                              find_unused_parameters=False, gradient_as_bucket_view=False),
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
        # =================================================================== data
        # A1.4: one process per node downloads (if needed); the others wait until it has left the block,
        # so that nobody reads a half-written file. (One per node, because nodes may not share a disk.)
        with accelerator.local_main_process_first():
            if accelerator.is_local_main_process and not dataset_present(args.data_dir):
                problem = download_cifar10(args.data_dir)
                if problem:
                    accelerator.print(f"rank {rank}: {problem}", file=sys.stderr, flush=True)  # once per node
        if not dataset_present(args.data_dir):
            raise UserError(how_to_provide(args.data_dir))  # every rank stops with the same message
        train_set = CIFAR10(*load_split(args.data_dir, train=True, subset=args.train_subset), augment=recipe.augment)
        val_set = CIFAR10(*load_split(args.data_dir, train=False, subset=args.val_subset), augment=False)

        per_device_batch_size = recipe.batch_size
        global_batch_size = per_device_batch_size * world_size
        # Worker processes feed a GPU; on a CPU run they would only take cores from training.
        num_workers = recipe.num_workers if device.type == "cuda" else 0
        # Plain loaders over the whole data set. drop_last: a short last batch would change the step size
        # of that step and can leave BatchNorm a single image.
        train_loader = DataLoader(train_set, batch_size=per_device_batch_size, shuffle=True, drop_last=True,
                                  num_workers=num_workers, pin_memory=device.type == "cuda",
                                  persistent_workers=num_workers > 0)
        val_loader = DataLoader(val_set, batch_size=recipe.eval_batch_size, shuffle=False,
                                num_workers=num_workers, pin_memory=device.type == "cuda",
                                persistent_workers=num_workers > 0)
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
        # Linear LR scaling: each step averages gradients over global_batch_size images.
        lr = scaled_lr(recipe, global_batch_size)
        optimizer = build_optimizer(model, recipe, lr)
        scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
        # A1.7 + A1.8: prepare moves the model to accelerator.device and wraps it in DDP (hooks that average
        # gradients over all ranks during backward); with bf16 its forward also runs under autocast.
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)  # A1.8
        raw_model = accelerator.unwrap_model(model)  # the plain WideResNet (autocast kept): evaluation, saving
        # A different random stream per rank (seed + rank) for augmentation and dropout: identical streams
        # would crop and drop the same way on every rank and waste part of the extra data.
        set_seed(recipe.seed, device_specific=True)

        criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)

        log = JsonLog(args.log_json if is_main else None)
        log.write(run_header(
            world_size=world_size, num_nodes=world_size // local_processes, num_gpus=local_processes,
            backend=accelerator.state.backend or "none", device=device.type, launcher=launcher_name(),
            per_device_batch_size=per_device_batch_size, global_batch_size=global_batch_size, lr=lr,
            steps_per_epoch=steps_per_epoch, train_images=len(train_set), val_images=len(val_set),
            model_width=args.model_width, model_parameters=count_parameters(raw_model),
            recipe=as_dict(recipe), argv=sys.argv, trainer="accelerate", accelerate_version=accelerate.__version__,
            distributed_type=accelerator.distributed_type.value, mixed_precision=accelerator.mixed_precision))
        if args.precision_note:
            main_print(f"note: {args.precision_note}", flush=True)
        if args.model_width != COURSE_WIDTH:
            main_print(f"note: --model-width {args.model_width} is not the course model (width {COURSE_WIDTH})",
                       flush=True)

        # =================================================================== train
        fault_rank = os.environ.get("CIFAR_WRN_TEST_RAISE_IN_RANK")  # test-only fault injection
        if fault_rank is not None and int(fault_rank) == rank:
            raise RuntimeError(f"injected test fault in rank {rank}")
        cumulative_time = 0.0  # training time only: validation is outside the clock
        streak = 0  # consecutive epochs at or above the target accuracy
        for epoch in range(recipe.epochs):
            # A1.6: no set_epoch here: each `for` over the prepared loader calls set_epoch(pass number) itself.
            model.train()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for images, labels in train_loader:  # A1.7: batches arrive on accelerator.device already
                loss = criterion(model(images), labels)  # autocast (bf16) is inside model.forward
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss)  # DDP all-reduces gradient buckets here, overlapped with backward
                optimizer.step()  # every rank applies the same averaged gradient: replicas stay identical
                scheduler.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the clock stops when the GPU has finished, not when it was told
            epoch_time = time.perf_counter() - t0
            cumulative_time += epoch_time

            # A1.9: images/sec is a SUM over ranks: they work on different images at the same time.
            images_per_sec = accelerator.reduce(torch.tensor([steps_per_epoch * per_device_batch_size / epoch_time],
                                                             dtype=torch.float64, device=device), reduction="sum")

            # =============================================================== evaluate
            # DDP broadcasts rank 0's BatchNorm statistics at the start of each forward, so after the
            # last step each rank's differ by one update. Take rank 0's, the ones --save writes.
            broadcast(list(raw_model.buffers()), from_process=0)
            raw_model.eval()
            totals = torch.zeros(3, dtype=torch.float64, device=device)  # [loss sum, correct, count]
            with torch.no_grad():
                for images, labels in val_loader:
                    logits = raw_model(images)  # fp32 logits (prepare converts autocast outputs back)
                    losses = F.cross_entropy(logits.float(), labels, reduction="none").double()
                    correct = (logits.argmax(1) == labels).double()
                    # A1.9: every rank's per-image results, with the padding repeats of the last batch dropped.
                    losses, correct = accelerator.gather_for_metrics((losses, correct))  # A1.9
                    totals += torch.stack([losses.sum(), correct.sum(), torch.tensor(len(correct), device=device,
                                                                                     dtype=torch.float64)])
            if int(totals[2].item()) != len(val_set):  # exactness check: every image counted exactly once
                raise RuntimeError(f"validation counted {int(totals[2].item())} images, expected {len(val_set)}")
            val_loss = (totals[0] / totals[2]).item()
            val_accuracy = (totals[1] / totals[2]).item()

            metrics = {"epoch": epoch + 1, "cumulative_time": cumulative_time, "epoch_time": epoch_time,
                       "images_per_sec": images_per_sec.item(), "val_loss": val_loss, "val_accuracy": val_accuracy}
            main_print(epoch_line(metrics), flush=True)  # A1.10: one line per epoch, from rank 0 only
            log.write({"kind": "epoch", **metrics})

            # Every rank holds the same gathered accuracy, so every rank takes the same decision
            # and none is left waiting alone in a collective.
            streak = streak + 1 if val_accuracy >= recipe.target_accuracy else 0
            if streak >= recipe.patience:
                main_print(f"Early stopping after epoch {epoch + 1}", flush=True)  # A1.10
                break
        else:
            main_print(f"Target accuracy {recipe.target_accuracy} not reached {recipe.patience} epochs in a row "
                       f"within {recipe.epochs} epochs", flush=True)

        # =================================================================== teardown
        if args.save:  # main process only; no "module." prefix: loads into WideResNet
            accelerator.save(accelerator.get_state_dict(model), args.save)
        log.close()
    finally:
        accelerator.end_training()  # A1.3: destroys the process group


def run_process(args, recipe) -> None:
    """train_process, with every failure reported by the rank it happened in, so nothing is lost
    whichever failed rank the launcher notices first: a UserError as one line (exit status 2),
    anything else with the rank number and its traceback (exit status 1)."""
    rank = os.environ.get("RANK", "0")  # the launcher's numbering, the same as accelerator.process_index
    try:
        train_process(args, recipe)
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
    overrides = parse_set(args.set)
    overrides.update({key: getattr(args, flag) for flag, key in RECIPE_FLAGS.items() if getattr(args, flag) is not None})
    recipe = load_recipe(args.recipe, overrides)
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
    return args, recipe


if __name__ == "__main__":
    try:
        args, recipe = resolve(parse_args())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    # A1.11: no spawning here: the launcher (accelerate launch / torchrun) started one process per GPU.
    run_process(args, recipe)
