"""Hyperparameters in one place: the Recipe dataclass, YAML recipe files, CLI overrides.

A recipe is a small commented YAML file in recipes/ (`--recipe baseline` or `--recipe path.yaml`).
Every key must be a field of Recipe (unknown keys are rejected, so a typo never passes silently);
keys a file leaves out keep the defaults below. Command-line flags and `--set KEY=VALUE` override
single keys after the file is read. Both entry points resolve the recipe the same way and write the
resolved values into their JSON log.
"""

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import yaml

from .errors import UserError
from .optim import MuonSGD

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(UserError):
    pass


@dataclass
class Recipe:
    # --- length and stopping
    epochs: int = 40  # maximum number of training epochs
    target_accuracy: float = 0.85  # validation accuracy (fraction) that counts as reached
    patience: int = 2  # stop after this many consecutive epochs at or above the target
    extra_epochs: int = 0  # safety net: when the budget `epochs` ends with the target still reachable
    # within this many more epochs (streak + extra >= patience), train on, each
    # extra epoch at the budget's last epoch's learning rates (0 = off)
    # --- batch and learning rate
    batch_size: int = 32  # images per process per step (per_device_batch_size)
    base_lr: float = 0.01  # learning rate at reference_batch_size images per step
    lr_scaling: str = "linear"  # linear: lr = base_lr * global_batch_size / reference_batch_size; none
    reference_batch_size: int = 32  # the global batch size at which base_lr was tuned
    lr_schedule: str = "constant"  # constant | warmup_linear (linear warmup, then linear decay to 0)
    warmup_epochs: float = 0.0  # epochs of linear warmup (warmup_linear only)
    anneal_epochs: float = 0.0  # warmup_linear: the decay reaches 0 after this many epochs, or at the end
    # of `epochs` if that comes first (0 = at the end); then lr 0
    residual_bn_init: float = 1.0  # initial gamma of each residual body's last BatchNorm (1 = PyTorch's)
    # --- optimizer and loss
    momentum: float = 0.0  # SGD momentum (0 = plain SGD)
    nesterov: bool = False  # Nesterov momentum (needs momentum > 0)
    weight_decay: float = 0.0  # L2 penalty on conv/linear weights (never on BatchNorm or biases)
    label_smoothing: float = 0.0  # CrossEntropyLoss label smoothing
    grad_clip_norm: float = 0.0  # clip the averaged gradient's global L2 norm to this (0 = off)
    bn_lr_scale: float = 1.0  # learning-rate multiplier for BatchNorm weights and all biases
    # (the parameters without weight decay); 1 = the same rate as the rest
    # --- numerics and data
    precision: str = "fp32"  # fp32 | bf16 (autocast; weights and optimizer stay fp32)
    channels_last: bool = False  # NHWC memory layout for the model and its inputs
    cudnn_benchmark: bool = False  # let cuDNN time its convolution algorithms once per shape (CUDA)
    data_pipeline: str = "dataloader"  # dataloader: per-image transforms in DataLoader workers;
    # device: whole uint8 dataset on the device, batched augmentation
    augment: bool = True  # random crop (crop_padding below) + horizontal flip for training
    crop_padding: int = 4  # pixels of zero padding around the random crop (augment only; 0 = flips only)
    num_workers: int = 4  # DataLoader worker processes per GPU process (CPU runs use 0)
    eval_batch_size: int = 500  # images per process per validation step
    seed: int = 0  # model init, sampler shuffling; augmentation uses seed + rank
    # --- optional, each measured in docs/optimizations.md (all off by default)
    ema_decay: float = 0.0  # evaluate an exponential moving average of the weights (0 = off)
    ddp_bucket_view: bool = False  # DDP gradient_as_bucket_view: gradients live in the all-reduce buckets
    ddp_static_graph: bool = False  # DDP static_graph: the same graph every step
    grad_compression: str = "none"  # none | bf16: all-reduce gradients in bf16 (DDP comm hook)
    sync_bn: bool = False  # SyncBatchNorm: batch statistics over all ranks (costs a collective per BN)
    compile: bool = False  # torch.compile the model (compile time counts in epoch 1)
    tta_flip: bool = False  # evaluation also sees flipped images (changes the metric: report apart)
    tta_translate: int = 0  # evaluation also sees each image shifted this many pixels both ways
    # (reflected edges; 0 = off; evaluation only, like tta_flip)
    bn_recalibration: int = 0  # training images (all ranks) whose batch statistics replace the evaluated
    # network's BatchNorm statistics before each validation (0 = off); in the clock;
    # equal whole batches per rank (data.recalibration_batches says how many)
    # --- structural levers of issue 25 (docs/optimizations.md, 14; all off by default)
    muon: bool = False  # Muon (orthogonalised Nesterov momentum) for the 4-D convolution kernels
    muon_lr: float = 0.24  # the kernels' peak rate with muon (absolute: not scaled by the batch size)
    muon_momentum: float = 0.6  # the kernels' momentum with muon (the other groups keep `momentum`)
    bn_bias_lr_scale: float = 1.0  # BatchNorm biases learn at lr * bn_lr_scale * this (1 = like the other biases)
    freeze_bn_scale: bool = False  # BatchNorm scales (gamma) stay at their initial value
    lookahead_steps: int = 0  # Lookahead: every this many steps pull slow weights toward the live ones (0 = off)
    lookahead_alpha: float = 0.5  # ... by this fraction, and restart the live weights from them
    alternating_flip: bool = False  # augment: each image mirrored in every other epoch instead of at random
    # (needs augment and data_pipeline: device)


CHOICES = {
    "lr_scaling": ("linear", "none"),
    "lr_schedule": ("constant", "warmup_linear"),
    "precision": ("fp32", "bf16"),
    "data_pipeline": ("dataloader", "device"),
    "grad_compression": ("none", "bf16"),
}
FIELDS = {f.name: f for f in fields(Recipe)}


def _coerce(key: str, value, source: str):
    if key not in FIELDS:
        raise RecipeError(f"{source}: unknown recipe key '{key}'; known keys: {', '.join(FIELDS)}")
    kind = FIELDS[key].type
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
    }[kind]
    if not ok:
        raise RecipeError(f"{source}: '{key}' must be {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return RECIPE_DIR / f"{name_or_path}.yaml"


def load_recipe(name_or_path: str = "baseline", overrides: dict | None = None) -> Recipe:
    """Read a recipe file, apply overrides (already typed values or strings from --set), validate."""
    path = recipe_path(name_or_path)
    if not path.is_file():
        known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
        raise RecipeError(f"recipe '{name_or_path}' not found (looked for {path}); known recipes: {', '.join(known)}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8); a recipe is a YAML file of key: value lines"
        ) from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of key: value lines")
    values = {key: _coerce(key, value, str(path)) for key, value in raw.items()}
    for key, value in (overrides or {}).items():
        if isinstance(value, str) and FIELDS.get(key) is not None and FIELDS[key].type is not str:
            value = yaml.safe_load(value)  # "--set momentum=0.9" arrives as a string
        values[key] = _coerce(key, value, "command line")
    recipe = Recipe(**values)
    check_recipe(recipe)
    return recipe


def parse_set(items: list[str]) -> dict:
    """['key=value', ...] from --set into a dict (values still strings)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def check_recipe(r: Recipe) -> None:
    problems = []
    for key in ("epochs", "batch_size", "patience", "reference_batch_size", "eval_batch_size"):
        if getattr(r, key) < 1:
            problems.append(f"{key} must be >= 1 (got {getattr(r, key)})")
    if not r.base_lr > 0 or not math.isfinite(r.base_lr):
        problems.append(f"base_lr must be a positive number (got {r.base_lr})")
    if not 0.0 <= r.target_accuracy <= 1.0:
        problems.append(f"target_accuracy is a fraction between 0 and 1 (got {r.target_accuracy})")
    for key in ("weight_decay", "warmup_epochs", "grad_clip_norm", "anneal_epochs", "extra_epochs"):
        if getattr(r, key) < 0:
            problems.append(f"{key} must be >= 0 (got {getattr(r, key)})")
    # momentum 1 never forgets a gradient (the steps grow without bound); label_smoothing 1 leaves no label
    for key in ("momentum", "label_smoothing"):
        if not 0.0 <= getattr(r, key) < 1.0:
            problems.append(f"{key} must be in [0, 1) (got {getattr(r, key)})")
    if r.lr_schedule == "warmup_linear" and r.warmup_epochs > r.epochs:
        problems.append(
            f"warmup_epochs {r.warmup_epochs:g} is longer than epochs {r.epochs}: the learning rate "
            f"would still be rising when training ends, at {r.epochs / r.warmup_epochs:.0%} of its peak, "
            f"and never decay; lower warmup_epochs or raise epochs"
        )
    if r.lr_schedule == "warmup_linear" and 0 < r.anneal_epochs <= r.warmup_epochs:
        problems.append(
            f"anneal_epochs {r.anneal_epochs:g} must be longer than warmup_epochs {r.warmup_epochs:g}: "
            f"the decay starts where the warmup ends"
        )
    if not 0 < r.residual_bn_init <= 1:
        problems.append(
            f"residual_bn_init must be in (0, 1] (got {r.residual_bn_init:g}; 0 never trains: the body ends BN -> ReLU)"
        )
    if r.nesterov and r.momentum == 0:
        problems.append("nesterov needs momentum > 0")
    if not 0.0 <= r.ema_decay < 1.0:
        problems.append(f"ema_decay must be in [0, 1) (got {r.ema_decay})")
    if not r.bn_lr_scale > 0 or not math.isfinite(r.bn_lr_scale):
        problems.append(f"bn_lr_scale must be a positive number (got {r.bn_lr_scale})")
    if not 0 <= r.crop_padding <= 16:
        problems.append(f"crop_padding must be in 0..16 pixels (got {r.crop_padding}; 0 = flips only)")
    if r.bn_recalibration < 0:
        problems.append(f"bn_recalibration is a number of training images, >= 0 (got {r.bn_recalibration}; 0 = off)")
    if not 0 <= r.tta_translate <= 8:
        problems.append(f"tta_translate must be in 0..8 pixels (got {r.tta_translate}; 0 = off)")
    if not r.muon_lr > 0 or not math.isfinite(r.muon_lr):
        problems.append(f"muon_lr must be a positive number (got {r.muon_lr})")
    if not 0.0 <= r.muon_momentum < 1.0:
        problems.append(f"muon_momentum must be in [0, 1) (got {r.muon_momentum})")
    if not r.bn_bias_lr_scale > 0 or not math.isfinite(r.bn_bias_lr_scale):
        problems.append(f"bn_bias_lr_scale must be a positive number (got {r.bn_bias_lr_scale})")
    if r.lookahead_steps < 0:
        problems.append(f"lookahead_steps must be >= 0 (got {r.lookahead_steps}; 0 = off)")
    if not 0.0 < r.lookahead_alpha <= 1.0:
        problems.append(f"lookahead_alpha must be in (0, 1] (got {r.lookahead_alpha})")
    if r.alternating_flip and not (r.augment and r.data_pipeline == "device"):
        problems.append(
            "alternating_flip needs augment: true and data_pipeline: device (the per-image pipeline's "
            "workers never see the epoch)"
        )
    if r.num_workers < 0:
        problems.append(f"num_workers must be >= 0 (got {r.num_workers})")
    for key, allowed in CHOICES.items():
        if getattr(r, key) not in allowed:
            problems.append(f"{key} must be one of {', '.join(allowed)} (got {getattr(r, key)!r})")
    if problems:
        raise RecipeError("invalid recipe: " + "; ".join(problems))


def as_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def slow_bf16_warning(device_type: str, precision: str) -> str | None:
    """The warning for bf16 autocast on a CPU whose oneDNN has no bfloat16 kernels, where every convolution
    takes a slow path (docs/benchmarks.md): without it a CPU run of fast.yaml would crawl without a word."""
    if device_type != "cpu" or precision != "bf16" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (
        "warning: precision bf16 on a CPU without bfloat16 kernels (oneDNN found no AVX-512): each training "
        "step runs many times slower than in fp32; for a CPU run add --set precision=fp32 (a different "
        "recipe: its numbers are not the shipped recipe's)"
    )


# ----------------------------------------------------------------------------- optimisation


def scaled_lr(recipe: Recipe, global_batch_size: int) -> float:
    """Linear scaling rule: k times more images per step take a k times larger step, so the
    learning per epoch stays about the same when processes are added (Goyal et al., 2017)."""
    if recipe.lr_scaling == "linear":
        return recipe.base_lr * global_batch_size / recipe.reference_batch_size
    return recipe.base_lr


def build_optimizer(model: torch.nn.Module, recipe: Recipe, lr: float) -> torch.optim.Optimizer:
    """SGD; weight decay only on conv/linear weights (decaying BatchNorm scales and biases only
    fights the normalisation and does not regularise); those scales and biases learn at `lr` times
    bn_lr_scale (the schedule multiplies each group's own rate). The levers of docs/optimizations.md 14
    take their parameters out of these two groups into groups of their own (lever_groups), and muon or
    lookahead_steps make it cifar_wrn.optim.MuonSGD; at their defaults it is SGD with the two groups."""
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
    return torch.optim.SGD(groups, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov)


def lever_groups(model: torch.nn.Module, recipe: Recipe, lr: float) -> list[dict]:
    """The parameter groups of the levers that are on (none by default): Muon's convolution kernels (those a
    BatchNorm directly follows renormalised, the rest not), the BatchNorm biases at bn_bias_lr_scale, the
    BatchNorm scales frozen (rate 0, no decay: they never move)."""
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
    """Per-step learning-rate multiplier: constant, or linear warmup then linear decay to zero at the
    last step of the epoch budget (so the budget `epochs` is part of the recipe, not a guess), or earlier,
    after `anneal_epochs`: the epochs after it train at lr 0, which makes the one before the last
    (the first of the two the stopping rule needs) already an annealed model (docs/optimizations.md, 6c).
    Past the budget (only the safety net's extra_epochs go there) every epoch replays the budget's last
    epoch: with linear decay, from the rate that epoch began at down to where it ended (0 at the end of the
    budget; lr 0 would train nothing), so each extra epoch ends annealed, like the last one of the budget."""
    end = min(recipe.anneal_epochs, recipe.epochs) if recipe.anneal_epochs > 0 else recipe.epochs
    total = round(end * steps_per_epoch)
    warmup = round(recipe.warmup_epochs * steps_per_epoch)
    budget = recipe.epochs * steps_per_epoch

    def factor(step: int) -> float:
        if recipe.lr_schedule == "constant":
            return 1.0
        if step >= budget:  # a safety-net epoch: the step of the budget's last epoch at the same position
            step = budget - steps_per_epoch + (step - budget) % steps_per_epoch
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_training(raw_model: torch.nn.Module, recipe: Recipe, global_batch_size: int, steps_per_epoch: int):
    """(lr, optimizer, scheduler, criterion) of a run: the linearly scaled rate, SGD, the per-step
    schedule, and the loss (cross-entropy with the recipe's label smoothing)."""
    lr = scaled_lr(recipe, global_batch_size)
    optimizer = build_optimizer(raw_model, recipe, lr)
    scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
    return lr, optimizer, scheduler, torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
