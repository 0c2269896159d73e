"""The on-device pipeline: the uint8 dataset on the device, augmented a batch at a time."""

import math

import torch
from torch.utils.data import Dataset

from .data import CIFAR10, NORMALIZATION, DataError, load_split


def load_datasets(source, run) -> tuple[Dataset, Dataset]:
    """`source`: cli.DataSource. A DataError (the same on every rank) where a rank would get no batch."""
    train_data = load_split(source.data_dir, True, source.train_subset)
    val_data = load_split(source.data_dir, False, source.val_subset)
    recipe, images, world_size = run.recipe, len(train_data[1]), run.world_size
    if math.ceil(images / world_size) < recipe.batch_size:
        raise DataError(
            f"{images} training images over {world_size} processes give less than one batch of "
            f"{recipe.batch_size} per process"
        )
    _recalibration_images(recipe, images, world_size)
    common = dict(normalization=recipe.normalization)
    if recipe.data_pipeline == "device":
        common.update(device=run.device, channels_last=recipe.channels_last)
        train = DeviceBatches(*train_data, augment=recipe.augment, seed=recipe.seed + run.rank, **common)
        return train, DeviceBatches(*val_data, augment=False, **common)
    train = CIFAR10(*train_data, recipe.augment, recipe.augmentation, seed=recipe.seed, **common)
    return train, CIFAR10(*val_data, augment=False, **common)


def _recalibration_images(recipe, images: int, world_size: int) -> int:
    used = min(recipe.bn_recalibration, images)
    if recipe.bn_recalibration and used < world_size:
        raise DataError(
            f"bn_recalibration={recipe.bn_recalibration}: needs at least one image per process ({world_size})"
        )
    return used


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    (n, c, h, w), device = images.shape, images.device
    padded = torch.nn.functional.pad(images, (pad,) * 4)
    dy, dx = (torch.randint(0, 2 * pad + 1, (n, 1), device=device, generator=generator) for _ in range(2))
    rows = (dy + torch.arange(h, device=device))[:, None, :, None].expand(n, c, h, w + 2 * pad)
    cols = (dx + torch.arange(w, device=device))[:, None, None, :].expand(n, c, h, w)
    crops = padded.gather(2, rows).gather(3, cols)
    flip = torch.rand(n, device=device, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], crops.flip(3), crops)


def recalibration_batches(train_set, recipe, rank: int, world_size: int, device) -> list:
    """This rank's unaugmented bn_recalibration batches, as many as every rank's (sync_bn)."""
    images = _recalibration_images(recipe, len(train_set), world_size)
    if not images:
        return []
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(recipe.seed))
    per_rank = images // world_size
    mine = order[:images][rank::world_size][:per_rank]
    share = DeviceBatches(
        train_set.images[mine], train_set.labels[mine], device, False, 0, recipe.channels_last, recipe.normalization
    )
    size = min(recipe.batch_size, per_rank)
    return [share[torch.arange(start, start + size)][0] for start in range(0, per_rank - size + 1, size)]


class DeviceBatches(Dataset):
    """`dataset[indices]` is a normalised batch."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        device,
        augment: bool,
        seed: int = 0,
        channels_last: bool = False,
        normalization: str = "cifar",
    ):
        self.device = torch.device(device)
        self.images, self.labels = images.to(self.device), labels.to(self.device)
        self.augment, self.channels_last = augment, channels_last
        self.mean, self.std = (
            torch.tensor(v, device=self.device).view(1, 3, 1, 1) * 255 for v in NORMALIZATION[normalization]
        )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices, device=self.device)
        images = self.images[index]
        if self.augment:
            images = random_crop_flip(images, self.generator)
        images = (images.float() - self.mean) / self.std
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, self.labels[index]

    __getitems__ = __getitem__  # whole batches: not collated again

    def set_epoch(self, epoch: int) -> None:
        """Nothing: the augmentation stream is this rank's generator, whose state a checkpoint holds."""
