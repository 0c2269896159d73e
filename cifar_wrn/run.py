"""One rank's training objects: setup, then build_data, then build_model fill them in."""

from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .bn_recalibration import recalibration_batches
from .datasets import DeviceBatches
from .evaluation import real_sample_mask
from .loaders import SkipFirst
from .model import COURSE_WIDTH
from .recipe import Recipe, memory_format


@dataclass
class Data:
    train_set: Dataset
    val_set: Dataset
    train_loader: DataLoader
    val_loader: DataLoader
    steps_per_epoch: int
    train_sampler: DistributedSampler | None = None  # these three: None on accel_train.py's prepared loaders
    train_batches: SkipFirst | None = None
    val_sampler: DistributedSampler | None = None
    recalibration: list = field(default_factory=list)

    @property
    def val_images(self) -> int:
        return len(self.val_set)

    @property
    def val_mask(self) -> torch.Tensor | None:  # None: the prepared loader drops its padding
        return None if self.val_sampler is None else real_sample_mask(self.val_sampler)

    @property
    def generator(self) -> torch.Generator | None:  # the device pipeline's augmentation stream
        return self.train_set.generator if isinstance(self.train_set, DeviceBatches) else None

    def sizes(self) -> dict:  # what a resume must match
        return dict(train_images=len(self.train_set), val_images=self.val_images, steps_per_epoch=self.steps_per_epoch)


@dataclass
class Run:
    recipe: Recipe
    rank: int  # global: 0 .. world_size - 1
    local_rank: int  # on this node: the GPU it uses
    world_size: int
    device: torch.device
    trainer: object  # what differs between the trainers: trainers.RawDDP or trainers.Accelerated
    show: bool = False  # progress bars
    model_width: int = COURSE_WIDTH
    data: Data | None = None
    model: torch.nn.Module | None = None  # what the loop trains: raw_model in DDP, maybe compiled
    raw_model: torch.nn.Module | None = None  # the WideResNet itself
    ema: torch.nn.Module | None = None  # evaluated instead of raw_model (recipe key ema_decay)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    criterion: torch.nn.Module | None = None
    optimizer_step: object = None  # optimizer.step() and the EMA's update (optim.build_step)
    lr: float = 0.0

    @property
    def accelerator(self):  # accel_train.py's Accelerator, for its own lines (trainers.Accelerated holds it)
        return self.trainer.accelerator

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def global_batch_size(self) -> int:
        return self.recipe.batch_size * self.world_size

    @property
    def eval_model(self) -> torch.nn.Module:
        return self.raw_model if self.ema is None else self.ema

    @property
    def network(self) -> torch.nn.Module:  # the WideResNet evaluated and saved
        return self.raw_model if self.ema is None else self.ema.module

    @property
    def autocast(self) -> dict:
        return dict(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.recipe.precision == "bf16")

    @property
    def layout(self) -> torch.memory_format:
        return memory_format(self.recipe)

    @property
    def ddp(self) -> DistributedDataParallel | None:  # under torch.compile's wrapper; None: Accelerate, 1 process
        model = getattr(self.model, "_orig_mod", self.model)
        return model if isinstance(model, DistributedDataParallel) else None

    def recalibration_batches(self) -> list:  # made once
        data = self.data
        if not data.recalibration:
            data.recalibration = recalibration_batches(
                data.train_set, self.recipe, self.rank, self.world_size, self.device
            )
        return data.recalibration
