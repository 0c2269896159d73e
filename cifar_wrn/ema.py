"""Exponential moving average (EMA) of the weights, with a warm-up. Knows nothing about processes.

torch.optim.swa_utils.AveragedModel keeps the average; this module only chooses how it moves.
A fixed decay d keeps d**n of the random initial weights after n updates (with d = 0.999 and the
fast recipe's ~390 steps: 68 %), so the decay warms up instead (the rule of TensorFlow's
ExponentialMovingAverage with num_updates, and of timm's ModelEmaV2 warm-up):

    decay after n updates = min(d, (1 + n) / (10 + n))

0.18 after the first update, 0.5 after 8, 0.9 after 80, 0.99 after 890: the average follows the
weights closely while they move fast, and averages over more steps as training settles.
"""

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn


def warmed_up_decay(decay: float, num_updates):
    """The decay used for update number num_updates + 1 (num_updates: a float, int or tensor)."""
    if isinstance(num_updates, torch.Tensor):
        return torch.clamp((1 + num_updates) / (10 + num_updates), max=decay)
    return min(decay, (1 + num_updates) / (10 + num_updates))


class WarmedUpEMA(AveragedModel):
    """AveragedModel with the warm-up above, and no host synchronisation per update.

    AveragedModel.update_parameters reads its device counter `n_averaged` twice per update (`== 0` to copy
    the first time, `> 0` to average later), and a decay computed from that counter on the device reaches
    torch._foreach_lerp_ as a tensor that the host must read: three waits for the GPU per step, measured on
    an H200 (docs/optimizations.md, 7-12). Here a Python int, `updates`, mirrors the counter: the decay is
    computed on the host, in float32 as before, so the averages are bit for bit those of the device-counter
    version (tests/test_agreement.py). `n_averaged` still counts on the device (it is in state_dict and
    checkpoints); load_state_dict reads it once into the mirror."""

    def __init__(self, model: nn.Module, decay: float):
        # device=: on GPUs AveragedModel would otherwise keep its counter on the CPU
        super().__init__(model, device=next(model.parameters()).device, use_buffers=True)
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:  # the first update copies
            torch._foreach_copy_(averaged, current)
        else:
            # the float32 arithmetic of the device version, on a CPU tensor: no wait for the GPU
            weight = (1 - warmed_up_decay(self.decay, torch.tensor(float(self.updates)))).item()
            pairs = list(zip(averaged, current))
            floats = [pair for pair in pairs if torch.is_floating_point(pair[0])]
            counters = [pair for pair in pairs if not torch.is_floating_point(pair[0])]  # num_batches_tracked:
            torch._foreach_lerp_(*map(list, zip(*floats)), weight)
            torch._foreach_copy_(*map(list, zip(*counters)))  # copied rather than averaged
        self.n_averaged += 1
        self.updates += 1

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.updates = int(self.n_averaged.item())  # once, on resume
        return result


def build_ema(model: nn.Module, decay: float) -> WarmedUpEMA:
    """An averaged copy of `model` on the model's own device, BatchNorm statistics averaged too."""
    return WarmedUpEMA(model, decay)


def evaluated_network(eval_model: nn.Module) -> nn.Module:
    """The plain WideResNet inside an EMA (AveragedModel.module), or the model itself: what is
    evaluated, saved, and whose BatchNorm statistics rank 0 broadcasts before evaluation."""
    return eval_model.module if isinstance(eval_model, AveragedModel) else eval_model


@torch.no_grad()
def recalibrate_bn(eval_model: nn.Module, batches: list, autocast: dict, average) -> None:
    """bn_recalibration, after an epoch's last step and inside its clock (forward passes over training
    images are training work): replace the evaluated network's BatchNorm running statistics by the
    mean statistics of `batches` (its own forward passes in training mode:
    torch.optim.swa_utils.update_bn), then make them the same on every rank with `average`, a
    collective the entry point passes in (mean over ranks, in place). Nothing to do without batches
    (the key at 0).

    An EMA's running statistics are a moving average of the raw network's, which were measured on
    other weights; these are the averaged weights' own (docs/optimizations.md 6d).

    Training mode runs the blocks' Dropout too, which draws from the global random stream that the
    training's dropout masks come from; fork_rng puts that stream back afterwards, so turning this on
    leaves the training itself bit for bit unchanged (until 2026-12-01 it did not: docs/benchmarks.md, run 8)."""
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
