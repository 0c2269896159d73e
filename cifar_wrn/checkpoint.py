"""The trainers' checkpoints: what they hold, how they are written (never torn, checksummed), found (LATEST) and
read (as data only: others may write to the folder), and what a resume checks."""

import contextlib
import os
import pickle
import re
import stat
import tempfile
from pathlib import Path

import torch

from .checksums import digest_of, file_digest, folder_digests, sealed
from .errors import RunStopped, UserError, agreed_problem
from .model import ARCHITECTURE
from .recipe import Recipe, as_dict
from .safe_files import fsync, remove, replace_atomically, why


class CheckpointError(UserError):
    pass


def check_writable(directory):
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {directory} is not writable: {exc.strerror or exc}") from None


def attempt(action, *args) -> str | None:
    try:
        action(*args)
    except Exception as exc:
        return str(exc) if isinstance(exc, CheckpointError) else why(exc)
    return None


def stop_unless_written(problems: list, directory, leftover=None):
    if problem := agreed_problem(problems):
        if leftover:
            with contextlib.suppress(OSError):
                remove(leftover)
        raise RunStopped(
            f"no checkpoint could be written in {directory} ({problem}); the previous checkpoint there is intact",
            2,
        )


def save_atomic(state: dict, path):
    try:
        replace_atomically(path, lambda f: torch.save(state, f))
    except Exception as exc:
        raise CheckpointError(f"could not write {path}: {why(exc)}") from None


def not_ours(path, why: str) -> str:
    return f"{path} is not a checkpoint this project wrote ({why}); nothing in it ran; resume from one you trust"


def load_data_only(path, required: tuple = ()) -> dict:
    with loading(path, "cannot be read"):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(not_ours(path, f"it holds a {type(state).__name__}, not a dict"))
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(
            f"{path} lacks {', '.join(missing)}: an earlier version wrote it, or another project; start afresh in "
            "an empty --checkpoint-dir"
        )
    return state


# Not registered for checkpointing: load_state unpickles those files with weights_only=False.
TRAINING_STATE = "training_state.pt"
LATEST = "LATEST"
STATE_FOLDER = re.compile(r"state-(\d+)")


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


@contextlib.contextmanager
def loading(where, failed: str = "was found but cannot be loaded into this run"):
    try:
        yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:  # torch's refusal, minus its advice to load with weights_only=False
        text = (str(exc).partition("WeightsUnpickler error:")[2].strip() or str(exc)).splitlines()[0]
        raise CheckpointError(
            not_ours(where, "refused by weights-only loading: " + text.split(" was not an allowed global")[0])
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{where} {failed} ({why(exc)})") from None


def checkpoint_path(directory) -> Path:
    return Path(directory) / "checkpoint.pt"


# Recipe keys a resume may change: they do not alter what was trained (`epochs` only with a constant LR).
RESUMABLE_CHANGES = set(
    "epochs target_accuracy patience eval_batch_size num_workers extra_epochs startup_steps".split()
)


KEYS = (
    "epoch step epoch_time_so_far cumulative_time history streak finished recipe world_size model_width train_correct "
    "train_seen ema"
).split()
RAW_PARTS = {"model": "raw_model", "optimizer": "optimizer", "scheduler": "scheduler"}  # checkpoint key: run's
# digest: every other key's checksum (digest_of); files: each file save_state wrote -> its sha256
RAW_KEYS = KEYS + ["model", "optimizer", "scheduler", "rng", "digest"]
ACCEL_KEYS = KEYS + ["pipeline", "device", "files", "digest"]
RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")


NO_CHECKPOINT = (
    "start without --resume, or use --auto-resume to start fresh when there is none). Every node must see it."
)


DAMAGED = (
    "(a changed byte: a damaged disk or copy, or an edit): refused, as a truncated file is. Resume from an intact "
    "copy, or start afresh in an empty --checkpoint-dir"
)


def check_digest(state: dict, path):
    if digest_of(state) != state["digest"]:
        raise CheckpointError(f"{path} does not match the checksum it was written with {DAMAGED}")


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


def other_trainers_checkpoint(directory, accel: bool):
    """Never resumed as an empty folder, nor written into."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if accel:
        theirs, ours = [str(checkpoint_path(directory))] if "checkpoint.pt" in names else [], f"{LATEST}, state-<n>"
    else:
        theirs, ours = sorted(n for n in names if n == LATEST or STATE_FOLDER.fullmatch(n)), "checkpoint.pt"
    if theirs:
        (other, this) = ("raw_ddp.py", "accel_train.py") if accel else ("accel_train.py", "raw_ddp.py")
        raise CheckpointError(
            f"{directory} holds {other}'s checkpoint ({', '.join(theirs)}), not {this}'s ({ours}): resume it with "
            f"{other}, or give {this} another --checkpoint-dir"
        )


def refuse_overwrite(directory, accel: bool):
    """A run without a resume flag never writes over a checkpoint (as the Hugging Face Trainer guards its folder)."""
    other_trainers_checkpoint(directory, accel)
    latest_named(directory)  # a LATEST that names something else: refused as such
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if found := sorted(n for n in names if n in ("checkpoint.pt", LATEST) or STATE_FOLDER.fullmatch(n)):
        raise CheckpointError(
            f"--checkpoint-dir {directory} holds a checkpoint ({', '.join(found)}) that a fresh run would overwrite: "
            "continue it with --auto-resume, or give another --checkpoint-dir"
        )


def load_checkpoint(directory) -> dict:
    path = checkpoint_path(directory)
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path} ({NO_CHECKPOINT}")
    return load_data_only(path, RAW_KEYS)


def write_training_state(folder, state: dict):
    """After every rank's save_state: training_state.pt, with the checksum of each file they wrote, and its own."""
    torch.save(sealed({**state, "files": folder_digests(folder, but=TRAINING_STATE)}), Path(folder) / TRAINING_STATE)


def read_training_state(folder) -> dict:
    folder = Path(folder)
    if not (folder / TRAINING_STATE).is_file() and (folder / "custom_checkpoint_0.pkl").is_file():
        raise CheckpointError(
            f"{folder} was written by an earlier accel_train.py (custom_checkpoint_0.pkl): start afresh in an empty "
            "--checkpoint-dir"
        )
    return load_data_only(folder / TRAINING_STATE, ACCEL_KEYS)


def _device_problem(saved_on: str, running_on: str):
    if saved_on != running_on:
        raise CheckpointError(
            f"it was written by a run on {saved_on}, this run is on {running_on}: its random states do not carry "
            f"over (resume on {saved_on}, or start afresh in another folder)"
        )


def training_state(run, progress, finished: bool, **more) -> dict:
    """What both formats hold; `more`: the trainer's own (raw_ddp.py's model, optimizer, scheduler and random
    streams; Accelerate's save_state writes those itself)."""
    return dict(
        progress.as_dict(),
        finished=finished,
        recipe=as_dict(run.recipe),
        world_size=run.world_size,
        model_width=run.model_width,
        architecture=ARCHITECTURE,
        **run.data.sizes(),
        ema=None if run.ema is None else run.ema.state_dict(),
        **more,
    )


def restore_raw(checkpoint: dict, run, path="the checkpoint"):
    with loading("its part of the checkpoint"):
        rng, device = checkpoint["rng"][run.rank], run.device
        _device_problem("cpu" if rng["cuda"] is None else "cuda", device.type)
        check_digest(checkpoint, path)
        for key, name in RAW_PARTS.items():
            getattr(run, name).load_state_dict(checkpoint[key])
        if run.ema is not None:
            run.ema.load_state_dict(checkpoint["ema"])
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        if run.data.generator is not None:
            run.data.generator.set_state(rng["pipeline"])


def restore_accel(accelerator, folder, state: dict, device_type: str, ema, generator):
    """The random-state file is checked first: load_state would only log a bad one."""
    from accelerate.utils import load as accelerate_load  # allows numpy's RNG types

    folder = Path(folder)
    path = folder / f"random_states_{accelerator.process_index}.pkl"
    with loading(folder):
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (each rank resumes its own random streams from its file)")
        rng = accelerate_load(path)
        if not isinstance(rng, dict) or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= rng.keys():
            raise CheckpointError(not_ours(path, "it is not a random state"))
        _device_problem(state["device"], device_type)
        check_digest(state, folder / TRAINING_STATE)
        check_files(folder, state, accelerator.process_index)
        accelerator.load_state(folder, load_kwargs={"weights_only": True})
        if ema is not None:
            ema.load_state_dict(state["ema"])
        if generator is not None:
            generator.set_state(state["pipeline"][accelerator.process_index])


def read_for_resume(directory, required: bool) -> tuple[dict | None, str | None]:
    try:
        other_trainers_checkpoint(directory, accel=False)
        return (load_checkpoint(directory) if required or checkpoint_path(directory).is_file() else None), None
    except CheckpointError as exc:
        return None, str(exc)


def read_accel_for_resume(directory, required: bool) -> tuple[str | None, dict | None, str | None]:
    """A problem, not an error, so that every node stops together."""
    folder = None
    try:
        other_trainers_checkpoint(directory, accel=True)
        if (named := latest_named(directory)) and not os.path.isdir(named):
            raise CheckpointError(
                f"{os.path.join(directory, LATEST)} names {os.path.basename(named)}, which is missing (removed, or "
                f"not copied with {LATEST}): refused. Put that folder back, or remove {LATEST} to start afresh"
            )
        folder = named
        if folder is None and required:
            raise CheckpointError(
                f"--resume: no checkpoint in {directory} (no {LATEST} naming a state-<n> folder; {NO_CHECKPOINT}"
            )
        return folder, folder and read_training_state(folder), None
    except CheckpointError as exc:
        return folder, None, str(exc)


def what_was_seen(state: dict | None) -> str:
    if state is None:
        return "no checkpoint"
    return f"epoch {state['epoch']}, step {state['step']} (Cumulative Time {state['cumulative_time']!r} s)"


def resume_disagreement(seen: list[tuple[str, str | None]]) -> str | None:
    problem, views = agreed_problem([p for _, p in seen]), [view for view, _ in seen]
    if problem or len(set(views)) <= 1:
        return problem
    listed = "; ".join(f"rank {rank} sees {view}" for rank, view in enumerate(views))
    return (
        f"the ranks do not see the same checkpoint: {listed}. Every node must see the same --checkpoint-dir "
        "(a shared folder)"
    )


def resume_problem(
    checkpoint: dict,
    recipe: dict,
    world_size: int,
    model_width: int,
    data: dict | None = None,
    architecture: str | None = ARCHITECTURE,
) -> str | None:
    """Why this checkpoint cannot continue as this run; `architecture` None: the earlier network."""
    if checkpoint.get("architecture") != architecture:
        held = checkpoint.get("architecture") or "an earlier, non-course WideResNet"
        return f"the model changed (the checkpoint holds {held}): start a new run in an empty --checkpoint-dir"
    if checkpoint["world_size"] != world_size:
        return (
            f"the checkpoint was written by {checkpoint['world_size']} processes, this run has {world_size}: "
            "resume with the same --num-nodes x --num-gpus"
        )
    if checkpoint["model_width"] != model_width:
        return f"the checkpoint holds a model of width {checkpoint['model_width']}, this run builds {model_width}"
    for key, value in (data or {}).items():
        if key in checkpoint and checkpoint[key] != value:
            flag = {"train_images": "--train-subset", "val_images": "--val-subset"}.get(key, "--batch-size")
            return (
                f"the checkpoint's run had {key.replace('_', ' ')} = {checkpoint[key]}, this run has {value}: "
                f"resume with the same {flag}"
            )
    # keys newer than the checkpoint had their defaults; a key this version lacks is a difference
    defaults = as_dict(Recipe())
    old = {**{k: defaults[k] for k in recipe if k in defaults}, **checkpoint["recipe"]}
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed
        )
    return None
