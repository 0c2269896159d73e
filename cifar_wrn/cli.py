"""The command line both entry points share, checked before any process group forms."""

import argparse
import errno
import fcntl
import os
import platform
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from .checkpoints import check_writable
from .errors import UserError
from .model import COURSE_WIDTH
from .optim import scaled_lr
from .recipe import FLOAT32_MAX, Recipe, RecipeError, load_recipe, parse_set

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
    folder_prefix: str = ""  # of the run log's folder, before <recipe>-<nodes>x<gpus>-<time>


@dataclass(frozen=True)
class Settings:
    """The command line, resolved once here; the package takes these values, never the argparse namespace."""

    device: str  # cuda or cpu (accel_train.py: cpu where Accelerator(cpu=True) is asked)
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
    parent_store: bool = False  # the store at master_port is the Launcher's: the ranks join it

    @property
    def first_rank(self) -> int:  # this node's local rank 0
        return self.node_id * self.num_gpus


def settings_from(args: argparse.Namespace, notes: list = (), folder_prefix: str = "", **launch) -> Settings:
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
            folder_prefix,
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


def claim_checkpoint_dir(args, checkpointer, holder: bool):
    """The run's one `holder` process holds --checkpoint-dir to its end; a fresh run's folder holds no checkpoint
    (seen alike by every process: all stop at once). `checkpointer`: the trainer's, of that folder."""
    if args.checkpoint_dir and holder:
        hold_folder(args.checkpoint_dir)
    if args.checkpoint_dir and not (args.resume or args.auto_resume):
        checkpointer.refuse_overwrite()


def check_learning_rates(recipe: Recipe, world_size: int):
    lr, batch = scaled_lr(recipe, recipe.batch_size * world_size), recipe.batch_size * world_size
    for what, value in (("", lr), ("BatchNorm parameters' ", lr * recipe.bn_lr_scale)):
        if not value <= FLOAT32_MAX:  # SGD's step would overflow
            raise RecipeError(
                f"invalid recipe: the {what}learning rate {value:g} (base_lr {recipe.base_lr:g}, lr_scaling "
                f"{recipe.lr_scaling}, global batch {batch}, bn_lr_scale {recipe.bn_lr_scale:g}) is beyond "
                f"{FLOAT32_MAX:.2g}, the largest float32"
            )


def refuse_full_run_without_gpu(args, cuda: bool, cpu_asked=False) -> None:
    """--device auto without CUDA on the full data: hours on the CPU, never started by accident."""
    if args.device == "auto" and not (cuda or cpu_asked or args.train_subset):
        raise UserError(
            "no GPU here: submit the job (README), or train on the CPU with --device cpu (hours on the full data; "
            "a short run: add --train-subset 2000 --val-subset 1000 --epochs 2)"
        )
