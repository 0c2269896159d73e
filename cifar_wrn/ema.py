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
    """No GPU sync per update: a host int mirrors `n_averaged`, the steps seen. Every `every` steps (recipe key
    ema_every) it averages, at the decay the steps between would have applied: the step's decay ** every."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1):
        super().__init__(model, device=next(model.parameters()).device, use_buffers=True)
        self.decay, self.every, self.updates = decay, every, 0

    def due(self) -> float | None:
        """Counts a step; the model's weight in the average at it (1.0 at the first: a copy), or None: none due."""
        seen, self.updates = self.updates, self.updates + 1
        self.n_averaged += 1
        if self.updates % self.every:
            return None
        return 1.0 if seen < self.every else float(numpy.float32(1) - warmed_up_decay(self.decay, seen) ** self.every)

    @torch.no_grad()
    def average(self, model: nn.Module, weight: float):
        pairs = list(zip([*self.module.parameters(), *self.module.buffers()], [*model.parameters(), *model.buffers()]))
        floats = [(a, b.detach()) for a, b in pairs if a.is_floating_point()]
        torch._foreach_lerp_(*map(list, zip(*floats)), weight)  # at 1.0 a copy: lerp ends at `end` itself
        counters = [p for p in pairs if not p[0].is_floating_point()]
        torch._foreach_copy_(*map(list, zip(*counters)))  # num_batches_tracked is copied, not averaged

    def update_parameters(self, model: nn.Module):
        weight = self.due()
        if weight is not None:
            self.average(model, weight)

    def load_state_dict(self, *args, **kwargs):
        result = super().load_state_dict(*args, **kwargs)
        self.updates = int(self.n_averaged.item())
        return result


build_ema = WarmedUpEMA
