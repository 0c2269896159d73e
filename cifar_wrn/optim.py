"""The optimizer and learning-rate schedule a recipe asks for; MuonSGD: SGD with Muon groups (airbench94_muon.py)."""

import torch

from .recipe import Recipe

# Keller Jordan's quintic Newton-Schulz: singular values end near 1 (0.7-1.2), which suffices.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 3  # airbench94_muon's count


def orthogonalise(matrix: torch.Tensor, steps: int = NS_STEPS, dtype=torch.bfloat16) -> torch.Tensor:
    """About U V^T of matrix = U S V^T by Newton-Schulz, on the wide side so the Gram matrix is small."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.size(0) > matrix.size(1)
    x = (matrix.T if tall else matrix).to(dtype)
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonSGD(torch.optim.SGD):
    """SGD whose groups with `muon` take Muon's step: the gradient's Nesterov momentum (`muon_momentum`), as a
    matrix per output channel, orthogonalised; a kernel a BatchNorm follows first renormalised to norm sqrt(out).
    SGD applies that update as the gradient (those groups have SGD momentum 0), so one optimizer holds all groups."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in [p for p in group["params"] if p.grad is not None] if group.get("muon") else ():
                momentum, buffer = (
                    group["muon_momentum"],
                    self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)),
                )
                buffer.mul_(momentum).add_(p.grad)
                update = p.grad.add(buffer, alpha=momentum)
                if group["renormalize"]:  # under BN: fixes the step's relative size
                    p.mul_(len(p) ** 0.5 / p.norm())
                p.grad.copy_(orthogonalise(update.reshape(len(p), -1)).view(p.shape))
        return super().step(closure)


def scaled_lr(recipe: Recipe, global_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al., 2017)."""
    linear = recipe.lr_scaling == "linear"
    return recipe.base_lr * global_batch_size / recipe.reference_batch_size if linear else recipe.base_lr


def build_optimizer(
    model: torch.nn.Module, recipe: Recipe, lr: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """No weight decay on BN scales and biases: it only fights the normalisation. `fused`: default on a GPU, but for
    compile_optimizer (the compiler fuses the step itself)."""
    special = lever_groups(model, recipe, lr)
    taken = {id(p) for group in special for p in group["params"]}
    trained = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    groups = [
        {"params": [p for p in trained if p.ndim > 1], "weight_decay": recipe.weight_decay},
        {"params": [p for p in trained if p.ndim <= 1], "weight_decay": 0.0, "lr": lr * recipe.bn_lr_scale},
        *special,
    ]
    on_gpu = next(model.parameters()).device.type == "cuda" and not recipe.compile_optimizer
    optimizer = MuonSGD if recipe.muon else torch.optim.SGD
    fused = on_gpu if fused is None else fused
    return optimizer(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov, fused=fused or None)


BN = torch.nn.modules.batchnorm._BatchNorm


def lever_groups(model: torch.nn.Module, recipe: Recipe, lr: float) -> list[dict]:
    """Groups of the levers that are on; muon renormalises only kernels a BatchNorm directly follows."""
    norms = [m for m in model.modules() if isinstance(m, BN)]
    groups = []
    if recipe.muon:
        kernels = [p for p in model.parameters() if p.requires_grad and p.ndim == 4]
        chains = [m for m in model.modules() if isinstance(m, torch.nn.Sequential)]
        followed = {
            id(a.weight)
            for m in chains
            for a, b in zip(m, m[1:])
            if isinstance(a, torch.nn.Conv2d) and isinstance(b, BN)
        }
        muon = dict(muon=True, lr=recipe.muon_lr, muon_momentum=recipe.muon_momentum, momentum=0.0, nesterov=False)
        groups += [
            {"params": [p for p in kernels if (id(p) in followed) == renormalize], "renormalize": renormalize, **muon}
            for renormalize in (True, False)
        ]
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
    warmup = round(recipe.warmup_epochs * steps_per_epoch)
    budget = recipe.epochs * steps_per_epoch

    def factor(step: int) -> float:
        if recipe.lr_schedule == "constant":
            return 1.0
        if step >= budget:  # extra epochs replay the budget's last one: lr 0 would train nothing
            step = budget - steps_per_epoch + (step - budget) % steps_per_epoch
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (budget - step) / max(1, budget - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_training(recipe: Recipe, raw_model: torch.nn.Module, global_batch_size: int, steps_per_epoch: int):
    """The optimizer, schedule, loss and EMA (None without ema_decay) of the recipe, for raw_model."""
    from .ema import build_ema

    optimizer = build_optimizer(raw_model, recipe, scaled_lr(recipe, global_batch_size))
    if recipe.compile_optimizer:
        compilable(optimizer)
    scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    if recipe.compile:  # the model: the entry point, over DDP
        criterion = torch.compile(criterion, mode=recipe.compile_mode)
    ema = build_ema(raw_model, recipe.ema_decay, recipe.ema_every) if recipe.ema_decay else None
    return optimizer, scheduler, criterion, ema


def compilable(optimizer: torch.optim.Optimizer) -> None:
    """Rates as tensors (the schedule fills them) and momentum buffers made now, at zero (the first step then
    computes what it would from none): a compiled step guards a float's value and a buffer's identity."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(group["lr"])
        for p in group["params"] if group["momentum"] or group.get("muon") else ():
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def build_step(optimizer, ema, raw_model: torch.nn.Module, compiled: bool):
    """The training step's optimizer.step() (Accelerate's wrapper in accel_train.py), then the EMA's update of
    raw_model where one is due (ema.py); `compiled` (recipe key compile_optimizer): the two one torch.compile'd
    function."""

    @torch.no_grad()
    def step(weight) -> None:
        optimizer.step()
        if weight is not None:
            ema.average(raw_model, weight)

    if not compiled:
        return lambda: step(None if ema is None else ema.due())
    step, held = torch.compile(step), torch.zeros(())  # the weight in a tensor: a float's value would be guarded

    def compiled_step() -> None:
        weight = None if ema is None else ema.due()
        step(None if weight is None else held.fill_(weight))

    return compiled_step
