"""SHA-256 checksums of what a checkpoint holds, value by value, and of the files Accelerate's save_state wrote."""

import hashlib
from pathlib import Path

import torch


def digest_of(state: dict) -> str:
    """sha256 of what a checkpoint holds, every key but `digest`, value by value (a tensor: its dtype, shape and
    bytes): the same after torch.save and torch.load, whatever the file's layout."""
    h = hashlib.sha256()
    _hash(h, {key: value for key, value in state.items() if key != "digest"})
    return h.hexdigest()


def _hash(h, value):
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)}\n".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _hash(h, key)
            _hash(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)}\n".encode())
        for item in value:
            _hash(h, item)
    else:  # numbers, strings, None: what weights-only loading gives back besides tensors
        text = repr(value)
        h.update(f"{type(value).__name__} {len(text)} {text}\n".encode())


def sealed(state: dict) -> dict:
    return {**state, "digest": digest_of(state)}


def file_digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def folder_digests(folder, but: str) -> dict:
    """name -> sha256, for every file in `folder` but `but`."""
    return {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != but}
