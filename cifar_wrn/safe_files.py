"""Atomic file handling: a file replaced whole or not at all, folders removed without following links, and an
OS error said in a few words."""

import os
import re
import secrets
import shutil
from pathlib import Path


def remove(path):  # never a symlink's target
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def fsync(path, flags: int = 0):
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_reason(exc: BaseException) -> str:
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
    if "unexpected pos" in str(exc):  # torch.save's file was cut short: the disk filled up
        return "No space left on device (torch.save: unexpected pos)"
    if quoted := re.search(r"\(os error (\d+)\)", str(exc)):
        return os.strerror(int(quoted.group(1)))
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def replace_atomically(path, write):
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
        fsync(path.parent)
    finally:
        if created:
            tmp.unlink(missing_ok=True)


def fresh_folder(folder):
    remove(folder)
    os.mkdir(folder)
