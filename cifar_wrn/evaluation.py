"""Exact validation: the padding mask, test-time augmentation and the evaluation loop."""

import torch
from torch.utils.data import DistributedSampler


def real_sample_mask(sampler: DistributedSampler) -> torch.Tensor:
    """False for DistributedSampler's padding, which repeats images."""
    positions = sampler.rank + torch.arange(sampler.num_samples) * sampler.num_replicas
    return positions < len(sampler.dataset)


def tta_logits(model, images: torch.Tensor, flip: bool = False, cache: dict | None = None) -> torch.Tensor:
    """The logits validation scores: with `flip`, the mean (in fp32) of the batch's and its mirror's, the same
    weights as the model's own; `cache` ({mirrored: logits}) reuses the views across calls."""
    cache = {} if cache is None else cache
    views = (False, True) if flip else (False,)
    for mirrored in views:
        if mirrored not in cache:
            cache[mirrored] = model(images.flip(3) if mirrored else images)
    return sum(cache[mirrored].float() for mirrored in views) / len(views)  # fp32 mean of bf16 views


@torch.no_grad()
def evaluate(
    model,
    loader,
    mask: torch.Tensor | None,
    device,
    autocast_dtype=None,
    tta_flip: bool = False,
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
            logits = tta_logits(model, images, tta_flip)
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


def exact_ratios(averaged: torch.Tensor, world_size: int, expected: int | None = None) -> tuple[float, float]:
    """(loss, accuracy) from evaluate()'s [loss_sum, correct, count] averaged over `world_size` ranks: times the
    world size, the sums again, with the counts rounded back to whole images, so that 8,500 of 10,000 is 0.85
    at any world size (the AVG's division by 7 alone leaves 0.8499999999999999)."""
    loss_sum, correct, count = (averaged.double() * world_size).tolist()
    if expected is not None and round(count) != expected:
        raise RuntimeError(f"validation counted {count} images, expected {expected}")
    return loss_sum / round(count), round(correct) / round(count)


def evaluate_run(run, gather=None) -> torch.Tensor:
    """evaluate() of this rank's validation loader as `run` evaluates: its EMA or model, its recipe's precision
    and flip, a bar on rank 0's terminal; the sampler's padding masked out, unless `gather` drops it."""
    from .bars import validation_bar

    recipe, data = run.recipe, run.data
    dtype = torch.bfloat16 if recipe.precision == "bf16" else None  # an EMA copy is not autocast by a wrapper
    loader = validation_bar(run.show, data.val_loader)
    return evaluate(run.eval_model, loader, data.val_mask, run.device, dtype, recipe.tta_flip, gather=gather)
