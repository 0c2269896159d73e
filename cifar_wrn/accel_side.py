"""accel_train.py's side, all of what it does differently from raw_ddp.py below the entry point, and the one package
module that imports accelerate: its launch checks, its process (with the Accelerator), its epoch loader, its
checkpoint (every rank save_state's its part into DIR/.incomplete; the main process adds training_state.pt, with the
checksums of every file there, and publishes it as DIR/state-<n>, named by DIR/LATEST), its tracker and its run
log's launch fields."""

import argparse
import contextlib
import os
import re
import stat
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import accelerate
import torch
from accelerate.utils import parse_flag_from_env

from .agreement import all_gather
from .checkpoints import (
    DAMAGED,
    NO_CHECKPOINT,
    Checkpointer,
    CheckpointError,
    check_digest,
    device_problem,
    file_digest,
    loading,
    not_ours,
    problem_of,
    stop_unless_written,
    with_digest,
)
from .cli import (
    NO_CUDA,
    NO_SYNC_BN,
    Settings,
    check_learning_rates,
    check_training_flags,
    claim_checkpoint_dir,
    recipe_from_args,
    refuse_full_run_without_gpu,
    settings_from,
)
from .errors import UserError, said_by_one
from .launchers import CPU_FALLBACK_WARNING, launcher_name, launcher_world_size, local_world_size
from .recipe import Recipe, slow_bf16_warning
from .run import Process
from .safe_files import fresh_folder, fsync, remove, replace_atomically

# Not registered for checkpointing: load_state unpickles those files with weights_only=False.
TRAINING_STATE = "training_state.pt"
OLD_STATE = "custom_checkpoint_0.pkl"  # register_for_checkpointing's, before TRAINING_STATE
LATEST = "LATEST"
STATE_FOLDER = re.compile(r"state-(\d+)")
RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")


@dataclass(frozen=True)
class AccelProcess(Process):
    accelerator: accelerate.Accelerator = None  # the group it joined, its device and its wrappers


class AccelCheckpointer(Checkpointer):
    TRAINER = "accel_train.py"
    OWN_KEYS = ("pipeline", "device", "files")  # files: each file save_state wrote -> its sha256

    def write(self, run, state: dict) -> str:
        generator, accelerator = run.data.generator, run.process.accelerator
        pipeline = all_gather(None if generator is None else generator.get_state())
        state = dict(state, pipeline=pipeline, device=run.device.type)
        main, incomplete = run.is_main, os.path.join(self.directory, ".incomplete")
        steps = (
            main and (fresh_folder, incomplete),
            (accelerator.save_state, incomplete),
            main and (write_training_state, incomplete, state),
            main and (publish_checkpoint, self.directory, incomplete),
        )
        for i, step in enumerate(steps):  # a failed first step leaves nothing to remove
            leftover = i and main and incomplete or None
            stop_unless_written(all_gather(step and problem_of(*step)), self.directory, leftover)
        return latest_checkpoint(self.directory)

    def refuse_overwrite(self):
        latest_named(self.directory)  # a LATEST that names something else: refused as such
        super().refuse_overwrite()

    def read(self, required: bool) -> tuple:
        folder = None
        try:
            self.refuse_others()
            if (named := latest_named(self.directory)) and not os.path.isdir(named):
                raise CheckpointError(
                    f"{os.path.join(self.directory, LATEST)} names {os.path.basename(named)}, which is missing "
                    f"(removed, or not copied with {LATEST}): refused. Put that folder back, or remove {LATEST} to "
                    "start afresh"
                )
            folder = named
            if folder is None and required:
                raise CheckpointError(
                    f"--resume: no checkpoint in {self.directory} (no {LATEST} naming a state-<n> folder; "
                    f"{NO_CHECKPOINT}"
                )
            if folder and not os.path.isfile(Path(folder, TRAINING_STATE)) and os.path.isfile(Path(folder, OLD_STATE)):
                raise CheckpointError(  # never read: Accelerate would unpickle it in full
                    f"{folder} was written by an earlier accel_train.py ({OLD_STATE}): start afresh in an empty "
                    "--checkpoint-dir"
                )
            return folder or self.directory, folder and self.load(Path(folder, TRAINING_STATE)), None
        except CheckpointError as exc:
            return folder or self.directory, None, str(exc)

    def restore(self, run, where, saved: dict) -> None:
        """The random-state file is checked first: load_state would only log a bad one."""
        from accelerate.utils import load as accelerate_load  # allows numpy's RNG types

        accelerator, folder = run.process.accelerator, Path(where)
        path = folder / f"random_states_{accelerator.process_index}.pkl"
        with loading(folder):
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (each rank resumes its own random streams from its file)")
            rng = accelerate_load(path)
            if (
                not isinstance(rng, dict)
                or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= rng.keys()
            ):
                raise CheckpointError(not_ours(path, "it is not a random state"))
            device_problem(saved["device"], run.device.type)
            check_digest(saved, folder / TRAINING_STATE)
            check_files(folder, saved, accelerator.process_index)
            accelerator.load_state(folder, load_kwargs={"weights_only": True})
            if run.ema is not None:
                run.ema.load_state_dict(saved["ema"])
            if run.data.generator is not None:
                run.data.generator.set_state(saved["pipeline"][accelerator.process_index])


def write_training_state(folder, state: dict):
    """After every rank's save_state: training_state.pt, with the checksum of each file they wrote, and its own."""
    files = {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}
    torch.save(with_digest({**state, "files": files}), Path(folder) / TRAINING_STATE)


def check_files(folder, state: dict, process_index: int):
    """Each file this process's load_state reads (of the random states, its own) is as written."""
    for name, digest in state["files"].items():
        if (own := RANDOM_STATES.fullmatch(name)) and int(own.group(1)) != process_index:
            continue
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing ({TRAINING_STATE} lists it)")
        if file_digest(path) != digest:
            raise CheckpointError(f"{path} does not match the checksum {TRAINING_STATE} holds for it {DAMAGED}")


def latest_checkpoint(directory) -> str | None:
    """The state-<n> folder DIR/LATEST names, or None (no LATEST, or the folder it names is missing)."""
    folder = latest_named(directory)
    return folder if folder and os.path.isdir(folder) else None


def latest_named(directory) -> str | None:
    """DIR/state-<n>, as DIR/LATEST names it (the folder may be missing), or None without LATEST; others may
    write LATEST."""
    pointer = os.path.join(directory, LATEST)
    try:
        fd = os.open(pointer, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{pointer} cannot be read ({exc.strerror}; a symbolic link is refused)") from None
    with open(fd, "rb") as f:
        name = f.read(100).decode("utf-8", "replace").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else None
    folder = os.path.join(directory, name or "")
    if name is None or not STATE_FOLDER.fullmatch(name) or os.path.islink(folder):
        what = "is not a regular file" if name is None else f"names {name!r}"
        raise CheckpointError(
            f"{pointer} {what}, not a state-<n> folder (no link) of {directory}: refused. Remove {LATEST}"
        )
    return folder


def publish_checkpoint(directory, incomplete: str) -> str:
    """Atomically, via LATEST; the old one goes after."""
    previous = latest_checkpoint(directory)
    number = int(STATE_FOLDER.fullmatch(os.path.basename(previous)).group(1)) + 1 if previous else 1
    folder = os.path.join(directory, f"state-{number}")
    remove(folder)  # left by a run that died before the switch
    for name in os.listdir(incomplete):  # save_state does not fsync
        fsync(os.path.join(incomplete, name), os.O_NOFOLLOW)
    os.rename(incomplete, folder)
    replace_atomically(os.path.join(directory, LATEST), lambda f: f.write(f"state-{number}\n".encode()))
    if previous:
        with contextlib.suppress(OSError):  # the new checkpoint is in force already
            remove(previous)
    return folder


def epoch_loader(data, epoch: int, skip: int):
    """This epoch's batches, reshuffled with seed + epoch, less the `skip` already trained: the prepared loader's
    set_epoch and skip_first_batches, or (the device pipeline, not prepared) raw_ddp.py's sampler and SkipFirst."""
    data.train_set.set_epoch(epoch)  # each image's augmentation: (seed, epoch, index)
    if data.train_sampler is not None:
        data.train_sampler.set_epoch(epoch)
        data.train_batches.skip = skip
        return data.train_loader
    data.train_loader.set_epoch(epoch)
    return accelerate.skip_first_batches(data.train_loader, skip) if skip else data.train_loader


class Tracker:
    """--with-tracking: Accelerator(log_with="tensorboard", project_dir=folder)'s; accelerator.end_training closes."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def __call__(self, name: str, folder: str) -> "Tracker":
        self.accelerator.init_trackers(name)
        return self

    def log(self, values: dict, step: int) -> None:
        self.accelerator.log(values, step=step)

    def close(self) -> None:
        pass


def log_fields(accelerator) -> dict:
    """The run log header's launch fields."""
    per_node = local_world_size(accelerator.num_processes)
    return dict(
        num_gpus=per_node,
        num_nodes=accelerator.num_processes // per_node,
        device=accelerator.device.type,
        backend=accelerator.state.backend or "none",
        launcher=launcher_name(),
        trainer="accelerate",
        accelerate_version=accelerate.__version__,
        mixed_precision=accelerator.mixed_precision,
        distributed_type=accelerator.distributed_type.value,
    )


def accelerate_launch_problem(seen: int, distributed_type: str, device_type: str, version: str) -> str | None:
    started = launcher_world_size()
    if started not in (None, seen):
        return (
            f"the launcher started {started} processes (WORLD_SIZE={started}) but Accelerate sees {seen} "
            f"(distributed_type {distributed_type}, device {device_type}): each would train alone. Without CUDA, "
            "add --cpu after accel_train.py or set ACCELERATE_USE_CPU=1 (docs/accelerate.md, CPU traps)."
        )
    # the single-process launcher sets MASTER_PORT only when asked for several
    if started is None and seen == 1 and launcher_name() == "accelerate launch" and os.environ.get("MASTER_PORT"):
        return (
            "accelerate launch was asked for several processes but started only this one (accelerate "
            f"{version} runs `--cpu --num_processes N` and MULTI_CPU configs as one). For N CPU processes use "
            "`accelerate launch --config_file accelerate_configs/two_cpus.yaml accel_train.py --cpu ...`; "
            "for one, unset MASTER_PORT."
        )
    return None


def check_accelerate_launch(accelerator, recipe) -> None:
    """Every process joined, as Accelerate sees them; on the CPU, its threads shared and the bf16 warning said once."""
    world_size, device = accelerator.num_processes, accelerator.device
    if problem := accelerate_launch_problem(
        world_size, accelerator.distributed_type.value, device.type, accelerate.__version__
    ):
        with said_by_one():  # each process found it alone
            raise UserError(problem)
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size(world_size)))
        if warning := slow_bf16_warning(device.type, recipe.precision):
            accelerator.print(warning, file=sys.stderr)


@said_by_one()
def resolve_accel_launch(args: argparse.Namespace) -> tuple[Settings, Recipe]:
    """accel_train.py's device and precision, the flags checked (A1.1); Settings.device: cpu where Accelerator()
    must be told to use the CPU, else cuda."""
    recipe = recipe_from_args(args)
    cuda, use_cpu = torch.cuda.is_available(), parse_flag_from_env("ACCELERATE_USE_CPU")
    refuse_full_run_without_gpu(args, cuda, args.cpu or use_cpu)
    if args.device == "auto" and not args.cpu and not cuda and not use_cpu and os.environ.get("LOCAL_RANK", "0") == "0":
        print(CPU_FALLBACK_WARNING, file=sys.stderr)
    asked_device = args.device
    args.device = "cpu" if args.cpu or args.device == "cpu" or not cuda else "cuda"
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
    if asked_device == "cuda" and not cuda:
        raise UserError(NO_CUDA)
    if recipe.sync_bn and (args.device == "cpu" or use_cpu):
        raise UserError(NO_SYNC_BN)
    claim_checkpoint_dir(args, AccelCheckpointer(args.checkpoint_dir), holder=os.environ.get("RANK", "0") == "0")
    return settings_from(args, notes, folder_prefix="accel-"), recipe
