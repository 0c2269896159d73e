"""The command line both entry points share, checked before any process group forms."""

import argparse
import errno
import fcntl
import os
import platform
import sys
import tempfile
from dataclasses import dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

import torch

from .checkpoint import check_writable, refuse_overwrite
from .errors import UserError, said_by_one
from .launchers import CPU_FALLBACK_WARNING, launched_by_torchrun, launcher_world_size, port_is_free
from .model import COURSE_WIDTH
from .optim import scaled_lr
from .recipe import FLOAT32_MAX, Recipe, RecipeError, load_recipe, parse_set, slow_bf16_warning

NO_CUDA = "--device cuda, but CUDA is not available here (use --device cpu or auto)"
NO_SYNC_BN = "sync_bn needs CUDA: PyTorch's SyncBatchNorm has no CPU implementation"


@dataclass(frozen=True)
class DataSource:
    data_dir: str = "data"  # holds cifar-10-batches-py/
    train_subset: int | None = None  # the first N images only
    val_subset: int | None = None


@dataclass(frozen=True)
class Checkpoints:
    directory: str | None = None  # None: no checkpoints
    resume: Literal["required", "if-any"] | None = None  # --resume, --auto-resume; None: start afresh


@dataclass(frozen=True)
class Logging:
    log_json: str | None = None  # None: a new folder under runs/
    recipe_name: str = "baseline"  # names that folder
    tracking_dir: str | None = None  # TensorBoard's, when --with-tracking
    profile: bool = False
    trace: str | None = None
    notes: tuple = ()  # said by rank 0 as training starts


@dataclass(frozen=True)
class Settings:
    """The command line, resolved once here; the package takes these values, never the argparse namespace."""

    device: str  # raw_ddp.py: cuda or cpu; accel_train.py: auto, cuda or cpu
    dist_timeout: float  # seconds
    data: DataSource = field(default_factory=DataSource)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    logging: Logging = field(default_factory=Logging)
    save: str | None = None  # the final weights
    progress: str = "auto"  # live bars: auto, on, off
    model_width: int = COURSE_WIDTH
    # raw_ddp.py's launch (accel_train.py's is the launcher's)
    num_nodes: int = 1
    node_id: int = 0
    num_gpus: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    torchrun_local_rank: int | None = None  # not None: torchrun started this process, one rank
    # accel_train.py's
    cpu: bool = False  # Accelerator(cpu=...)
    cpu_fallback: bool = False  # --device auto found no CUDA: warned of once the group forms

    @property
    def first_rank(self) -> int:  # this node's local rank 0
        return self.node_id * self.num_gpus


def settings_from(args: argparse.Namespace, notes: list = (), **launch) -> Settings:
    """The only reader of the argparse namespace besides the entry points' parse_args."""
    resume = "required" if args.resume else "if-any" if args.auto_resume else None
    return Settings(
        device=args.device,
        dist_timeout=args.dist_timeout,
        data=DataSource(args.data_dir, args.train_subset, args.val_subset),
        checkpoints=Checkpoints(args.checkpoint_dir, resume),
        logging=Logging(
            args.log_json,
            args.recipe,
            args.project_dir if args.with_tracking else None,
            args.profile,
            args.trace,
            tuple(notes),
        ),
        save=args.save,
        progress=args.progress,
        model_width=args.model_width,
        **launch,
    )


RECIPE_FLAGS = dict(
    epochs=(int, "maximum epochs"),
    batch_size=(int, "images per process per step"),
    base_lr=(float, "learning rate at the reference batch size"),
    target_accuracy=(float, "validation accuracy to reach"),
    patience=(int, "consecutive epochs at the target before stopping"),
    seed=(int, "random seed"),
)


def add_training_flags(p: argparse.ArgumentParser, launch):
    """The other flags; docs/flags.md explains each."""
    launch.add_argument(
        "--dist-timeout", type=float, default=600.0, help="seconds any collective may wait (default 600)"
    )
    add = p.add_argument_group("data").add_argument
    add("--data-dir", default="data", help="folder holding cifar-10-batches-py/ (default ./data)")
    add("--train-subset", type=int, metavar="N", help="train on the first N images only")
    add("--val-subset", type=int, metavar="N", help="validate on the first N images only")
    add = p.add_argument_group("recipe").add_argument
    add("--recipe", default="baseline", help="baseline, fast, or a YAML path (default baseline)")
    keys = "override a recipe key (repeatable); the keys: class Recipe in cifar_wrn/recipe.py"
    add("--set", action="append", default=[], metavar="KEY=VALUE", help=keys)
    for key, (kind, text) in RECIPE_FLAGS.items():
        add(f"--{key.replace('_', '-')}", type=kind, help=f"{text} (default: the recipe's)")
    add = p.add_argument_group("checkpoints and resume").add_argument
    add("--checkpoint-dir", metavar="DIR", help="checkpoint each epoch and on SIGUSR1/SIGTERM")
    add("--resume", action="store_true", help="continue from DIR's checkpoint; fail if there is none")
    add("--auto-resume", action="store_true", help="continue from DIR's checkpoint if any, else start fresh")
    add("--save", metavar="PATH", help="write the final weights (plain WideResNet state_dict)")
    add = p.add_argument_group("logs and diagnostics").add_argument
    add("--log-json", metavar="PATH", help="the JSON-lines log (default: a new folder under runs/)")
    add("--with-tracking", action="store_true", help="TensorBoard events of the epoch line and the loss")
    runs = os.environ.get("RUNS_DIR") or "runs"  # by default, in the run's own folder
    add("--project-dir", default=runs, metavar="DIR", help="--with-tracking's folder, a run each (default runs/)")
    add("--profile", action="store_true", help="per epoch: time in data, forward, backward, optimizer")
    add("--trace", metavar="DIR", help="write a torch.profiler trace of steps 3-5 (TensorBoard/Perfetto)")
    add("--progress", choices=("auto", "on", "off"), default="auto", help="live bars (auto: on a terminal)")
    add("--model-width", type=int, default=COURSE_WIDTH, help=argparse.SUPPRESS)  # tests only: tiny models


def launch_commands(doc: str) -> str:
    """--help's epilog: the entry point's docstring from its first command on."""
    return doc and "commands:\n" + doc[doc.index("\n    # ") + 1 :]  # None: python -OO


def recipe_from_args(args) -> Recipe:
    """The recipe file, then --set, then the dedicated flags."""
    dedicated = {key: v for key in RECIPE_FLAGS if (v := getattr(args, key)) is not None}
    return load_recipe(args.recipe, {**parse_set(args.set), **dedicated})


def show_progress(settings: Settings, is_main: bool) -> bool:
    try:
        return is_main and settings.progress != "off" and (settings.progress == "on" or sys.stderr.isatty())
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


def at_least_one(args, *flags: str):
    for flag in flags:
        if (value := getattr(args, flag)) is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")


def check_training_flags(args, writes_outputs: bool = True):
    """`writes_outputs`: this process writes --save and --log-json."""
    at_least_one(args, "train_subset", "val_subset", "model_width")  # the recipe checks --epochs, --batch-size
    if not 0 < args.dist_timeout <= 1e9:  # torch's deadlines: int64 nanoseconds
        raise UserError(f"--dist-timeout must be a number of seconds in (0, 1e+09] (got {args.dist_timeout:g})")
    check_output_paths(args, writes_outputs)
    if (args.resume or args.auto_resume) and not args.checkpoint_dir:
        raise UserError("--resume and --auto-resume need --checkpoint-dir")
    if args.resume and args.auto_resume:
        raise UserError("use --resume (a checkpoint must exist) or --auto-resume, not both")
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir)
    if args.with_tracking and not find_spec("tensorboard"):
        raise UserError(
            "--with-tracking writes TensorBoard events: pip install tensorboard (or the extra: .[tensorboard])"
        )


def check_output_paths(args, writes_outputs: bool):
    """Each output is what it is meant to be (a file, a folder) in a place this process can write, before any
    process trains; a fresh run's --log-json is new or empty (a resume appends)."""
    files = (("save", args.save), ("log-json", args.log_json)) if writes_outputs else ()
    for flag, path in files:
        if path and os.path.isdir(path):
            raise UserError(f"--{flag} {path} is a folder: give the path of a file in it")
        if path:
            writable_folder(flag, path, Path(path).absolute().parent, created=False)
    tracking = args.project_dir if args.with_tracking and writes_outputs else None
    for flag, path in (("trace", args.trace), ("project-dir", tracking), ("checkpoint-dir", args.checkpoint_dir)):
        if path:
            writable_folder(flag, path, Path(path).absolute(), created=True)
    fresh, log = not (args.resume or args.auto_resume), args.log_json
    if fresh and log and writes_outputs and os.path.isfile(log) and os.path.getsize(log):
        raise UserError(
            f"--log-json {log} holds a run's log already, which a fresh run would overwrite: give another path "
            "(only the run that wrote it, resumed with --auto-resume from its --checkpoint-dir, appends to it)"
        )


def writable_folder(flag: str, path, folder: Path, created: bool):
    """`folder`, or where `created` the nearest folder above it that exists (the run makes the rest), is a folder
    this process can write in: tried, as root's permissions pass any test."""
    while created and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(
            f"--{flag} {path}: the folder {'is a file' if folder.exists() else 'does not exist'} ({folder})"
        )
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise UserError(f"--{flag} {path}: {folder} is not writable ({exc.strerror or exc})") from None


def hold_folder(directory):
    """One run a folder: fcntl's POSIX lock on DIR/.lock, which the OS drops when its process ends, however it ends
    (NFS included); the file names the holder to a second run, which stops."""
    path = os.path.join(directory, ".lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never closed: held to the exit
    except OSError as exc:
        raise UserError(f"{path} cannot be opened ({exc.strerror}; a symbolic link is refused)") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):  # a file system without locks holds nothing
            return
        holder = os.read(fd, 300).decode("utf-8", "replace").strip() or "another run"
        raise UserError(
            f"--checkpoint-dir {directory} is in use by {holder}: one run a folder; wait for it to end, or give "
            "another --checkpoint-dir"
        ) from None
    job = f", Slurm job {os.environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in os.environ else ""
    os.ftruncate(fd, 0)
    os.write(fd, f"the run of pid {os.getpid()} on {platform.node()}{job}\n".encode())


def claim_checkpoint_dir(args, accel: bool, holder: bool):
    """The run's one `holder` process holds --checkpoint-dir to its end; a fresh run's folder holds no checkpoint
    (seen alike by every process: all stop at once)."""
    if args.checkpoint_dir and holder:
        hold_folder(args.checkpoint_dir)
    if args.checkpoint_dir and not (args.resume or args.auto_resume):
        refuse_overwrite(args.checkpoint_dir, accel)


def check_learning_rates(recipe: Recipe, world_size: int):
    lr, batch = scaled_lr(recipe, recipe.batch_size * world_size), recipe.batch_size * world_size
    for what, value in (("", lr), ("BatchNorm parameters' ", lr * recipe.bn_lr_scale)):
        if not value <= FLOAT32_MAX:  # SGD's step would overflow
            raise RecipeError(
                f"invalid recipe: the {what}learning rate {value:g} (base_lr {recipe.base_lr:g}, lr_scaling "
                f"{recipe.lr_scaling}, global batch {batch}, bn_lr_scale {recipe.bn_lr_scale:g}) is beyond "
                f"{FLOAT32_MAX:.2g}, the largest float32"
            )


def check_launch(args, cuda_device_count: int):
    at_least_one(args, "num_nodes", "num_gpus")
    if not 0 <= args.node_id < args.num_nodes:
        raise UserError(
            f"--node-id must be in [0, {args.num_nodes - 1}] for --num-nodes {args.num_nodes} (got {args.node_id})"
        )
    if args.device == "cuda" and args.num_gpus > cuda_device_count:
        only = f"--num-gpus {args.num_gpus}, but this node has only {cuda_device_count} CUDA device(s)"
        raise UserError(only if cuda_device_count else NO_CUDA)
    # gloo ranks beyond a few a core only take turns (each step waits for the slowest), each with its own memory
    if args.device == "cpu" and args.num_gpus > (most := 4 * len(os.sched_getaffinity(0))):
        raise UserError(f"--num-gpus {args.num_gpus} CPU processes: at most {most} here, 4 a core this process may use")
    check_training_flags(args, writes_outputs=args.node_id == 0)
    port = args.master_port
    for flag, missing, why in (
        ("addr", args.master_addr is None, "node 0's address, which every node can reach"),
        ("port", port is None and args.num_nodes > 1, "where every node meets"),
    ):
        if missing:
            raise UserError(f"--master-{flag} (or $MASTER_{flag.upper()}) is required with more than one node: {why}")
    if port is not None and not 1 <= port <= 65535:
        raise UserError(f"--master-port must be in 1-65535 (got {port})")
    if port and args.node_id == 0 and not launched_by_torchrun() and not port_is_free(port):
        raise UserError(f"--master-port {port} is already in use on this machine (another run?); pick another port")


def refuse_full_run_without_gpu(args, cuda: bool, cpu_asked=False) -> None:
    """--device auto without CUDA on the full data: hours on the CPU, never started by accident."""
    if args.device == "auto" and not (cuda or cpu_asked or args.train_subset):
        raise UserError(
            "no GPU here: submit the job (README), or train on the CPU with --device cpu (hours on the full data; "
            "a short run: add --train-subset 2000 --val-subset 1000 --epochs 2)"
        )


@said_by_one()  # under torchrun
def resolve_raw_launch(args: argparse.Namespace) -> tuple[Settings, Recipe]:
    """raw_ddp.py's device and ranks, the flags checked (R1.1)."""
    recipe = recipe_from_args(args)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    node_main = os.environ.get("LOCAL_RANK", "0") == "0"
    refuse_full_run_without_gpu(args, cuda_count > 0)
    if args.device == "auto":
        args.device = "cuda" if cuda_count else "cpu"
        if not cuda_count and node_main:
            print(CPU_FALLBACK_WARNING, file=sys.stderr)
    torchrun_local_rank, env_port = None, os.environ.get("MASTER_PORT", "")
    if launched_by_torchrun():
        local, n, world, rank = (int(os.environ[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK"))
        torchrun_local_rank, args.num_gpus, args.num_nodes, args.node_id = local, n, world // n, rank // n
        args.master_port = int(env_port or 0) or None
    else:
        if args.master_port is None and env_port.isdigit():
            args.master_port = int(env_port)
        if args.num_nodes == 1:
            args.master_addr = args.master_addr or "127.0.0.1"
    check_launch(args, cuda_count)
    check_learning_rates(recipe, args.num_nodes * args.num_gpus)
    if (warning := slow_bf16_warning(args.device, recipe.precision)) and node_main:
        print(warning, file=sys.stderr)
    if recipe.sync_bn and args.device == "cpu":
        raise UserError(NO_SYNC_BN)
    claim_checkpoint_dir(args, accel=False, holder=args.node_id == 0 and not torchrun_local_rank)
    launch = dict(num_nodes=args.num_nodes, node_id=args.node_id, num_gpus=args.num_gpus)
    launch.update(master_addr=args.master_addr, master_port=args.master_port, torchrun_local_rank=torchrun_local_rank)
    return settings_from(args, **launch), recipe


@said_by_one()
def resolve_accel_launch(args: argparse.Namespace) -> tuple[Settings, Recipe]:
    """accel_train.py's device and precision, the flags checked (A1.1)."""
    from accelerate.utils import parse_flag_from_env

    recipe = recipe_from_args(args)
    cuda = torch.cuda.is_available()
    cpu_fallback = args.device == "auto" and not args.cpu and not cuda  # warned of later
    refuse_full_run_without_gpu(args, cuda, args.cpu or parse_flag_from_env("ACCELERATE_USE_CPU"))
    cpu = args.cpu or args.device == "cpu" or cpu_fallback
    # the launch's settings, honoured or refused; 'no' is also the launcher's default: the recipe decides
    notes = []
    for setting, turns_on, key, value in (
        ("mixed_precision", "bf16", "precision", "bf16"),
        ("dynamo_backend", "inductor", "compile", True),
    ):
        asked = os.environ.get(f"ACCELERATE_{setting.upper()}", "no").lower()
        if asked not in ("no", turns_on):
            raise UserError(
                f"the launch asks for {setting} {asked!r}: make it {turns_on} or 'no' in its config or flags "
                f"(the recipe's {key})"
            )
        if asked == turns_on and getattr(recipe, key) != value:
            notes.append(f"the launch's {setting} {asked} overrides the recipe's {key} {getattr(recipe, key)}")
            recipe = replace(recipe, **{key: value})
    check_training_flags(args)
    check_learning_rates(recipe, launcher_world_size() or 1)
    if args.device == "cuda" and not cuda:
        raise UserError(NO_CUDA)
    if recipe.sync_bn and (cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not cuda):
        raise UserError(NO_SYNC_BN)
    claim_checkpoint_dir(args, accel=True, holder=os.environ.get("RANK", "0") == "0")
    return settings_from(args, notes, cpu=cpu, cpu_fallback=cpu_fallback), recipe
