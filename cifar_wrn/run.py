"""One rank's training objects: who the process is (setup's Process), its data (build_data's Data), then the Run,
built once by build_model from both."""

from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .bn_recalibration import recalibration_batches
from .datasets import DeviceBatches
from .evaluation import real_sample_mask
from .loaders import SkipFirst
from .model import COURSE_WIDTH
from .optim import build_step, scaled_lr
from .recipe import Recipe


@dataclass(frozen=True)
class Process:
    rank: int  # global: 0 .. world_size - 1
    local_rank: int  # on this node: the GPU it uses
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Data:
    train_set: Dataset
    val_set: Dataset
    train_loader: DataLoader
    val_loader: DataLoader
    steps_per_epoch: int
    train_sampler: DistributedSampler | None = None  # these three: None on accel_train.py's prepared loaders
    train_batches: SkipFirst | None = None
    val_sampler: DistributedSampler | None = None

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
    process: Process
    data: Data
    model: torch.nn.Module  # what the loop trains: raw_model in DDP, maybe compiled
    raw_model: torch.nn.Module  # the WideResNet itself
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    criterion: torch.nn.Module
    ema: torch.nn.Module | None = None  # evaluated instead of raw_model (recipe key ema_decay)
    show: bool = False  # progress bars
    model_width: int = COURSE_WIDTH
    optimizer_step: object = field(init=False)  # optimizer.step() and the EMA's update (optim.build_step)
    recalibration: list = field(init=False)  # this rank's BatchNorm re-estimation batches (recipe bn_recalibration)

    def __post_init__(self):
        self.optimizer_step = build_step(self.optimizer, self.ema, self.raw_model, self.recipe.compile_optimizer)
        self.recalibration = recalibration_batches(
            self.data.train_set, self.recipe, self.rank, self.world_size, self.device
        )

    rank = property(lambda self: self.process.rank)
    local_rank = property(lambda self: self.process.local_rank)
    world_size = property(lambda self: self.process.world_size)
    device = property(lambda self: self.process.device)
    is_main = property(lambda self: self.process.is_main)

    @property
    def global_batch_size(self) -> int:
        return self.recipe.batch_size * self.world_size

    @property
    def lr(self) -> float:
        return scaled_lr(self.recipe, self.global_batch_size)

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
        return self.recipe.memory_format

    @property
    def ddp(self) -> DistributedDataParallel | None:  # under torch.compile's wrapper; None: Accelerate, 1 process
        model = getattr(self.model, "_orig_mod", self.model)
        return model if isinstance(model, DistributedDataParallel) else None
