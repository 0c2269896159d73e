"""CIFAR-10 on disk: found, downloaded (one process per node), and read as data only, checked; the command
`cifar-wrn-data download|check DIR`."""

import argparse
import os
import pickle
import sys
from pathlib import Path

import numpy
import torch

from .errors import UserError

try:
    from numpy._core import multiarray, numeric
except ImportError:
    from numpy.core import multiarray, numeric

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
OFFICIAL_MD5 = "c58f30108f718f92721af3b95e74349a"
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
VAL_FILES = ["test_batch"]


class DataError(UserError):
    pass


def dataset_present(data_dir) -> bool:
    return all((Path(data_dir) / FOLDER / name).is_file() for name in TRAIN_FILES + VAL_FILES)


def how_to_provide(data_dir) -> str:
    folder = Path(data_dir) / FOLDER
    if (Path(data_dir) / TRAIN_FILES[0]).is_file():
        return (
            f"CIFAR-10 is not in {folder}: {data_dir} holds {TRAIN_FILES[0]} itself; --data-dir takes the folder "
            f"above it: --data-dir {Path(data_dir).resolve().parent}"
        )
    return (
        f"CIFAR-10 is not in {folder}: extract the official cifar-10-python.tar.gz into {data_dir}, or copy a "
        f"{FOLDER}/ there (data_batch_1..5, test_batch); with internet the first run downloads it (CIFAR10_URL=<url> "
        "for a mirror)."
    )


def download_cifar10(data_dir) -> str | None:
    """None, or why the download failed (one process per node)."""
    from torchvision.datasets.utils import download_and_extract_archive

    if dataset_present(data_dir):
        return None
    url = os.environ.get("CIFAR10_URL", OFFICIAL_URL)
    try:
        download_and_extract_archive(url, download_root=str(data_dir), md5=OFFICIAL_MD5)
    except Exception as exc:
        return f"download from {url} failed: {exc}"
    return None if dataset_present(data_dir) else f"the archive from {url} did not contain {FOLDER}/"


class RefusedGlobal(pickle.UnpicklingError):
    pass


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:  # how protocol 0-2 pickles rebuild bytes
    if encoding != "latin1":
        raise RefusedGlobal(f"_codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


# What rebuilds a numpy array, under numpy 1.x and 2.x names.
ALLOWED = {("numpy", "ndarray"): numpy.ndarray, ("numpy", "dtype"): numpy.dtype, ("_codecs", "encode"): _latin1_encode}
for package in ("numpy.core", "numpy._core"):
    ALLOWED[f"{package}.multiarray", "_reconstruct"] = multiarray._reconstruct
    ALLOWED[f"{package}.numeric", "_frombuffer"] = numeric._frombuffer


class BatchUnpickler(pickle.Unpickler):
    """Not torchvision's reader: re-encoded copies (other md5) load, and a crafted file runs no code."""

    def find_class(self, module: str, name: str):
        allowed = ALLOWED.get((module, name))
        if allowed is None:
            raise RefusedGlobal(f"{module}.{name}")
        return allowed


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with open(path, "rb") as f:
            batch = BatchUnpickler(f, encoding="latin1").load()
    except FileNotFoundError:
        raise DataError(f"{path} is missing. " + how_to_provide(path.parent.parent)) from None
    except RefusedGlobal as exc:
        raise DataError(
            f"{path} is not a CIFAR-10 batch file: it asks for {exc} (nothing in it ran); replace {path.parent} "
            "with a trusted copy"
        ) from None
    except Exception as exc:
        raise DataError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); it is truncated or corrupt: "
            f"delete {path.parent} and provide the data again"
        ) from None
    if not isinstance(batch, dict) or "data" not in batch or "labels" not in batch:
        raise DataError(f"{path} is not a CIFAR-10 batch (expected a dict with 'data' and 'labels')")
    data, labels = batch["data"], batch["labels"]
    shape, dtype = getattr(data, "shape", None), getattr(data, "dtype", None)
    if str(dtype) != "uint8" or len(shape) != 2 or shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: 'data' must be uint8 [N, 3072], found {dtype} {shape}")
    labels = _labels(path, labels)
    if labels.numel() != shape[0]:
        raise DataError(f"{path}: {shape[0]} images but {labels.numel()} labels")
    if labels.numel() and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels must be 0-9, found {labels.min().item()}..{labels.max().item()}")
    return torch.from_numpy(data.copy()).view(-1, 3, 32, 32), labels


def _labels(path: Path, labels) -> torch.Tensor:
    """As int64 [N], else a DataError, which every rank shares (a TypeError it could not)."""
    try:
        values = torch.as_tensor(list(labels))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        values = torch.zeros(1, 1)
    if values.numel() and (
        values.dim() != 1 or values.is_floating_point() or values.is_complex() or values.dtype == torch.bool
    ):
        kinds = {type(v).__name__ for v in labels} if isinstance(labels, (list, tuple)) else ()
        found = f" of {', '.join(sorted(kinds))}" if kinds else ""
        raise DataError(f"{path}: 'labels' must be a list of integers 0-9, found {type(labels).__name__}{found}")
    return values.to(torch.int64)


def load_split(data_dir, train: bool, subset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`subset` keeps the first N."""
    folder = Path(data_dir) / FOLDER
    if not dataset_present(data_dir):
        raise DataError(how_to_provide(data_dir))
    files, expected = (TRAIN_FILES, 50_000) if train else (VAL_FILES, 10_000)
    parts = [_read_batch(folder / name) for name in files]
    images, labels = (torch.cat(p) for p in zip(*parts))
    split, flag = ("train", "train") if train else ("validation", "val")
    if subset is None and len(labels) != expected:
        raise DataError(
            f"{folder}: the {split} split has {len(labels)} images, expected {expected} (or use --{flag}-subset)"
        )
    if subset is not None and not 0 < subset <= len(labels):
        raise DataError(
            f"--{flag}-subset {subset}: must be between 1 and {len(labels)} (the {split} images in {folder})"
        )
    return images[:subset], labels[:subset]


def main(argv=None) -> int:
    """cifar-wrn-data; a refusal is one `error:` line, exit status 2."""
    p = argparse.ArgumentParser(
        prog="cifar-wrn-data",
        description=f"CIFAR-10 for --data-dir DIR. download: the official archive ({OFFICIAL_URL}; CIFAR10_URL="
        f"<url> for a mirror) into DIR/{FOLDER}/ unless there, then check. check: read all 60000 images as the "
        "trainers do.",
    )
    p.add_argument("action", choices=("download", "check"))
    p.add_argument("dir", metavar="DIR")
    args = p.parse_args(argv)
    try:
        if args.action == "download" and (problem := download_cifar10(args.dir)):
            raise DataError(problem)
        sizes = [len(load_split(args.dir, train)[1]) for train in (True, False)]
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {Path(args.dir) / FOLDER}: {sizes[0]} training and {sizes[1]} validation images")
    return 0
