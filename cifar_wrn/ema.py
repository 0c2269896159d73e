"""EMA of the weights, decay min(d, (1 + n) / (10 + n)): a fixed d would keep d**n of the random init."""

import numpy
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel


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
