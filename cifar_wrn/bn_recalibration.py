"""BatchNorm statistics re-estimated after an epoch (recipe key bn_recalibration): the same unaugmented images
each epoch, each rank its share, the result averaged over the ranks."""

import torch
from torch import nn

from .datasets import DeviceBatches, recalibration_images


def recalibration_batches(train_set, recipe, rank: int, world_size: int, device) -> list:
    """This rank's unaugmented bn_recalibration batches, as many as every rank's (sync_bn)."""
    images = recalibration_images(recipe, len(train_set), world_size)
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


@torch.no_grad()
def recalibrate_bn(network: nn.Module, batches: list, autocast: dict, average):
    """fork_rng: the train-mode forwards' Dropout must not draw from the training's stream."""
    if not batches:
        return
    device = next(network.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.autocast(**autocast):
        layers = cumulative_average(network, batches)
    for module in layers:
        average(module.running_mean), average(module.running_var)


def cumulative_average(network: nn.Module, batches: list) -> list:
    """torch.optim.swa_utils.update_bn's statistics, bit for bit, without its host read per layer and batch
    (momentum None: float(num_batches_tracked)): batch k's factor 1 / (k + 1) is the momentum, a host float."""
    layers = [m for m in network.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta, was_training = [m.momentum for m in layers], network.training
    for m in layers:
        m.reset_running_stats()
    network.train()
    for k, batch in enumerate(batches):
        for m in layers:
            m.momentum = 1 / (k + 1)
        network(batch)
    for m, momentum in zip(layers, momenta):
        m.momentum = momentum
    network.train(was_training)
    return layers
