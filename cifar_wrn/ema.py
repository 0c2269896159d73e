"""EMA of the weights, decay min(d, (1 + n) / (10 + n)): a fixed d would keep d**n of the random init."""

import copy

import numpy
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from .pipeline import recalibration_batches


def warmed_up_decay(decay: float, num_updates):
    if isinstance(num_updates, torch.Tensor):
        return torch.clamp((1 + num_updates) / (10 + num_updates), max=decay)
    return min(decay, (1 + num_updates) / (10 + num_updates))


class WarmedUpEMA(AveragedModel):
    """AveragedModel without a GPU sync per update: a host int mirrors the device counter `n_averaged`."""

    def __init__(self, model: nn.Module, decay: float):
        # without device= AveragedModel keeps its counter on the CPU
        super().__init__(model, device=next(model.parameters()).device, use_buffers=True)
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            # in float32 as a device-side decay would be, on the host: no tensor to read back
            n, one = numpy.float32(self.updates), numpy.float32(1)
            weight = float(one - min(numpy.float32(self.decay), (one + n) / (numpy.float32(10) + n)))
            pairs = list(zip(averaged, current))
            floats = [pair for pair in pairs if torch.is_floating_point(pair[0])]
            counters = [pair for pair in pairs if not torch.is_floating_point(pair[0])]
            torch._foreach_lerp_(*map(list, zip(*floats)), weight)
            torch._foreach_copy_(*map(list, zip(*counters)))  # num_batches_tracked is copied, not averaged
        self.n_averaged += 1
        self.updates += 1

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.updates = int(self.n_averaged.item())
        return result


def build_ema(model: nn.Module, decay: float) -> WarmedUpEMA:
    return WarmedUpEMA(model, decay)


def evaluated_network(eval_model: nn.Module) -> nn.Module:
    """The network inside an EMA, or the model: what is evaluated and saved."""
    return eval_model.module if isinstance(eval_model, AveragedModel) else eval_model


@torch.no_grad()
def recalibrate_bn(eval_model: nn.Module, batches: list, autocast: dict, average) -> None:
    """Re-estimate the evaluated network's BatchNorm statistics on `batches`, averaged over ranks.
    fork_rng: update_bn runs Dropout, which must not consume the training's random stream."""
    if not batches:
        return
    network = evaluated_network(eval_model)
    device = next(network.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.autocast(**autocast):
        update_bn(batches, network)
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            average(module.running_mean)
            average(module.running_var)


def recalibrated(eval_model: nn.Module, train_set, recipe, world_size: int) -> nn.Module:
    """A copy of the evaluated network whose BatchNorm statistics are re-estimated in this one process as a
    `world_size`-process run of `recipe` does it (its bn_recalibration, batch size, seed and layout): each rank
    on its share (recalibration_batches), then the mean over the ranks (the trainers' all-reduce). On the CPU."""
    network = evaluated_network(eval_model)
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=recipe.precision == "bf16")
    shares = []
    for rank in range(world_size):
        share = copy.deepcopy(network)
        recalibrate_bn(
            share, recalibration_batches(train_set, recipe, rank, world_size, "cpu"), autocast, lambda stat: None
        )
        shares.append(dict(share.named_buffers()))
    result = copy.deepcopy(network)
    for name, buffer in result.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            buffer.copy_(sum(share[name] for share in shares) / world_size)
    return result
