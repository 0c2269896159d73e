"""The optimizer and learning-rate schedule a recipe asks for."""

import torch

from .recipe import Recipe


def scaled_lr(recipe: Recipe, global_batch_size: int) -> float:
    """Linear scaling rule (Goyal et al., 2017)."""
    linear = recipe.lr_scaling == "linear"
    return recipe.base_lr * global_batch_size / recipe.reference_batch_size if linear else recipe.base_lr


def build_optimizer(
    model: torch.nn.Module, recipe: Recipe, lr: float, fused: bool | None = None
) -> torch.optim.Optimizer:
    """No weight decay on BN scales and biases: it only fights the normalisation. `fused`: default on a GPU."""
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.ndim > 1], "weight_decay": recipe.weight_decay},
        {"params": [p for p in trained if p.ndim <= 1], "weight_decay": 0.0, "lr": lr * recipe.bn_lr_scale},
    ]
    fused = next(model.parameters()).device.type == "cuda" if fused is None else fused
    return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov, fused=fused or None)


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


def build_training(run):
    """The learning rate, optimizer, schedule, loss and EMA of `run`'s recipe, for its raw_model."""
    from .ema import build_ema

    recipe = run.recipe
    lr = scaled_lr(recipe, run.global_batch_size)
    optimizer = build_optimizer(run.raw_model, recipe, lr)
    scheduler = build_scheduler(optimizer, recipe, run.data.steps_per_epoch)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    ema = build_ema(run.raw_model, recipe.ema_decay) if recipe.ema_decay else None
    return lr, optimizer, scheduler, criterion, ema
