"""The datasets the trainers train on, and the recipe's choice of one (data_pipeline): per image, augmented
by torchvision in the loader (CIFAR10), or the whole split on the device, a batch at a time (DeviceBatches)."""

import numpy
import torch
from torch.utils.data import Dataset

from .cifar_files import DataError, load_split

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
NORMALIZATION = {"cifar": (MEAN, STD), "course": ((0.5,) * 3, (0.5,) * 3)}


def load_datasets(source, recipe, process) -> tuple[Dataset, Dataset]:
    """`source`: cli.DataSource, `process`: run.Process. A DataError (the same on every rank) where a rank would get
    no batch."""
    train_data = load_split(source.data_dir, True, source.train_subset)
    val_data = load_split(source.data_dir, False, source.val_subset)
    images, world_size = len(train_data[1]), process.world_size
    if images < recipe.batch_size * world_size:  # Accelerate's shards: floor(floor(N / batch) / processes) steps
        raise DataError(
            f"{images} training images over {world_size} processes give less than one batch of "
            f"{recipe.batch_size} per process (0 steps an epoch): at least {recipe.batch_size * world_size} needed"
        )
    recalibration_images(recipe, images, world_size)
    common = dict(normalization=recipe.normalization)
    if recipe.data_pipeline == "device":
        common.update(device=process.device, channels_last=recipe.channels_last)
        train = DeviceBatches(*train_data, augment=recipe.augment, seed=recipe.seed + process.rank, **common)
        return train, DeviceBatches(*val_data, augment=False, **common)
    train = CIFAR10(*train_data, recipe.augment, recipe.augmentation, seed=recipe.seed, **common)
    return train, CIFAR10(*val_data, augment=False, **common)


def recalibration_images(recipe, images: int, world_size: int) -> int:
    used = min(recipe.bn_recalibration, images)
    if recipe.bn_recalibration and used < world_size:
        raise DataError(
            f"bn_recalibration={recipe.bn_recalibration}: needs at least one image per process ({world_size})"
        )
    return used


def image_seed(seed: int, epoch: int, index: int) -> int:
    """One image's augmentation seed in one epoch: mixed from all three, so no two images or epochs share a stream."""
    return int(numpy.random.SeedSequence([seed % 2**64, epoch, index]).generate_state(1, numpy.uint64)[0])


class CIFAR10(Dataset):
    """With a `seed`, image i of epoch e is augmented from its own seed (seed, e, i) (set_epoch(e) first): the
    same numbers whichever process, worker or resumed run draws it. Without one, from torch's global stream."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        augment: bool,
        augmentation: str = "crop_flip",
        normalization: str = "cifar",
        seed: int | None = None,
    ):
        from torchvision.transforms import v2  # lazy: it imports torch._dynamo (slow)

        self.images, self.labels, self.augment, self.seed = images, labels, augment, seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # read by the loader's workers, persistent too
        if not augment:
            steps = []
        elif augmentation == "course":  # the course script's transform_train, on uint8 tensors
            steps = [
                v2.RandomHorizontalFlip(),
                v2.RandomRotation(10),
                v2.RandomAffine(0, shear=10, scale=(0.8, 1.2)),
                v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
            ]
        else:
            steps = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]
        self.transform = v2.Compose(
            [*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(*NORMALIZATION[normalization])]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __getitem__(self, index: int):
        if not self.augment or self.seed is None:
            return self.transform(self.images[index]), self.labels[index]
        with torch.random.fork_rng(devices=[]):  # torchvision's transforms draw from the global CPU generator
            torch.default_generator.manual_seed(image_seed(self.seed, int(self.epoch), int(index)))
            return self.transform(self.images[index]), self.labels[index]


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    (n, c, h, w), device = images.shape, images.device
    padded = torch.nn.functional.pad(images, (pad,) * 4)
    dy, dx = (torch.randint(0, 2 * pad + 1, (n, 1), device=device, generator=generator) for _ in range(2))
    rows = (dy + torch.arange(h, device=device))[:, None, :, None].expand(n, c, h, w + 2 * pad)
    cols = (dx + torch.arange(w, device=device))[:, None, None, :].expand(n, c, h, w)
    crops = padded.gather(2, rows).gather(3, cols)
    flip = torch.rand(n, device=device, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], crops.flip(3), crops)


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
