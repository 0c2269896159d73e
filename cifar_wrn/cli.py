"""Command-line flags both entry points share, and what the launcher says."""

import argparse
import os
import socket
import sys

from .errors import UserError
from .model import COURSE_WIDTH
from .recipe import Recipe, load_recipe, parse_set
from .safe_files import check_writable

# Both trainers, where CUDA is missing and no device was asked for: they train on the CPU after saying so.
CPU_FALLBACK_WARNING = (
    "warning: CUDA is not available: running on the CPU with the gloo backend; a full-data epoch there takes about "
    "an hour on 2 cores (baseline recipe), so add --device cpu --train-subset 2000 --val-subset 1000 --epochs 2 "
    "for a short run"
)
NO_CUDA = "--device cuda, but CUDA is not available here (use --device cpu or auto)"
RECIPE_FLAGS = ("epochs", "batch_size", "base_lr", "target_accuracy", "patience", "seed")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """The flags both trainers take; docs/flags.md explains each."""
    p.add_argument("--dist-timeout", type=float, default=600.0, help="seconds any collective may wait (default 600)")
    p.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py/ (default ./data)")
    p.add_argument("--recipe", default="baseline", help="recipe name in recipes/ or a YAML path (default baseline)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key (repeatable)")
    p.add_argument("--epochs", type=int, help="maximum epochs (recipe: 40)")
    p.add_argument("--batch-size", type=int, help="images per process per step (recipe: 32)")
    p.add_argument("--base-lr", type=float, help="learning rate at the reference batch size (recipe: 0.01)")
    p.add_argument("--target-accuracy", type=float, help="validation accuracy to reach (recipe: 0.85)")
    p.add_argument("--patience", type=int, help="consecutive epochs at the target before stopping (recipe: 2)")
    p.add_argument("--seed", type=int, help="random seed (recipe: 0)")
    p.add_argument("--save", metavar="PATH", help="write the final weights (plain WideResNet state_dict)")
    p.add_argument("--log-json", metavar="PATH", help="the JSON-lines log (default: a new folder under runs/)")
    p.add_argument("--train-subset", type=int, metavar="N", help="train on the first N images only")
    p.add_argument("--val-subset", type=int, metavar="N", help="validate on the first N images only")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoint each epoch and on SIGUSR1/SIGTERM")
    p.add_argument("--resume", action="store_true", help="continue from DIR's checkpoint; fail if there is none")
    p.add_argument("--auto-resume", action="store_true", help="continue from DIR's checkpoint if any, else start fresh")
    p.add_argument("--profile", action="store_true", help="per epoch: time in data, forward, backward, optimizer")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler trace of steps 3-5 (TensorBoard/Perfetto)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="live bars (auto: on a terminal)")
    p.add_argument("--model-width", type=int, default=COURSE_WIDTH, help="tests only: never change it in a real run")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe file, then --set, then the dedicated flags, validated."""
    overrides = parse_set(args.set)
    overrides.update({flag: getattr(args, flag) for flag in RECIPE_FLAGS if getattr(args, flag) is not None})
    return load_recipe(args.recipe, overrides)


def show_progress(args: argparse.Namespace, is_main: bool) -> bool:
    """Whether to draw progress bars: main process only; with --progress auto, only on a terminal."""
    mode = getattr(args, "progress", "auto")
    if not is_main or mode == "off":
        return False
    if mode == "on":
        return True
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def check_training_flags(args: argparse.Namespace, writes_outputs: bool = True) -> None:
    """The flag checks that need no process group; `writes_outputs`: this process writes --save, --log-json."""
    for flag in ("epochs", "batch_size", "train_subset", "val_subset", "model_width"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.dist_timeout <= 0:
        raise UserError(f"--dist-timeout must be > 0 seconds (got {args.dist_timeout})")
    for flag in ("save", "log_json"):
        path = getattr(args, flag)
        if path and writes_outputs and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise UserError(f"--{flag.replace('_', '-')} {path}: the folder does not exist or is not writable")
    if (args.resume or args.auto_resume) and not args.checkpoint_dir:
        raise UserError("--resume and --auto-resume need --checkpoint-dir")
    if args.resume and args.auto_resume:
        raise UserError("use either --resume (a checkpoint must exist) or --auto-resume (start fresh without one)")
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir)


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


def port_from_env() -> int | None:
    return int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT", "").isdigit() else None


WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launcher_world_size() -> int | None:
    """Processes the launcher started in all, or None."""
    for key in WORLD_SIZE_VARS:
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def local_world_size(default: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def launcher_name() -> str:
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ:  # first: accelerate launch runs torchrun inside
        return "accelerate launch"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "python"


def accelerate_launch_problem(seen: int, distributed_type: str, device_type: str, version: str) -> str | None:
    """Why Accelerate did not join the processes the launch started (each would train alone), or None."""
    started = launcher_world_size()
    if started is not None and started != seen:
        return (
            f"the launcher started {started} processes (WORLD_SIZE={started}) but Accelerate sees {seen} "
            f"(distributed_type {distributed_type}, device {device_type}): each process would train alone. "
            f"Without CUDA, a MULTI_GPU launch must be told to use the CPU: add --cpu after accel_train.py or "
            f"set ACCELERATE_USE_CPU=1 (`use_cpu: true` in the config file does not reach the processes of a "
            f"MULTI_GPU launch). See docs/accelerate.md, CPU traps."
        )
    # accelerate launch's single-process launcher sets MASTER_PORT only when asked for several processes.
    if started is None and seen == 1 and launcher_name() == "accelerate launch" and os.environ.get("MASTER_PORT"):
        return (
            "accelerate launch was asked for several processes but started only this one: `accelerate launch "
            f"--cpu --num_processes N` and `distributed_type: MULTI_CPU` configs run a single process (accelerate "
            f"{version}). For N CPU processes use `accelerate launch --config_file "
            "accelerate_configs/two_cpus.yaml accel_train.py --cpu ...` (a MULTI_GPU config, --num_processes N). "
            "If you meant one process and exported MASTER_PORT yourself, unset it."
        )
    return None


def check_launch(args, cuda_device_count: int) -> None:
    """raw_ddp.py's launch flags, before any process starts."""
    if args.num_nodes < 1:
        raise UserError(f"--num-nodes must be >= 1 (got {args.num_nodes})")
    if not 0 <= args.node_id < args.num_nodes:
        raise UserError(
            f"--node-id must be in [0, {args.num_nodes - 1}] for --num-nodes {args.num_nodes} (got {args.node_id})"
        )
    if args.num_gpus < 1:
        raise UserError(f"--num-gpus must be >= 1 (got {args.num_gpus})")
    if args.device == "cuda" and cuda_device_count == 0:
        raise UserError(NO_CUDA)
    if args.device == "cuda" and args.num_gpus > cuda_device_count:
        raise UserError(f"--num-gpus {args.num_gpus}, but this node has only {cuda_device_count} CUDA device(s)")
    check_training_flags(args, writes_outputs=args.node_id == 0)
    if args.master_addr is None:
        raise UserError(
            "--master-addr (or $MASTER_ADDR) is required with more than one node: the address of "
            "node 0, which every node can reach"
        )
    if args.master_port is None and args.num_nodes > 1:
        raise UserError(
            "--master-port (or $MASTER_PORT) is required with more than one node, "
            "so that every node meets at the same port"
        )
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UserError(f"--master-port must be in 1-65535 (got {args.master_port})")
    if (
        args.master_port is not None
        and args.node_id == 0
        and not launched_by_torchrun()
        and not port_is_free(args.master_port)
    ):
        raise UserError(
            f"--master-port {args.master_port} is already in use on this machine (another run?); pick another port"
        )


def resolve_raw_launch(args) -> tuple[argparse.Namespace, Recipe]:
    """raw_ddp.py: fill in what the launch implies (the device; under torchrun its ranks), check the flags (R1.1),
    read the recipe; before any process starts."""
    import torch

    from .recipe import slow_bf16_warning

    recipe = recipe_from_args(args)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    node_main = os.environ.get("LOCAL_RANK", "0") == "0"
    if args.device == "auto":
        if cuda_count == 0 and node_main:
            print(CPU_FALLBACK_WARNING, file=sys.stderr)
        args.device = "cuda" if cuda_count else "cpu"
    args.master_port = port_from_env() if args.master_port is None else args.master_port
    args.torchrun_local_rank, args.launcher_store = None, False
    if launched_by_torchrun():
        args.torchrun_local_rank = int(os.environ["LOCAL_RANK"])
        args.num_gpus = int(os.environ["LOCAL_WORLD_SIZE"])
        args.num_nodes = int(os.environ["WORLD_SIZE"]) // args.num_gpus
        args.node_id = int(os.environ["RANK"]) // args.num_gpus
        args.master_port = int(os.environ.get("MASTER_PORT", 0)) or None
    elif args.num_nodes == 1:
        args.master_addr = args.master_addr or "127.0.0.1"
    check_launch(args, cuda_count)
    if (warning := slow_bf16_warning(args.device, recipe.precision)) and node_main:
        print(warning, file=sys.stderr)
    if recipe.sync_bn and args.device == "cpu":
        raise UserError("sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation")
    return args, recipe


def resolve_accel_launch(args) -> tuple[argparse.Namespace, Recipe]:
    """accel_train.py: the device asked for, the launch's mixed precision against the recipe's, the flags and the
    recipe checked; before the process group forms."""
    import dataclasses

    import torch
    from accelerate.utils import parse_flag_from_env

    recipe = recipe_from_args(args)
    # auto without CUDA: the CPU, after a warning
    args.cpu_fallback = args.device == "auto" and not args.cpu and not torch.cuda.is_available()
    args.cpu |= args.device == "cpu" or args.cpu_fallback
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
