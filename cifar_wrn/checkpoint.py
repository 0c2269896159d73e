"""Checkpoints that survive crashes: atomic writes, and the checks that make a resume safe.

Only file handling and comparisons live here; which rank writes, and the barrier after it, are in
the entry points.

Checkpoints are read as data only (torch.load with weights_only=True: tensors, containers, numbers).
The folder usually sits on shared storage that other accounts can write to, and a full unpickler would
run whatever code a file put there asks for, in every rank of every requeued job.
"""
import contextlib
import errno
import os
import pickle
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .errors import UserError, agreed_problem
from .recipe import Recipe, as_dict

FILENAME = "checkpoint.pt"
# Recipe keys that may change between a run and its resume: they do not change what was trained so
# far. `epochs` may grow only when the LR schedule does not depend on it.
RESUMABLE_CHANGES = {"epochs", "target_accuracy", "patience", "eval_batch_size", "num_workers"}


class CheckpointError(UserError):
    pass


def checkpoint_path(directory) -> Path:
    return Path(directory) / FILENAME


def check_writable(directory) -> None:
    """Create the folder if needed and prove that a file can be written there, before any training."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {directory} is not writable: {exc.strerror or exc}") from None


def save_atomic(state: dict, path, simulate_enospc: bool = False) -> None:
    """Write to a temporary file in the same folder, fsync it, then os.replace it over `path`.

    A crash or a full disk at any moment leaves either the old checkpoint or the new one, never a
    torn file. `simulate_enospc` (tests only) fails half-way through the write like a full disk.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if simulate_enospc:
                import io
                buffer = io.BytesIO()
                torch.save(state, buffer)
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself reaches the disk
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


# What every checkpoint of either entry point holds besides the weights; checked before anything uses it.
COMMON_KEYS = ("epoch", "step", "epoch_time_so_far", "cumulative_time", "history", "streak", "finished",
               "recipe", "world_size", "model_width")
RAW_KEYS = COMMON_KEYS + ("model", "optimizer", "scheduler", "ema", "rng")
ACCEL_KEYS = COMMON_KEYS + ("pipeline",)


def _not_ours(path, why: str) -> str:
    return (f"{path} is not a checkpoint this project wrote ({why}); it was not loaded (nothing in it ran) and is "
            f"left as it is: move it away to start afresh, or resume from a checkpoint you trust")


def _refusal(exc: Exception) -> str:
    """The reason inside torch's weights_only refusal, without its advice to load with weights_only=False."""
    text = str(exc).partition("WeightsUnpickler error:")[2].strip() or str(exc)
    return "refused by weights-only loading: " + text.splitlines()[0].split(" was not an allowed global")[0]


def load_data_only(path, required: tuple = ()) -> dict:
    """A checkpoint file as a dict, read as data only; `required`: keys it must have."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # what weights_only refuses
        raise CheckpointError(_not_ours(path, _refusal(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(_not_ours(path, f"it holds a {type(state).__name__}, not a dict"))
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(_not_ours(path, f"it lacks {', '.join(missing)}"))
    return state


def load_checkpoint(directory) -> dict:
    path = checkpoint_path(directory)
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path} (start without --resume, or use --auto-resume "
                              f"to start fresh when there is none). The folder must be visible from every node.")
    return load_data_only(path, RAW_KEYS)


# ----------------------------------------------------------------------------- accel_train.py's folders
# accelerator.save_state writes the model (safetensors), optimizer, scheduler and each rank's random state;
# load_state reads them as data (safetensors; torch.load with weights_only=True). The rest of the checkpoint
# (where the run is, what it measured, who wrote it, the EMA weights) is one plain dict in TRAINING_STATE,
# written and read here. It does not go through register_for_checkpointing: load_state unpickles those
# objects' files (custom_checkpoint_N.pkl) with weights_only=False whatever it is told, so a crafted one
# would run code. Checkpoints written before held the same dicts there, index 0 the run, 1 the EMA (if any).
TRAINING_STATE = "training_state.pt"

# An accel_train.py checkpoint is a folder written by accelerator.save_state (model, optimizer, scheduler,
# every rank's random state) and TRAINING_STATE (above), plus DIR/LATEST, a one-line file naming the folder.
# save_state writes into DIR/.incomplete; only when every rank has finished is it renamed to state-<n> and
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


def publish_or_report(directory, incomplete: str) -> bool:
    """publish_checkpoint; False, with the reason printed, if it failed (the previous checkpoint stays)."""
    try:
        publish_checkpoint(directory, incomplete)
    except OSError as exc:
        print(f"error: could not publish {incomplete}: {exc.strerror or exc}; the previous checkpoint is intact",
              file=sys.stderr, flush=True)
        return False
    return True


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

CUSTOM_FILE = re.compile(r"custom_checkpoint_\d+\.pkl")


def save_training_state(folder, state: dict) -> None:
    torch.save(state, Path(folder) / TRAINING_STATE)


def write_folder(save_state, folder, state: dict | None, rank: int, simulate_enospc: bool = False) -> bool:
    """One rank's part of an accel_train.py checkpoint: accelerator.save_state(folder) (passed in: every rank
    writes its random state, the main one the rest) and, on the main process (state given), TRAINING_STATE.
    False, with the reason printed, if this rank could not write; the previous checkpoint is untouched."""
    try:
        save_state(folder)
        if state is not None:
            save_training_state(folder, state)
            if simulate_enospc:  # tests only
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    except OSError as exc:
        print(f"error: rank {rank} could not write {folder}: {exc.strerror or exc}; the previous checkpoint is "
              f"intact", file=sys.stderr, flush=True)
        return False
    return True


def read_training_state(folder) -> dict:
    """TRAINING_STATE of an accel_train.py checkpoint folder, or the same from an older folder's
    custom_checkpoint_0/1.pkl, read as data only. state["ema"] is the EMA's state_dict or None."""
    folder = Path(folder)
    legacy = folder / "custom_checkpoint_0.pkl"
    if (folder / TRAINING_STATE).is_file() or not legacy.is_file():
        return load_data_only(folder / TRAINING_STATE, ACCEL_KEYS + ("ema",))
    ema = folder / "custom_checkpoint_1.pkl"
    return {**load_data_only(legacy, ACCEL_KEYS), "ema": load_data_only(ema) if ema.is_file() else None}


@contextlib.contextmanager
def _without_custom_files(folder: Path):
    """`folder`, or, if it holds custom_checkpoint_N.pkl files (an older checkpoint), a temporary folder of
    links to everything else: with no objects registered, load_state refuses a folder that has them."""
    names = os.listdir(folder)
    if not any(CUSTOM_FILE.fullmatch(name) for name in names):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="resume-") as view:
        for name in names:
            if not CUSTOM_FILE.fullmatch(name):
                os.symlink(folder.resolve() / name, Path(view) / name)
        yield view


def load_accelerator_state(accelerator, folder) -> None:
    """accelerator.load_state(folder) for accel_train.py (which registers no objects), as data only, with
    every failure a CheckpointError naming the folder. This process's random-state file is read first:
    load_state only logs one it cannot read and goes on, and the resume would silently not be exact."""
    from accelerate.utils import load as accelerate_load  # torch.load, weights_only, numpy's RNG types allowed

    folder = Path(folder)
    try:
        accelerate_load(folder / f"random_states_{accelerator.process_index}.pkl")
        with _without_custom_files(folder) as readable:
            accelerator.load_state(readable, load_kwargs={"weights_only": True})
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_not_ours(folder, _refusal(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"{folder} cannot be read ({type(exc).__name__}: {exc})") from None


def read_for_resume(directory, required: bool) -> tuple[dict | None, str | None]:
    """(the checkpoint or None, None) or (None, why it cannot be read). Each rank reads the file itself;
    the entry point then gathers what every rank saw (resume_disagreement) before anyone trains."""
    if not required and not checkpoint_path(directory).is_file():
        return None, None
    try:
        return load_checkpoint(directory), None
    except CheckpointError as exc:
        return None, str(exc)


def what_was_seen(state: dict | None) -> str:
    """What one rank found in the checkpoint folder, in words that also identify the checkpoint."""
    if state is None:
        return "no checkpoint"
    return f"epoch {state['epoch']}, step {state['step']} (Cumulative Time {state['cumulative_time']!r} s)"


def resume_disagreement(seen: list[tuple[str, str | None]]) -> str | None:
    """seen[rank] = (what_was_seen, that rank's own problem with resuming or None), from an all-gather.

    Rank 0's view decides, and every rank must share it: when one node finds a checkpoint and another
    none (an unshared or stale folder), resuming some ranks and starting others from scratch would
    train a mixed run. The same list on every rank gives the same answer on every rank."""
    views = [view for view, _ in seen]
    if any(view != views[0] for view in views):
        listed = "; ".join(f"rank {rank} sees {view}" for rank, view in enumerate(views))
        return (f"the ranks do not see the same checkpoint: {listed}. Every node must see the same "
                f"--checkpoint-dir (a shared folder); resume when they do, or start afresh in an empty folder")
    return agreed_problem([problem for _, problem in seen])


def resume_problem(checkpoint: dict, recipe: dict, world_size: int, model_width: int,
                   data: dict | None = None) -> str | None:
    """Why this checkpoint cannot continue as this run, or None. Never train something else silently.

    `data`: this run's train_images, val_images and steps_per_epoch (checked after the world size, which
    also changes the steps per epoch). A different epoch length would make the LR schedule and a
    mid-epoch resume's skip count refer to another epoch. (Checkpoints written before these were stored
    do not have them and are not checked.)"""
    if checkpoint["world_size"] != world_size:
        return (f"the checkpoint was written by {checkpoint['world_size']} processes, this run has {world_size}: "
                f"resume with the same --num-nodes x --num-gpus (each rank's random state and data shard "
                f"depend on it)")
    if checkpoint["model_width"] != model_width:
        return f"the checkpoint holds a model of width {checkpoint['model_width']}, this run builds {model_width}"
    for key, value in (data or {}).items():
        if key in checkpoint and checkpoint[key] != value:
            flag = {"train_images": "--train-subset", "val_images": "--val-subset"}.get(key, "--batch-size")
            return (f"the checkpoint's run had {key.replace('_', ' ')} = {checkpoint[key]}, this run has {value}: "
                    f"resume with the same data ({flag}) and batch size")
    # A key newer than the checkpoint had its default when the checkpoint was written.
    defaults = as_dict(Recipe())
    old = {**{k: defaults[k] for k in recipe if k in defaults}, **checkpoint["recipe"]}
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed)
    return None
