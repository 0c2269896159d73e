"""Exact validation: the padding mask, test-time augmentation and the evaluation loop."""

import torch
from torch.utils.data import DistributedSampler


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
    """Weighted mean (in fp32) of the logits over tta_weights' views; `cache` reuses them across calls."""
    cache = {} if cache is None else cache
    total = 0
    for (shift, mirrored), weight in tta_weights(flip, translate).items():
        if (shift, mirrored) not in cache:
            cache[shift, mirrored] = model(tta_view(images, shift, mirrored))
        total = total + weight * cache[shift, mirrored].float()  # fp32 mean of bf16 views, as in both trainers
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


def exact_ratios(averaged: torch.Tensor, world_size: int) -> tuple[float, float]:
    """(loss, accuracy) from evaluate()'s [loss_sum, correct, count] averaged over `world_size` ranks: times the
    world size, the sums again, with the counts rounded back to whole images, so that 8,500 of 10,000 is 0.85
    at any world size (the AVG's division by 7 alone leaves 0.8499999999999999)."""
    loss_sum, correct, count = (averaged.double() * world_size).tolist()
    return loss_sum / round(count), round(correct) / round(count)
