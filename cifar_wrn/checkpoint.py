"""Checkpoint files: atomic writes and resume checks.

Loaded with weights_only=True: the folder may be writable by others, and a full unpickler runs any code
a file asks for.
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
from .model import ARCHITECTURE
from .recipe import RETIRED, Recipe, as_dict

FILENAME = "checkpoint.pt"
# Recipe keys a resume may change: they do not alter what was trained (`epochs` only with a constant LR).
RESUMABLE_CHANGES = {
    "epochs",
    "target_accuracy",
    "patience",
    "eval_batch_size",
    "num_workers",
    "extra_epochs",
    "startup_steps",
}


class CheckpointError(UserError):
    pass


def checkpoint_path(directory) -> Path:
    return Path(directory) / FILENAME


def check_writable(directory) -> None:
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{secrets.token_hex(6)}"
        os.close(_create_new(probe))
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {directory} is not writable: {exc.strerror or exc}") from None


def _create_new(path) -> int:
    """Open a new file; an existing file or symlink at `path` is an error, never followed."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def _remove(path) -> None:
    """Remove `path` itself, never a symlink's target."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _fsync_folder(directory) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def why(exc: BaseException) -> str:
    """One line saying why a read or write failed, in the OS's words where there are any."""
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    if "unexpected pos" in str(exc):  # torch.save's writer found its file cut short: the disk filled up under it
        return "No space left on device, or the file system went away (torch.save: unexpected pos)"
    quoted = re.search(r"\(os error (\d+)\)", str(exc))
    if quoted:
        return os.strerror(int(quoted.group(1)))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:300]}"


def attempt(action, *args) -> str | None:
    """Runs action(*args): None if it worked, else what went wrong in one line, for the ranks to gather."""
    try:
        action(*args)
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:
        return why(exc)
    return None


def stop_unless_written(problems: list, directory, leftover=None) -> None:
    """Raise RunStopped on every rank if any rank's write failed, removing `leftover`."""
    problem = agreed_problem(problems)
    if problem:
        if leftover:
            with contextlib.suppress(OSError):
                _remove(leftover)
        raise RunStopped(
            f"no checkpoint could be written in {directory} ({problem}); the previous checkpoint "
            f"there is intact, and every rank stopped",
            2,
        )


def save_atomic(state: dict, path) -> None:
    """Write `path` via a fsynced temporary file and os.replace, so a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
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
    """torch's refusal, minus its advice to load with weights_only=False."""
    text = str(exc).partition("WeightsUnpickler error:")[2].strip() or str(exc)
    return "refused by weights-only loading: " + text.splitlines()[0].split(" was not an allowed global")[0]


def load_data_only(path, required: tuple = ()) -> dict:
    """`path` as a dict, read as data only, with the `required` keys."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
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


# accel_train.py: DIR/state-<n>/ (save_state and TRAINING_STATE), named by DIR/LATEST. TRAINING_STATE is not
# registered for checkpointing: load_state unpickles those files with weights_only=False.
TRAINING_STATE = "training_state.pt"
LATEST = "LATEST"
STATE_FOLDER = re.compile(r"state-(\d+)")


def latest_checkpoint(directory) -> str | None:
    """DIR's newest checkpoint folder or None; LATEST may be written by others, so it must name a
    state-<n> folder in DIR, not a link."""
    pointer = os.path.join(directory, LATEST)
    try:
        fd = os.open(pointer, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block
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
    """Make the finished folder `incomplete` DIR's checkpoint atomically (via LATEST), then drop the old one."""
    previous = latest_checkpoint(directory)
    number = int(STATE_FOLDER.fullmatch(os.path.basename(previous)).group(1)) + 1 if previous else 1
    folder = os.path.join(directory, f"state-{number}")
    _remove(folder)  # left by a run that died before the switch
    for name in os.listdir(incomplete):  # save_state does not fsync
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
        os.replace(tmp, os.path.join(directory, LATEST))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    _fsync_folder(directory)
    if previous:
        with contextlib.suppress(OSError):  # the new checkpoint is in force already
            _remove(previous)
    return folder


def fresh_folder(folder) -> None:
    _remove(folder)
    os.mkdir(folder)


CUSTOM_FILE = re.compile(r"custom_checkpoint_\d+\.pkl")


def write_folder(save_state, folder, state: dict | None) -> None:
    """One rank's part of an accel_train.py checkpoint; TRAINING_STATE from the main process (`state` given)."""
    save_state(folder)
    if state is not None:
        torch.save(state, Path(folder) / TRAINING_STATE)


def read_training_state(folder) -> dict:
    """A folder's TRAINING_STATE (older folders: custom_checkpoint_0/1.pkl), read as data only."""
    folder = Path(folder)
    legacy = folder / "custom_checkpoint_0.pkl"
    if (folder / TRAINING_STATE).is_file() or not legacy.is_file():
        return load_data_only(folder / TRAINING_STATE, ACCEL_KEYS + ("ema",))
    ema = folder / "custom_checkpoint_1.pkl"
    return {**load_data_only(legacy, ACCEL_KEYS), "ema": load_data_only(ema) if ema.is_file() else None}


@contextlib.contextmanager
def _without_custom_files(folder: Path):
    """`folder` without its custom_checkpoint_N.pkl, which load_state refuses when nothing is registered."""
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
    """Why random states from one device type cannot resume on another, or None."""
    if saved_on == running_on:
        return None
    return (
        f"it was written by a run on {saved_on}, this run is on {running_on}: its random states, and with them "
        f"an exact resume, do not carry over (resume on {saved_on}, or start afresh in another folder)"
    )


def _loading(where, action) -> None:
    try:
        action()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_not_ours(where, _refusal(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"{where} was found but cannot be loaded into this run ({why(exc)})") from None


def rank_rng(device, generator) -> dict:
    """raw_ddp.py: this rank's random streams (torch, CUDA, the device pipeline's), for rank 0's checkpoint."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "pipeline": None if generator is None else generator.get_state(),
    }


def raw_state(run, progress, finished: bool, every_rng: list, recipe: dict, model_width: int) -> dict:
    """raw_ddp.py: everything needed to continue at `progress` (run: raw_ddp.py's TrainingRun)."""
    return {
        "model": run.raw_model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "ema": run.eval_model.state_dict() if run.eval_model is not run.raw_model else None,
        **progress.as_dict(),
        "finished": finished,
        "rng": every_rng,
        "recipe": recipe,
        "world_size": run.world_size,
        "model_width": model_width,
        "architecture": ARCHITECTURE,
        **run.data.sizes(),
    }


def accel_state(run, progress, finished: bool, pipeline: list, recipe: dict, model_width: int) -> dict:
    """accel_train.py: what save_state does not hold (run: accel_train.py's TrainingRun)."""
    return {
        **progress.as_dict(),
        "finished": finished,
        "pipeline": pipeline,
        "recipe": recipe,
        "world_size": run.world_size,
        "model_width": model_width,
        "architecture": ARCHITECTURE,
        **run.data.sizes(),
        "device": run.device.type,
        "ema": run.eval_model.state_dict() if run.eval_model is not run.raw_model else None,
    }


def resuming_line(where, progress, steps_per_epoch: int, finished: bool) -> str:
    """What rank 0 prints on a resume."""
    line = (
        f"Resuming from {where}: epoch {progress.epoch + 1}, step {progress.step} of {steps_per_epoch}, "
        f"Cumulative Time = {progress.cumulative_time:.3f}"
    )
    return line + ("\nNothing to do: that run had already finished" if finished else "")


def restore_raw(checkpoint: dict, run) -> None:
    """raw_ddp.py: this rank's part of `checkpoint` into `run` (raw_ddp.py's TrainingRun): weights, states, streams."""
    rank, device, raw_model, eval_model = run.rank, run.device, run.raw_model, run.eval_model
    generator = getattr(run.data.train_set, "generator", None)  # the device pipeline's stream

    def load():
        rng = checkpoint["rng"][rank]  # this rank's own random streams, exactly where they were
        problem = device_problem("cpu" if rng["cuda"] is None else "cuda", device.type)
        if problem:
            raise CheckpointError(problem)
        raw_model.load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.scheduler.load_state_dict(checkpoint["scheduler"])
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
    """accel_train.py: load_state(folder), the EMA and the generator. The random-state file is checked first:
    load_state would only log a bad one and resume inexactly."""
    from accelerate.utils import load as accelerate_load  # allows numpy's RNG types

    folder = Path(folder)
    path = folder / f"random_states_{accelerator.process_index}.pkl"

    def load():
        rng = accelerate_load(path) if path.is_file() else None
        if rng is None:
            raise CheckpointError(f"{path} is missing (each rank resumes its own random streams from its file)")
        if not isinstance(rng, dict) or any(key not in rng for key in RANDOM_STATE_KEYS):
            raise CheckpointError(_not_ours(path, "it is not a random state"))
        # older folders lack "device": no CUDA state means written without CUDA
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
    """(checkpoint or None, None) or (None, why it cannot be read)."""
    if not required and not checkpoint_path(directory).is_file():
        return None, None
    try:
        return load_checkpoint(directory), None
    except CheckpointError as exc:
        return None, str(exc)


def read_accel_for_resume(directory, required: bool) -> tuple[str | None, dict | None, str | None]:
    """(newest folder, its TRAINING_STATE, problem), each possibly None. A missing --resume checkpoint is a
    problem found after the group formed, so that every node stops together."""
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
    if state is None:
        return "no checkpoint"
    return f"epoch {state['epoch']}, step {state['step']} (Cumulative Time {state['cumulative_time']!r} s)"


def resume_disagreement(seen: list[tuple[str, str | None]]) -> str | None:
    """Any rank's resume problem, else ranks seeing different checkpoints (a mixed run), else None."""
    problem = agreed_problem([problem for _, problem in seen])
    if problem:
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
    checkpoint: dict,
    recipe: dict,
    world_size: int,
    model_width: int,
    data: dict | None = None,
    architecture: str | None = ARCHITECTURE,
) -> str | None:
    """Why this checkpoint cannot continue as this run, or None; `data` is checked where the checkpoint has it.
    `architecture`: this run's network (None: the earlier, non-course one, as in old logs)."""
    if checkpoint.get("architecture") != architecture:
        earlier = "an earlier, non-course WideResNet"
        return (
            f"the checkpoint holds {checkpoint.get('architecture') or earlier}; this run trains the "
            f"{architecture or earlier}: the model changed, so it cannot continue that run. Start a new run in an "
            f"empty --checkpoint-dir (the old checkpoint is left as it is)"
        )
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
    # keys newer than the checkpoint: it had their defaults; keys that left the code: gone where they were off
    defaults = as_dict(Recipe())
    saved = {k: v for k, v in checkpoint["recipe"].items() if k not in RETIRED or RETIRED[k] != v}
    old = {**{k: defaults[k] for k in recipe if k in defaults}, **saved}
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed
        )
    return None
