"""Checkpoint files: never torn by a crash; read as data only, as others may write to the folder."""

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


class CheckpointError(UserError):
    pass


def check_writable(directory):
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {directory} is not writable: {exc.strerror or exc}") from None


def _remove(path):  # never a symlink's target
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _fsync(path, flags: int = 0):
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def why(exc: BaseException) -> str:
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    if "unexpected pos" in str(exc):  # torch.save's file was cut short: the disk filled up
        return "No space left on device (torch.save: unexpected pos)"
    if quoted := re.search(r"\(os error (\d+)\)", str(exc)):
        return os.strerror(int(quoted.group(1)))
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


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
                _remove(leftover)
        raise RunStopped(
            f"no checkpoint could be written in {directory} ({problem}); the previous checkpoint there is intact",
            2,
        )


def _replace(path, write):
    """Via a fsynced temporary file: never torn."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    created = False
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), "wb") as f:
            created = True
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        if created:
            tmp.unlink(missing_ok=True)


def save_atomic(state: dict, path):
    try:
        _replace(path, lambda f: torch.save(state, f))
    except Exception as exc:
        raise CheckpointError(f"could not write {path}: {why(exc)}") from None


def _not_ours(path, why: str) -> str:
    return f"{path} is not a checkpoint this project wrote ({why}); nothing in it ran; resume from one you trust"


def load_data_only(path, required: tuple = ()) -> dict:
    with _loading(path, "cannot be read"):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(_not_ours(path, f"it holds a {type(state).__name__}, not a dict"))
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
    _remove(folder)  # left by a run that died before the switch
    for name in os.listdir(incomplete):  # save_state does not fsync
        _fsync(os.path.join(incomplete, name), os.O_NOFOLLOW)
    os.rename(incomplete, folder)
    _replace(os.path.join(directory, LATEST), lambda f: f.write(f"state-{number}\n".encode()))
    if previous:
        with contextlib.suppress(OSError):  # the new checkpoint is in force already
            _remove(previous)
    return folder


def fresh_folder(folder):
    _remove(folder)
    os.mkdir(folder)


@contextlib.contextmanager
def _loading(where, failed: str = "was found but cannot be loaded into this run"):
    try:
        yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:  # torch's refusal, minus its advice to load with weights_only=False
        text = (str(exc).partition("WeightsUnpickler error:")[2].strip() or str(exc)).splitlines()[0]
        raise CheckpointError(
            _not_ours(where, "refused by weights-only loading: " + text.split(" was not an allowed global")[0])
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{where} {failed} ({why(exc)})") from None
