"""CIFAR-10: find or download, load and validate; the per-image dataset and its loader options.

Read with a restricted unpickler, not torchvision: re-encoded copies (other md5) load, crafted files run no code.
"""

import functools
import itertools
import os
import pickle
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from .errors import UserError

# CIFAR10_URL in the environment may name a mirror; the md5 check still applies.
OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
OFFICIAL_MD5 = "c58f30108f718f92721af3b95e74349a"
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
VAL_FILES = ["test_batch"]
TRAIN_SIZE, VAL_SIZE = 50_000, 10_000
NUM_CLASSES = 10

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
# recipe key normalization: (mean, std) per channel; "course" is the course script's Normalize((0.5,) * 3, (0.5,) * 3)
NORMALIZATION = {"cifar": (MEAN, STD), "course": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}


class DataError(UserError):
    pass


def dataset_folder(data_dir) -> Path:
    return Path(data_dir) / FOLDER


def dataset_present(data_dir) -> bool:
    folder = dataset_folder(data_dir)
    return all((folder / name).is_file() for name in TRAIN_FILES + VAL_FILES)


def how_to_provide(data_dir) -> str:
    if (Path(data_dir) / TRAIN_FILES[0]).is_file():  # the batches folder itself was given
        return (
            f"CIFAR-10 is not in {dataset_folder(data_dir)}: {data_dir} holds {TRAIN_FILES[0]} itself, so it is the "
            f"{FOLDER} folder; --data-dir takes the folder above it: --data-dir {Path(data_dir).resolve().parent}"
        )
    return (
        f"CIFAR-10 is not in {dataset_folder(data_dir)}. Provide it in the official python layout "
        f"(cifar-10-batches-py/data_batch_1..5, test_batch): extract the official cifar-10-python.tar.gz into "
        f"{data_dir}, or copy a folder in that layout there; with internet the first run downloads the archive "
        f"(CIFAR10_URL=<url> for a mirror of it)."
    )


def download_cifar10(data_dir) -> str | None:
    """Download and extract the archive unless the data is there (one process per node); None, or why it failed."""
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


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Python 3's protocol 0-2 pickles encode bytes with latin1; any other codec is refused."""
    if encoding != "latin1":
        raise RefusedGlobal(f"_codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


@functools.cache
def _allowed_globals() -> dict:
    """(module, name) -> what rebuilds a numpy array, under numpy 1.x and 2.x names."""
    import numpy

    try:
        from numpy._core import multiarray, numeric
    except ImportError:
        from numpy.core import multiarray, numeric
    allowed = {
        ("numpy", "ndarray"): numpy.ndarray,
        ("numpy", "dtype"): numpy.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for package in ("numpy.core", "numpy._core"):
        allowed[(f"{package}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{package}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class BatchUnpickler(pickle.Unpickler):
    """Hands out only the globals that rebuild a numpy array, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str):
        allowed = _allowed_globals().get((module, name))
        if allowed is None:
            raise RefusedGlobal(f"{module}.{name}")
        return allowed


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and validate one batch file; errors name the file."""
    try:
        with open(path, "rb") as f:
            batch = BatchUnpickler(f, encoding="latin1").load()
    except FileNotFoundError:
        raise DataError(f"{path} is missing. " + how_to_provide(path.parent.parent)) from None
    except RefusedGlobal as exc:
        raise DataError(
            f"{path} is not a CIFAR-10 batch file: it asks for {exc}, which the official files never "
            f"contain. It was not loaded (nothing in it ran); replace {path.parent} with a copy "
            f"from a source you trust"
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
    if dtype is None or str(dtype) != "uint8" or len(shape) != 2 or shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: 'data' must be uint8 [N, 3072], found {dtype} {shape}")
    labels = _labels(path, labels)
    if labels.numel() != shape[0]:
        raise DataError(f"{path}: {shape[0]} images but {labels.numel()} labels")
    if labels.numel() and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DataError(f"{path}: labels must be 0-9, found {labels.min().item()}..{labels.max().item()}")
    images = torch.from_numpy(data.copy()).view(-1, 3, 32, 32)
    return images, labels


def _labels(path: Path, labels) -> torch.Tensor:
    """'labels' as int64 [N], else a DataError (which every rank shares; a TypeError it could not)."""
    try:
        values = torch.as_tensor(list(labels))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        values = None
    if (
        values is None
        or values.numel()
        and (
            values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool
        )
    ):
        kinds = sorted({type(v).__name__ for v in labels}) if isinstance(labels, (list, tuple)) else []
        found = f"a {type(labels).__name__} of {', '.join(kinds)}" if kinds else type(labels).__name__
        raise DataError(f"{path}: 'labels' must be a list of integers 0-9, found {found}")
    return values.to(torch.int64)


def load_split(data_dir, train: bool, subset: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [N, 3, 32, 32], int64 [N]) of a split; `subset` keeps the first N."""
    folder = dataset_folder(data_dir)
    if not dataset_present(data_dir):
        raise DataError(how_to_provide(data_dir))
    files, expected = (TRAIN_FILES, TRAIN_SIZE) if train else (VAL_FILES, VAL_SIZE)
    parts = [_read_batch(folder / name) for name in files]
    images = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    split = "train" if train else "validation"
    if subset is None:
        if len(labels) != expected:
            raise DataError(
                f"{folder}: the {split} split has {len(labels)} images, expected {expected}; "
                f"the copy is incomplete (or use --{'train' if train else 'val'}-subset)"
            )
    else:
        if not 0 < subset <= len(labels):
            raise DataError(
                f"--{'train' if train else 'val'}-subset {subset}: must be between 1 and "
                f"{len(labels)} (the {split} images in {folder})"
            )
        images, labels = images[:subset], labels[:subset]
    return images, labels


def loader_options(recipe, dataset, run) -> dict:
    """DataLoader options for `dataset` on `run`'s rank. Its own generator: a mid-epoch resume's extra iterator
    must not draw from the global stream dropout uses. A dataset that makes whole batches itself (the device
    pipeline's `__getitems__`) is not collated again."""
    per_image_on_gpu = run.device.type == "cuda" and recipe.data_pipeline == "dataloader"
    num_workers = recipe.num_workers if per_image_on_gpu else 0
    return dict(
        num_workers=num_workers,
        pin_memory=per_image_on_gpu,
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_stop_signal,
        generator=torch.Generator().manual_seed(recipe.seed + run.rank),
        collate_fn=_as_made if hasattr(dataset, "__getitems__") else None,
    )


def _as_made(batch):
    return batch


class CIFAR10(Dataset):
    """Per-image CPU pipeline: augmented (recipe key augmentation) when `augment`, then normalised."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        augment: bool,
        augmentation: str = "crop_flip",
        normalization: str = "cifar",
    ):
        # Lazy: torchvision imports torch._dynamo (slow), which only this pipeline needs.
        from torchvision.transforms import v2

        self.images, self.labels = images, labels
        if not augment:
            steps = []
        elif augmentation == "course":  # the course script's transform_train, on uint8 tensors instead of PIL images
            steps = [
                v2.RandomHorizontalFlip(),
                v2.RandomRotation(10),
                v2.RandomAffine(0, shear=10, scale=(0.8, 1.2)),
                v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
            ]
        else:
            steps = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]
        mean, std = NORMALIZATION[normalization]
        self.transform = v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(self.images[index]), self.labels[index]


class SkipFirst(Sampler):
    """A BatchSampler less its first `skip` batches: a mid-epoch resume gets exactly the remaining ones. Over
    DeviceBatches, the epoch's batches go to the device in one copy and come out as rows of it: a copy of each
    step's list would make the host wait for the GPU every step."""

    def __init__(self, batches):
        self.batches, self.skip = batches, 0

    def __iter__(self):
        dataset = getattr(getattr(self.batches, "sampler", None), "dataset", None)
        device = getattr(dataset, "device", None)  # DeviceBatches'
        remaining = itertools.islice(iter(self.batches), self.skip, None)
        if device is None:
            return remaining
        batches = list(remaining)  # drop_last: all of one size
        return iter(torch.tensor(batches, device=device) if batches else [])

    def __len__(self) -> int:
        return len(self.batches) - self.skip


def ignore_stop_signal(worker_id: int) -> None:
    """worker_init_fn: Slurm signals every process of a step; the stop is for the ranks, not workers."""
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
