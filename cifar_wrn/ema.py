"""EMA of the weights, decay min(d, (1 + n) / (10 + n)): a fixed d would keep d**n of the random init."""

import copy

import numpy
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from .pipeline import recalibration_batches


def warmed_up_decay(decay: float, num_updates) -> numpy.float32:
    """In float32, as the device computed it (numpy 1.x would take a Python 1 + a float32 to float64)."""
    n, f32 = numpy.float32(num_updates), numpy.float32
    return min(f32(decay), (f32(1) + n) / (f32(10) + n))


class WarmedUpEMA(AveragedModel):
    """No GPU sync per update: a host int mirrors `n_averaged`."""

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, device=next(model.parameters()).device, use_buffers=True)
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update_parameters(self, model: nn.Module):
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            weight = float(numpy.float32(1) - warmed_up_decay(self.decay, self.updates))
            pairs = list(zip(averaged, current))
            floats = [p for p in pairs if p[0].is_floating_point()]
            counters = [p for p in pairs if not p[0].is_floating_point()]
            torch._foreach_lerp_(*map(list, zip(*floats)), weight)
            torch._foreach_copy_(*map(list, zip(*counters)))  # num_batches_tracked is copied, not averaged
        self.n_averaged += 1
        self.updates += 1

    def load_state_dict(self, *args, **kwargs):
        result = super().load_state_dict(*args, **kwargs)
        self.updates = int(self.n_averaged.item())
        return result


build_ema = WarmedUpEMA


@torch.no_grad()
def recalibrate_bn(network: nn.Module, batches: list, autocast: dict, average):
    """fork_rng: update_bn's Dropout must not draw from the training's stream."""
    if not batches:
        return
    device = next(network.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.autocast(**autocast):
        update_bn(batches, network)
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            average(module.running_mean), average(module.running_var)


def recalibrated(network: nn.Module, train_set, recipe, world_size: int) -> nn.Module:
    """A copy recalibrated on the CPU as a `world_size`-process run would."""
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=recipe.precision == "bf16")
    shares = []
    for rank in range(world_size):
        share = copy.deepcopy(network)
        batches = recalibration_batches(train_set, recipe, rank, world_size, "cpu")
        recalibrate_bn(share, batches, autocast, lambda _: None)
        shares.append(dict(share.named_buffers()))
    result = copy.deepcopy(network)
    for name, buffer in result.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            buffer.copy_(sum(share[name] for share in shares) / world_size)
    return result
