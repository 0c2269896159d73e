"""Checkpoint files written so that a crash never leaves a torn one, and read as data only.

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
from pathlib import Path

import torch

from .errors import RunStopped, UserError, agreed_problem


class CheckpointError(UserError):
    pass


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
        raise CheckpointError(
            f"{path} lacks {', '.join(missing)}, which this version needs to continue a run exactly: an earlier "
            f"version wrote it, or it is not a checkpoint of this project. It is left as it is: start afresh in an "
            f"empty --checkpoint-dir"
        )
    return state


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


def _loading(where, action) -> None:
    try:
        action()
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_not_ours(where, _refusal(exc))) from None
    except Exception as exc:
        raise CheckpointError(f"{where} was found but cannot be loaded into this run ({why(exc)})") from None
