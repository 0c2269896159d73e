"""Checkpoints that survive crashes: atomic writes, and the checks that make a resume safe.

Only file handling and comparisons live here; which rank writes, and the barrier after it, are in
the entry points.
"""
import errno
import os
from pathlib import Path

import torch

from .errors import UserError

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


def load_checkpoint(directory) -> dict:
    path = checkpoint_path(directory)
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path} (start without --resume, or use --auto-resume "
                              f"to start fresh when there is none). The folder must be visible from every node.")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None


def resume_problem(checkpoint: dict, recipe: dict, world_size: int, model_width: int) -> str | None:
    """Why this checkpoint cannot continue as this run, or None. Never train something else silently."""
    if checkpoint["world_size"] != world_size:
        return (f"the checkpoint was written by {checkpoint['world_size']} processes, this run has {world_size}: "
                f"resume with the same --num-nodes x --num-gpus (each rank's random state and data shard "
                f"depend on it)")
    if checkpoint["model_width"] != model_width:
        return f"the checkpoint holds a model of width {checkpoint['model_width']}, this run builds {model_width}"
    old = checkpoint["recipe"]
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed)
    return None
