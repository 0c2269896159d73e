"""Checkpoints that survive crashes: atomic writes, and the checks that make a resume safe.

Only file handling and comparisons live here; which rank writes, and the barrier after it, are in
the entry points.

Checkpoints are read as data only (torch.load with weights_only=True: tensors, containers, numbers).
The folder usually sits on shared storage that other accounts can write to, and a full unpickler would
run whatever code a file put there asks for, in every rank of every requeued job.
"""

import contextlib
import os
import pickle
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

import torch

from .errors import RunStopped, UserError, agreed_problem
from .recipe import Recipe, as_dict

FILENAME = "checkpoint.pt"
# Recipe keys that may change between a run and its resume: they do not change what was trained so
# far. `epochs` may grow only when the LR schedule does not depend on it; extra_epochs (the safety net) only
# decides what happens after the budget, so a checkpoint written before fast.yaml turned it on resumes with it.
RESUMABLE_CHANGES = {"epochs", "target_accuracy", "patience", "eval_batch_size", "num_workers", "extra_epochs"}


class CheckpointError(UserError):
    pass


def checkpoint_path(directory) -> Path:
    return Path(directory) / FILENAME


def check_writable(directory) -> None:
    """Create the folder if needed and prove that a file can be written there, before any training."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{secrets.token_hex(6)}"  # a name nobody could have put there first
        os.close(_create_new(probe))
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {directory} is not writable: {exc.strerror or exc}") from None


def _create_new(path) -> int:
    """A new file's descriptor. The folder may be writable by other accounts: a file or a symbolic link
    already at `path` (say, one pointing at somebody's data) is an error, never opened or followed."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def _remove(path) -> None:
    """Remove the file, link or folder at `path` itself: a symbolic link goes, never what it points to."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)  # does not follow links inside the folder either


def _fsync_folder(directory) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # a rename in it reaches the disk
    finally:
        os.close(fd)


def why(exc: BaseException) -> str:
    """One line saying why a read or write failed, whatever raised it. A full disk shows up as torch's
    RuntimeError ("unexpected pos") raised while the OSError is handled, or as safetensors' SafetensorError
    ending in "(os error 28)": the OS's own words are the clearest, so they are looked for first."""
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    quoted = re.search(r"\(os error (\d+)\)", str(exc))  # safetensors (Rust): "... (os error 28)"
    if quoted:
        return os.strerror(int(quoted.group(1)))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"


def failure(action, *args) -> str | None:
    """None if action(*args) succeeded, else why it failed, in one line (a CheckpointError's own message).
    The entry point all-gathers every rank's answer, so that all go on or all stop together."""
    try:
        action(*args)
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:
        return why(exc)
    return None


def stop_unless_written(problems: list, directory, leftover=None) -> None:
    """After the entry point's all-gather of each rank's failure() with a step of writing a checkpoint:
    every rank raises the same RunStopped (rank 0 prints one line) if any rank failed; `leftover` (rank 0
    passes it) is a half-written folder, removed so that it does not hold on to the disk space."""
    problem = agreed_problem(problems)
    if problem:
        if leftover:
            failure(_remove, leftover)
        raise RunStopped(
            f"no checkpoint could be written in {directory} ({problem}); the previous checkpoint "
            f"there is intact, and every rank stopped",
            2,
        )


def save_atomic(state: dict, path) -> None:
    """Write to a new temporary file in the same folder, fsync it, then os.replace it over `path`.

    A crash or a full disk at any moment leaves either the old checkpoint or the new one, never a
    torn file. Any failure (a full disk surfaces from torch.save as a RuntimeError) is a CheckpointError
    naming the file; the temporary file is removed. os.replace replaces a link at `path`, never its target.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")  # not guessable in advance
    created = False
    try:
        with open(_create_new(tmp), "wb") as f:
            created = True
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    except Exception as exc:
        raise CheckpointError(f"could not write {path}: {why(exc)}") from None
    finally:
        if created:
            tmp.unlink(missing_ok=True)


# What every checkpoint of either entry point holds besides the weights; checked before anything uses it.
COMMON_KEYS = (
    "epoch",
    "step",
    "epoch_time_so_far",
    "cumulative_time",
    "history",
    "streak",
    "finished",
    "recipe",
    "world_size",
    "model_width",
)
RAW_KEYS = COMMON_KEYS + ("model", "optimizer", "scheduler", "ema", "rng")
ACCEL_KEYS = COMMON_KEYS + ("pipeline",)


def _not_ours(path, why: str) -> str:
    return (
        f"{path} is not a checkpoint this project wrote ({why}); it was not loaded (nothing in it ran) and is "
        f"left as it is: move it away to start afresh, or resume from a checkpoint you trust"
    )


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
        raise CheckpointError(
            f"--resume: no checkpoint at {path} (start without --resume, or use --auto-resume "
            f"to start fresh when there is none). The folder must be visible from every node."
        )
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


STATE_FOLDER = re.compile(r"state-(\d+)")  # the only names LATEST may hold


def latest_checkpoint(directory) -> str | None:
    """The folder of DIR's newest complete checkpoint, or None. LATEST lies in a folder other accounts may
    write to, so what it names is checked: a state-<n> folder directly in DIR, not a symbolic link. Anything
    else (a path, `..`, a link leading elsewhere) is a CheckpointError naming LATEST: a folder outside DIR
    is never read, written or removed."""
    pointer = os.path.join(directory, LATEST)
    try:
        fd = os.open(pointer, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # not a link; a FIFO must not block
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(
            f"{pointer} cannot be read ({exc.strerror}; a symbolic link is refused): it must be a "
            f"file naming a state-<n> folder of {directory}"
        ) from None
    with open(fd, "rb") as f:
        name = f.read(100).decode("utf-8", "replace").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else None
    folder = os.path.join(directory, name or "")
    if name is None or not STATE_FOLDER.fullmatch(name) or os.path.islink(folder):
        raise CheckpointError(
            f"{pointer} {'names ' + repr(name) if name is not None else 'is not a regular file'}"
            f"{' (a symbolic link)' if name and os.path.islink(folder) else ''}, not a state-<n> "
            f"folder of {directory}: refused, nothing outside that folder is read or changed. "
            f"Remove {LATEST} (or write a checkpoint folder's name into it)"
        )
    return folder if os.path.isdir(folder) else None


def publish_checkpoint(directory, incomplete: str) -> str:
    """Main process: turn the finished folder `incomplete` into DIR's checkpoint, atomically; drop the old one."""
    previous = latest_checkpoint(directory)  # checked: a state-<n> folder of DIR, or None
    number = int(STATE_FOLDER.fullmatch(os.path.basename(previous)).group(1)) + 1 if previous else 1
    folder = os.path.join(directory, f"state-{number}")
    _remove(folder)  # a leftover of a run that died between the rename and the switch
    for name in os.listdir(incomplete):  # save_state does not fsync: make every rank's files durable first
        fd = os.open(os.path.join(incomplete, name), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.rename(incomplete, folder)
    tmp = os.path.join(directory, f".{LATEST}.tmp-{secrets.token_hex(6)}")
    try:
        with open(_create_new(tmp), "w") as f:
            f.write(os.path.basename(folder) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, LATEST))  # the switch: before it the old checkpoint, after it the new
    finally:
        failure(os.unlink, tmp)  # (gone after the switch)
    _fsync_folder(directory)
    if previous:
        failure(_remove, previous)  # the new checkpoint is in force whatever happens here
    return folder


def fresh_folder(folder) -> None:
    """Main process, before every rank writes into `folder` (DIR/.incomplete): remove a leftover of a failed
    write (a link itself, not its target), then make it anew (mkdir does not follow a link put there)."""
    _remove(folder)
    os.mkdir(folder)


CUSTOM_FILE = re.compile(r"custom_checkpoint_\d+\.pkl")


def save_training_state(folder, state: dict) -> None:
    torch.save(state, Path(folder) / TRAINING_STATE)


def write_folder(save_state, folder, state: dict | None) -> None:
    """One rank's part of an accel_train.py checkpoint: accelerator.save_state(folder) (passed in: every rank
    writes its random state, the main one the rest) and, on the main process (state given), TRAINING_STATE.
    (Run through failure(): whatever save_state raises on a full disk, SafetensorError or RuntimeError, is
    caught there; the previous checkpoint is untouched.)"""
    save_state(folder)
    if state is not None:
        save_training_state(folder, state)


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


def device_problem(saved_on: str, running_on: str) -> str | None:
    """A checkpoint's random states belong to the device type that wrote them (a CUDA generator's state is not
    a CPU one's), and the arithmetic differs anyway: say so, rather than fail inside set_rng_state."""
    if saved_on == running_on:
        return None
    return (
        f"it was written by a run on {saved_on}, this run is on {running_on}: its random states, and with them "
        f"an exact resume, do not carry over (resume on {saved_on}, or start afresh in another folder)"
    )


def _loading(where, action) -> None:
    """action(), every failure a CheckpointError saying that `where` was found but cannot be loaded."""
    try:
        action()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_not_ours(where, _refusal(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"{where} was found but cannot be loaded into this run ({why(exc)})") from None


def restore_raw(checkpoint: dict, rank: int, device, objects: tuple, generator) -> None:
    """raw_ddp.py: `checkpoint` (from read_for_resume) into this rank's (raw_model, eval_model, optimizer,
    scheduler) and random streams (generator: the device pipeline's, or None). Run through failure() before
    the ranks agree, so that a rank whose part cannot be loaded stops every rank."""
    raw_model, eval_model, optimizer, scheduler = objects

    def load():
        rng = checkpoint["rng"][rank]  # this rank's own random streams, exactly where they were
        problem = device_problem("cpu" if rng["cuda"] is None else "cuda", device.type)
        if problem:
            raise CheckpointError(problem)
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        if eval_model is not raw_model:
            eval_model.load_state_dict(checkpoint["ema"])
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        if generator is not None:
            generator.set_state(rng["pipeline"])

    _loading("its part of the checkpoint", load)  # (the message gets "rank <rank>: " in front)


RANDOM_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def restore_accel(accelerator, folder, state: dict, device_type: str, ema, generator) -> None:
    """accel_train.py: accelerator.load_state(folder) (accel_train.py registers no objects), as data only, then
    the EMA (or None) and the device pipeline's generator (or None) from `state` (its TRAINING_STATE). Run
    through failure() before the ranks agree, like restore_raw. This process's random-state file is read
    and checked first: load_state only logs one it cannot read (or one without the CUDA state) and goes on,
    and the resume would silently not be exact."""
    from accelerate.utils import load as accelerate_load  # torch.load, weights_only, numpy's RNG types allowed

    folder = Path(folder)
    path = folder / f"random_states_{accelerator.process_index}.pkl"

    def load():
        rng = accelerate_load(path) if path.is_file() else None
        if rng is None:
            raise CheckpointError(f"{path} is missing (each rank resumes its own random streams from its file)")
        if not isinstance(rng, dict) or any(key not in rng for key in RANDOM_STATE_KEYS):
            raise CheckpointError(_not_ours(path, "it is not a random state"))
        # (a folder written before "device" was kept: one without the CUDA state was written without CUDA)
        problem = device_problem(
            state.get("device", device_type if "torch_cuda_manual_seed" in rng else "cpu"), device_type
        )
        if problem:
            raise CheckpointError(problem)
        with _without_custom_files(folder) as readable:
            accelerator.load_state(readable, load_kwargs={"weights_only": True})
        if ema is not None:
            ema.load_state_dict(state["ema"])
        if generator is not None:
            generator.set_state(state["pipeline"][accelerator.process_index])

    _loading(folder, load)


def read_for_resume(directory, required: bool) -> tuple[dict | None, str | None]:
    """(the checkpoint or None, None) or (None, why it cannot be read). Each rank reads the file itself;
    the entry point then gathers what every rank saw (resume_disagreement) before anyone trains."""
    if not required and not checkpoint_path(directory).is_file():
        return None, None
    try:
        return load_checkpoint(directory), None
    except CheckpointError as exc:
        return None, str(exc)


def read_accel_for_resume(directory, required: bool) -> tuple[str | None, dict | None, str | None]:
    """accel_train.py's read_for_resume: (DIR's newest folder or None, its TRAINING_STATE or None, None or
    why it cannot be read). `--resume` without a checkpoint is a problem like any other, found after the
    process group has formed, so that every node stops together (not one at once, the others after
    --dist-timeout in the rendezvous)."""
    folder = None
    try:
        folder = latest_checkpoint(directory)
        if folder is None:
            return (
                None,
                None,
                required
                and (
                    f"--resume: no checkpoint in {directory} (no {LATEST} naming a state-<n> folder; start without "
                    f"--resume, or use --auto-resume to start fresh when there is none). The folder must be visible "
                    f"from every node."
                )
                or None,
            )
        return folder, read_training_state(folder), None
    except CheckpointError as exc:
        return folder, None, str(exc)


def what_was_seen(state: dict | None) -> str:
    """What one rank found in the checkpoint folder, in words that also identify the checkpoint."""
    if state is None:
        return "no checkpoint"
    return f"epoch {state['epoch']}, step {state['step']} (Cumulative Time {state['cumulative_time']!r} s)"


def resume_disagreement(seen: list[tuple[str, str | None]]) -> str | None:
    """seen[rank] = (what_was_seen, that rank's own problem with resuming or None), from an all-gather.

    Any rank's problem (a file it found but cannot read, a recipe that differs) is reported first, as
    such. Then rank 0's view decides, and every rank must share it: when one node finds a checkpoint and
    another none (an unshared or stale folder), resuming some ranks and starting others from scratch would
    train a mixed run. The same list on every rank gives the same answer on every rank."""
    problem = agreed_problem([problem for _, problem in seen])
    if problem:  # first: a rank that found a checkpoint it cannot read says so, it does not "see no checkpoint"
        return problem
    views = [view for view, _ in seen]
    if any(view != views[0] for view in views):
        listed = "; ".join(f"rank {rank} sees {view}" for rank, view in enumerate(views))
        return (
            f"the ranks do not see the same checkpoint: {listed}. Every node must see the same "
            f"--checkpoint-dir (a shared folder); resume when they do, or start afresh in an empty folder"
        )
    return None


def resume_problem(
    checkpoint: dict, recipe: dict, world_size: int, model_width: int, data: dict | None = None
) -> str | None:
    """Why this checkpoint cannot continue as this run, or None. Never train something else silently.

    `data`: this run's train_images, val_images and steps_per_epoch (checked after the world size, which
    also changes the steps per epoch). A different epoch length would make the LR schedule and a
    mid-epoch resume's skip count refer to another epoch. (Checkpoints written before these were stored
    do not have them and are not checked.)"""
    if checkpoint["world_size"] != world_size:
        return (
            f"the checkpoint was written by {checkpoint['world_size']} processes, this run has {world_size}: "
            f"resume with the same --num-nodes x --num-gpus (each rank's random state and data shard "
            f"depend on it)"
        )
    if checkpoint["model_width"] != model_width:
        return f"the checkpoint holds a model of width {checkpoint['model_width']}, this run builds {model_width}"
    for key, value in (data or {}).items():
        if key in checkpoint and checkpoint[key] != value:
            flag = {"train_images": "--train-subset", "val_images": "--val-subset"}.get(key, "--batch-size")
            return (
                f"the checkpoint's run had {key.replace('_', ' ')} = {checkpoint[key]}, this run has {value}: "
                f"resume with the same data ({flag}) and batch size"
            )
    # A key newer than the checkpoint had its default when the checkpoint was written.
    defaults = as_dict(Recipe())
    old = {**{k: defaults[k] for k in recipe if k in defaults}, **checkpoint["recipe"]}
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed
        )
    return None
