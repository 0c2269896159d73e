"""Exact validation: padding masked out, test-time flips, sums over the ranks."""

import torch
from torch.utils.data import DistributedSampler


def real_sample_mask(sampler: DistributedSampler) -> torch.Tensor:
    """False for DistributedSampler's padding, which repeats images."""
    positions = sampler.rank + torch.arange(sampler.num_samples) * sampler.num_replicas
    return positions < len(sampler.dataset)


def tta_logits(model, images: torch.Tensor, flip: bool = False) -> torch.Tensor:
    views = (images, images.flip(3)) if flip else (images,)
    return sum(model(view).float() for view in views) / len(views)


@torch.no_grad()
def evaluate(model, loader, mask: torch.Tensor | None, device, autocast=None, tta_flip: bool = False, gather=None):
    """float64 [loss_sum, correct, count] of the real samples (`mask`, or `gather`, drops padding); `autocast`:
    torch.autocast's arguments (Run.autocast: an EMA copy is not autocast by a wrapper), None: float32."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    offset = 0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(**(autocast or dict(device_type=device.type, enabled=False))):
            logits = tta_logits(model, images, tta_flip)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none").double()
        correct = (logits.argmax(1) == labels).double()
        if gather is not None:
            loss, correct = gather((loss, correct))
        else:
            keep = mask[offset : offset + len(labels)].to(device)
            offset += len(labels)
            loss, correct = loss[keep], correct[keep]
        totals += torch.stack([loss.sum(), correct.sum(), correct.new_tensor(len(correct))])
    return totals


def exact_ratios(averaged: torch.Tensor, world_size: int, expected: int | None = None) -> tuple[float, float]:
    """(loss, accuracy) of averaged totals, counts rounded to whole images: 8,500 of 10,000 is 0.85 at any size."""
    loss_sum, correct, count = (averaged.double() * world_size).tolist()
    if expected is not None and round(count) != expected:
        raise RuntimeError(f"validation counted {count} images, expected {expected}")
    return loss_sum / round(count), round(correct) / round(count)


def evaluate_run(run, gather=None) -> torch.Tensor:
    from .bars import validation_bar

    loader = validation_bar(run.show, run.data.val_loader)
    return evaluate(run.eval_model, loader, run.data.val_mask, run.device, run.autocast, run.recipe.tta_flip, gather)
