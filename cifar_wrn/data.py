"""CIFAR-10: find or download, load and validate, augment, evaluate exactly.

Read with a restricted unpickler, not torchvision: re-encoded copies (other md5) load, crafted files run no code.
"""

import functools
import itertools
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

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


class DataError(UserError):
    pass


def dataset_folder(data_dir) -> Path:
    return Path(data_dir) / FOLDER


def dataset_present(data_dir) -> bool:
    folder = dataset_folder(data_dir)
    return all((folder / name).is_file() for name in TRAIN_FILES + VAL_FILES)


def how_to_provide(data_dir) -> str:
    return (
        f"CIFAR-10 is not in {dataset_folder(data_dir)}. Provide it in the official python layout "
        f"(cifar-10-batches-py/data_batch_1..5, test_batch): extract the official cifar-10-python.tar.gz into "
        f"{data_dir}, or copy a folder in that layout there; with internet the first run downloads the archive "
        f"(CIFAR10_URL=<url> for a mirror of it)."
    )


def download_cifar10(data_dir) -> str | None:
    """Download and extract the archive (one process per node); None, or why it failed."""
    from torchvision.datasets.utils import download_and_extract_archive

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
    """'labels' as int64 [N], else a DataError (which load_splits shares; a TypeError it could not)."""
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


def load_splits(data_dir, train_subset: int | None, val_subset: int | None):
    """(train, val, None) or (None, None, why): every rank's answer is shared, so one failing node stops all."""
    try:
        return load_split(data_dir, True, train_subset), load_split(data_dir, False, val_subset), None
    except DataError as exc:
        return None, None, str(exc)


def make_datasets(train_data, val_data, recipe, device, rank: int) -> tuple[Dataset, Dataset]:
    if recipe.data_pipeline == "device":
        flips = alternating_flips(len(train_data[1]), recipe.seed) if recipe.alternating_flip else None
        return (
            DeviceBatches(
                *train_data,
                device,
                augment=recipe.augment,
                seed=recipe.seed + rank,
                channels_last=recipe.channels_last,
                crop_padding=recipe.crop_padding,
                flips=flips,
            ),
            DeviceBatches(*val_data, device, augment=False, channels_last=recipe.channels_last),
        )
    return (
        CIFAR10(*train_data, augment=recipe.augment, crop_padding=recipe.crop_padding),
        CIFAR10(*val_data, augment=False),
    )


def loader_options(recipe, device, rank: int) -> dict:
    """DataLoader options. Its own generator: a mid-epoch resume's extra iterator must not draw from the
    global stream dropout uses."""
    per_image_on_gpu = device.type == "cuda" and recipe.data_pipeline == "dataloader"
    num_workers = recipe.num_workers if per_image_on_gpu else 0
    return dict(
        num_workers=num_workers,
        pin_memory=per_image_on_gpu,
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_stop_signal,
        generator=torch.Generator().manual_seed(recipe.seed + rank),
    )


def require_a_step(steps_per_epoch: int, train_images: int, world_size: int, batch_size: int) -> None:
    if steps_per_epoch == 0:
        raise UserError(
            f"{train_images} training images over {world_size} processes give less than one "
            f"batch of {batch_size} per process: use more images or a smaller batch"
        )


@dataclass
class Loaders:
    train_set: Dataset
    train_loader: DataLoader
    val_loader: DataLoader
    val_images: int
    steps_per_epoch: int
    train_sampler: DistributedSampler | None = None  # these three: None under Accelerate
    train_batches: "SkipFirst | None" = None
    val_mask: torch.Tensor | None = None
    recalibration: list = field(default_factory=list)

    def sizes(self) -> dict:
        """What a checkpoint records of the data, and a resume must match."""
        return {
            "train_images": len(self.train_set),
            "val_images": self.val_images,
            "steps_per_epoch": self.steps_per_epoch,
        }


class CIFAR10(Dataset):
    """Per-image CPU pipeline: normalised, optionally cropped and flipped."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool, crop_padding: int = 4):
        # Lazy: torchvision imports torch._dynamo (slow), which only this pipeline needs.
        from torchvision.transforms import v2

        self.images, self.labels = images, labels
        crop = [v2.RandomCrop(32, padding=crop_padding)] if crop_padding else []
        steps = crop + [v2.RandomHorizontalFlip()] if augment else []
        self.transform = v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(self.images[index]), self.labels[index]


class SkipFirst(Sampler):
    """A BatchSampler less its first `skip` batches: a mid-epoch resume gets exactly the remaining ones."""

    def __init__(self, batches):
        self.batches, self.skip = batches, 0

    def __iter__(self):
        sampler = getattr(self.batches, "sampler", None)  # alternating flips need the epoch
        if isinstance(getattr(sampler, "dataset", None), DeviceBatches):
            sampler.dataset.epoch = getattr(sampler, "epoch", 0)
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        return len(self.batches) - self.skip


def ignore_stop_signal(worker_id: int) -> None:
    """worker_init_fn: Slurm signals every process of a step; the stop is for the ranks, not workers."""
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def real_sample_mask(sampler: DistributedSampler) -> torch.Tensor:
    """False for DistributedSampler's padding, which repeats images."""
    positions = sampler.rank + torch.arange(sampler.num_samples) * sampler.num_replicas
    return positions < len(sampler.dataset)


def tta_weights(flip: bool = False, translate: int = 0) -> dict:
    """{(shift, mirrored): weight} of the TTA views; powers of two, so bf16 means round exactly."""
    shifts = {0: 1.0} if translate == 0 else {0: 0.5, translate: 0.25, -translate: 0.25}
    mirrors = {False: 0.5, True: 0.5} if flip else {False: 1.0}
    return {(shift, mirrored): ws * wm for shift, ws in shifts.items() for mirrored, wm in mirrors.items()}


def tta_view(images: torch.Tensor, shift: int, mirrored: bool) -> torch.Tensor:
    """The batch shifted `shift` pixels down-right, reflection-padded (the model may never see zero borders),
    then mirrored if asked."""
    if shift != 0:
        t, (h, w) = abs(shift), images.shape[-2:]
        layout = (
            torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
        )
        padded = torch.nn.functional.pad(images, (t, t, t, t), mode="reflect")
        images = (padded[..., :h, :w] if shift > 0 else padded[..., 2 * t :, 2 * t :]).contiguous(memory_format=layout)
    return images.flip(3) if mirrored else images


def tta_logits(model, images: torch.Tensor, flip: bool = False, translate: int = 0, cache: dict | None = None):
    """Weighted mean of the logits over tta_weights' views; `cache` reuses them across calls."""
    cache = {} if cache is None else cache
    total = 0
    for (shift, mirrored), weight in tta_weights(flip, translate).items():
        if (shift, mirrored) not in cache:
            cache[shift, mirrored] = model(tta_view(images, shift, mirrored))
        total = total + weight * cache[shift, mirrored]
    return total


@torch.no_grad()
def evaluate(
    model,
    loader,
    mask: torch.Tensor | None,
    device,
    autocast_dtype=None,
    tta_flip: bool = False,
    tta_translate: int = 0,
    gather=None,
) -> torch.Tensor:
    """float64 [loss_sum, correct, count] over real samples (`mask`, or `gather` drops padding): sums reduce
    exactly over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    offset = 0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logits = tta_logits(model, images, tta_flip, tta_translate)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none").double()
        correct = (logits.argmax(1) == labels).double()
        if gather is not None:
            loss, correct = gather((loss, correct))
        else:
            keep = mask[offset : offset + len(labels)].to(device)
            offset += len(labels)
            loss, correct = loss[keep], correct[keep]
        totals += torch.stack(
            [loss.sum(), correct.sum(), torch.tensor(len(correct), dtype=torch.float64, device=device)]
        )
    return totals


def alternating_flips(images: int, seed: int) -> torch.Tensor:
    """airbench's alternating flip: image i is mirrored in epoch e when bit i XOR (e mod 2) is 1."""
    return torch.randint(0, 2, (images,), generator=torch.Generator().manual_seed(seed)).bool()


def random_crop_flip(
    images: torch.Tensor, generator: torch.Generator, pad: int = 4, flip: torch.Tensor | None = None
) -> torch.Tensor:
    """Random crop and flip of a whole uint8 batch at once; `flip` (bool [B]) replaces the coin toss."""
    n, c, h, w = images.shape
    device = images.device
    if pad == 0:
        flip = torch.rand(n, device=device, generator=generator) < 0.5 if flip is None else flip
        return torch.where(flip[:, None, None, None], images.flip(3), images)
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n, 1), device=device, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n, 1), device=device, generator=generator)
    rows = (dy + torch.arange(h, device=device))[:, None, :, None].expand(n, c, h, w + 2 * pad)
    cols = (dx + torch.arange(w, device=device))[:, None, None, :].expand(n, c, h, w)
    crops = padded.gather(2, rows).gather(3, cols)
    flip = torch.rand(n, device=device, generator=generator) < 0.5 if flip is None else flip
    return torch.where(flip[:, None, None, None], crops.flip(3), crops)


def recalibration_batches(train_set, recipe, rank: int, world_size: int, device) -> list:
    """This rank's unaugmented bn_recalibration batches; every rank gets the same count, as sync_bn needs."""
    images, batch_size = min(recipe.bn_recalibration, len(train_set)), recipe.batch_size
    if recipe.bn_recalibration == 0:
        return []
    if images < world_size:
        raise DataError(
            f"bn_recalibration={recipe.bn_recalibration}: needs at least one image per process ({world_size} processes)"
        )
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(recipe.seed))
    per_rank = images // world_size
    mine = order[:images][rank::world_size][:per_rank]
    share = DeviceBatches(
        train_set.images[mine], train_set.labels[mine], device, augment=False, channels_last=recipe.channels_last
    )
    size = min(batch_size, per_rank)
    return [share[torch.arange(start, start + size)][0] for start in range(0, per_rank - size + 1, size)]


class DeviceBatches(Dataset):
    """The split as uint8 on `device`; `dataset[indices]` is a normalised batch (DataLoader batch_size=None)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        device,
        augment: bool,
        seed: int = 0,
        channels_last: bool = False,
        crop_padding: int = 4,
        flips: torch.Tensor | None = None,
    ):
        self.device = torch.device(device)
        self.images, self.labels = images.to(self.device), labels.to(self.device)
        self.flips, self.epoch = None if flips is None else flips.to(self.device), 0
        self.augment, self.channels_last, self.crop_padding = augment, channels_last, crop_padding
        self.mean = torch.tensor(MEAN, device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=self.device).view(1, 3, 1, 1) * 255
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, device=self.device)
        images = self.images[index]
        if self.augment:
            flip = None if self.flips is None else self.flips[index] ^ bool(self.epoch % 2)
            images = random_crop_flip(images, self.generator, self.crop_padding, flip)
        images = (images.float() - self.mean) / self.std
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, self.labels[index]
