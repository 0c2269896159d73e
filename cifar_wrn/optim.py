"""The optimizer, its parameter groups and the learning-rate schedule a recipe asks for.

MuonSGD holds SGD and Muon (as in airbench94_muon.py) groups plus optional Lookahead in one optimizer, so the
scheduler, checkpoints and Accelerate see one object; SGD groups call torch.optim.sgd.sgd, as torch.optim.SGD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.optim.sgd import sgd

if TYPE_CHECKING:
    from .recipe import Recipe

# Keller Jordan's quintic Newton-Schulz: singular values end near 1 (0.7-1.2), which suffices.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 3  # airbench94_muon's count


def orthogonalise(matrix: torch.Tensor, steps: int = NS_STEPS, dtype=torch.bfloat16) -> torch.Tensor:
    """About U V^T of matrix = U S V^T by Newton-Schulz, on the wide side so the Gram matrix is small."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.T if tall else matrix
    x = x.to(dtype)
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonSGD(torch.optim.Optimizer):
    def __init__(
        self, groups, lr: float, momentum: float, nesterov: bool, lookahead_steps: int = 0, lookahead_alpha: float = 0.5
    ):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0, muon=False, renormalize=False)
        super().__init__(groups, defaults)
        self.lookahead_steps, self.lookahead_alpha = lookahead_steps, lookahead_alpha
        if lookahead_steps:
            for p in self._all_params():
                self.state[p]["slow"] = p.detach().clone()

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonSGD takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params)
                continue
            buffers = [self.state[p].get("momentum_buffer") for p in params]
            sgd(
                params,
                [p.grad for p in params],
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=0.0,
                nesterov=group["nesterov"],
                maximize=False,
            )
            for p, buffer in zip(params, buffers):  # sgd() creates new buffers on the first step
                self.state[p]["momentum_buffer"] = buffer
        if self.lookahead_steps:
            self._lookahead()

    def _muon_step(self, group, params):
        momentum = group["momentum"]
        for p in params:
            buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buffer.mul_(momentum).add_(p.grad)
            update = p.grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            if group["renormalize"]:  # under BN: fixes the step's relative size
                p.mul_(len(p) ** 0.5 / p.norm())
            p.add_(orthogonalise(update.reshape(len(p), -1)).view(p.shape), alpha=-group["lr"])

    def _lookahead(self):
        params = self._all_params()
        first = self.state[params[0]]  # one counter, with the first weight
        first["lookahead_count"] = first.get("lookahead_count", 0) + 1
        if first["lookahead_count"] % self.lookahead_steps:
            return
        slow = [self.state[p]["slow"] for p in params]
        torch._foreach_lerp_(slow, params, self.lookahead_alpha)
        torch._foreach_copy_(params, slow)


def scaled_lr(recipe: Recipe, global_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al., 2017): per-epoch learning stays the same as processes are added."""
    if recipe.lr_scaling == "linear":
        return recipe.base_lr * global_batch_size / recipe.reference_batch_size
    return recipe.base_lr


def build_optimizer(
    model: torch.nn.Module, recipe: Recipe, lr: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """Decaying BN scales and biases only fights the normalisation, so they get no weight decay. `fused` (default:
    on a GPU) updates every parameter in one kernel, equal to the per-tensor loop up to rounding."""
    special = lever_groups(model, recipe, lr)
    taken = {id(p) for group in special for p in group["params"]}
    trained = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    groups = [
        {"params": [p for p in trained if p.ndim > 1], "weight_decay": recipe.weight_decay},
        {"params": [p for p in trained if p.ndim <= 1], "weight_decay": 0.0, "lr": lr * recipe.bn_lr_scale},
    ]
    groups += special
    if recipe.muon or recipe.lookahead_steps:
        return MuonSGD(
            groups,
            lr=lr,
            momentum=recipe.momentum,
            nesterov=recipe.nesterov,
            lookahead_steps=recipe.lookahead_steps,
            lookahead_alpha=recipe.lookahead_alpha,
        )
    fused = next(model.parameters()).device.type == "cuda" if fused is None else fused
    return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov, fused=fused or None)


def lever_groups(model: torch.nn.Module, recipe: Recipe, lr: float) -> list[dict]:
    """Groups of the levers that are on; muon renormalises only kernels a BatchNorm directly follows."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    groups = []
    if recipe.muon:
        kernels = [p for p in model.parameters() if p.requires_grad and p.ndim == 4]
        followed = {
            id(a.weight)
            for m in model.modules()
            if isinstance(m, torch.nn.Sequential)
            for a, b in zip(m, list(m)[1:])
            if isinstance(a, torch.nn.Conv2d) and isinstance(b, torch.nn.modules.batchnorm._BatchNorm)
        }
        for renormalize in (True, False):
            groups.append(
                {
                    "params": [p for p in kernels if (id(p) in followed) == renormalize],
                    "muon": True,
                    "renormalize": renormalize,
                    "lr": recipe.muon_lr,
                    "momentum": recipe.muon_momentum,
                    "nesterov": True,
                }
            )
    if recipe.bn_bias_lr_scale != 1.0:
        groups.append(
            {
                "params": [m.bias for m in norms],
                "weight_decay": 0.0,
                "lr": lr * recipe.bn_lr_scale * recipe.bn_bias_lr_scale,
            }
        )
    if recipe.freeze_bn_scale:
        groups.append({"params": [m.weight for m in norms], "weight_decay": 0.0, "lr": 0.0})
    return [group for group in groups if group["params"]]


def build_scheduler(optimizer, recipe: Recipe, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    end = min(recipe.anneal_epochs, recipe.epochs) if recipe.anneal_epochs > 0 else recipe.epochs
    total = round(end * steps_per_epoch)
    warmup = round(recipe.warmup_epochs * steps_per_epoch)
    budget = recipe.epochs * steps_per_epoch

    def factor(step: int) -> float:
        if recipe.lr_schedule == "constant":
            return 1.0
        if step >= budget:  # extra epochs replay the budget's last one: lr 0 would train nothing
            step = budget - steps_per_epoch + (step - budget) % steps_per_epoch
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_training(raw_model: torch.nn.Module, recipe: Recipe, global_batch_size: int, steps_per_epoch: int):
    lr = scaled_lr(recipe, global_batch_size)
    optimizer = build_optimizer(raw_model, recipe, lr)
    scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
    return lr, optimizer, scheduler, torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
