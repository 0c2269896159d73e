"""How the DataLoaders deal the datasets' batches: their options, and a resumed epoch's skip."""

import itertools

import torch
from torch.utils.data import Sampler


def loader_options(dataset, recipe, process) -> dict:
    """Its own generator: a mid-epoch resume's extra iterator must not draw from the stream dropout uses.
    `process`: run.Process."""
    per_image_on_gpu = process.device.type == "cuda" and recipe.data_pipeline == "dataloader"
    num_workers = recipe.num_workers if per_image_on_gpu else 0
    return dict(
        num_workers=num_workers,
        pin_memory=per_image_on_gpu,
        persistent_workers=num_workers > 0,
        multiprocessing_context="fork" if num_workers else None,  # not spawn (mp.spawn's ranks): no import, at once
        worker_init_fn=ignore_stop_signal,
        generator=torch.Generator().manual_seed(recipe.seed + process.rank),
        collate_fn=_batch_as_is if hasattr(dataset, "__getitems__") else None,
    )


def _batch_as_is(batch):
    return batch


class SkipFirst(Sampler):
    """A BatchSampler less its first `skip` batches; DeviceBatches' indices go to the device once an epoch, as the
    epoch starts or, by prepare(), before its clock (recipe key prefetch_indices)."""

    def __init__(self, batches):
        self.batches, self.skip, self.prepared = batches, 0, None

    def __iter__(self):
        prepared, self.prepared = self.prepared, None
        return iter(self.indices() if prepared is None else prepared)

    def prepare(self) -> None:
        """This epoch's indices (set_epoch and skip set); to a GPU from pinned memory, without a wait."""
        self.prepared = self.indices(pinned=True)

    def indices(self, pinned: bool = False):
        device = getattr(self.batches.sampler.dataset, "device", None)
        remaining = itertools.islice(iter(self.batches), self.skip, None)
        if device is None:
            return remaining
        batches = list(remaining)  # drop_last: all of one size
        if not (pinned and batches and device.type == "cuda"):
            return torch.tensor(batches, device=device) if batches else []
        return torch.tensor(batches).pin_memory().to(device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.batches) - self.skip


def ignore_stop_signal(worker_id: int):
    """Slurm signals every process of a step; the stop is for the ranks."""
    import signal

    for stop in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
