"""Hyperparameters: the Recipe dataclass, YAML recipes in cifar_wrn/recipes/, and --set overrides."""

import dataclasses
import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

import torch
import yaml

from .errors import UserError

# Package data (pyproject.toml), so that an installed package finds them without the checkout; the checkout's
# top-level recipes/ is a link to this folder.
RECIPE_DIR = resources.files(__package__) / "recipes"


class RecipeError(UserError):
    pass


@dataclass
class Recipe:
    # --- length and stopping
    epochs: int = 40  # epoch budget
    target_accuracy: float = 0.85  # validation accuracy (fraction)
    patience: int = 2  # consecutive epochs at target to stop
    extra_epochs: int = 0  # more epochs if the target is still reachable (0 = off)
    # --- batch and learning rate
    batch_size: int = 32  # images per process per step
    base_lr: float = 0.01  # lr at reference_batch_size
    lr_scaling: str = "linear"  # linear (lr x global batch / reference) | none
    reference_batch_size: int = 32  # global batch at which base_lr was tuned
    lr_schedule: str = "constant"  # constant | warmup_linear (linear decay to 0)
    warmup_epochs: float = 0.0  # epochs of warmup
    # --- optimizer and loss
    momentum: float = 0.0  # SGD momentum
    nesterov: bool = False
    weight_decay: float = 0.0  # L2 on conv/linear weights only
    label_smoothing: float = 0.0
    grad_clip_norm: float = 0.0  # max global gradient L2 norm (0 = off)
    bn_lr_scale: float = 1.0  # lr multiplier for BN weights and biases
    # --- numerics and data
    precision: str = "fp32"  # fp32 | bf16 (autocast; fp32 weights)
    channels_last: bool = False  # NHWC layout
    cudnn_benchmark: bool = False
    startup_steps: int = 0  # steps on synthetic batches before the clock, all undone after (0 = off)
    data_pipeline: str = "dataloader"  # dataloader | device (whole dataset on device)
    augment: bool = True  # augment the training images (as `augmentation` says)
    augmentation: str = "crop_flip"  # crop_flip (random crop + flip) | course (the course script's transform_train)
    normalization: str = "cifar"  # cifar (CIFAR-10 mean/std) | course (Normalize 0.5, 0.5)
    num_workers: int = 4  # DataLoader workers per process
    eval_batch_size: int = 500  # images per process per validation step
    seed: int = 0  # augmentation uses seed + rank
    # --- levers, off by default
    ema_decay: float = 0.0  # evaluate an EMA of the weights (0 = off)
    ddp_bucket_view: bool = False  # DDP gradient_as_bucket_view
    ddp_static_graph: bool = False
    grad_compression: str = "none"  # none | bf16 all-reduce
    sync_bn: bool = False
    compile: bool = False
    tta_flip: bool = False  # also evaluate flips (changes the metric)
    bn_recalibration: int = 0  # images to re-estimate BN stats before eval (0 = off)


# Keys that left the code with what used them (docs/optimizations.md, "Where the code went"), at the values that
# left training as it is without them: older logs and checkpoints carry them.
RETIRED = {
    "anneal_epochs": 0.0,
    "residual_bn_init": 1.0,
    "crop_padding": 4,
    "tta_translate": 0,
    "muon": False,
    "muon_lr": 0.24,
    "muon_momentum": 0.6,
    "bn_bias_lr_scale": 1.0,
    "freeze_bn_scale": False,
    "lookahead_steps": 0,
    "lookahead_alpha": 0.5,
    "alternating_flip": False,
}

CHOICES = {
    "lr_scaling": ("linear", "none"),
    "lr_schedule": ("constant", "warmup_linear"),
    "precision": ("fp32", "bf16"),
    "data_pipeline": ("dataloader", "device"),
    "grad_compression": ("none", "bf16"),
    "augmentation": ("crop_flip", "course"),
    "normalization": ("cifar", "course"),
}
FIELDS = {f.name: f for f in fields(Recipe)}
FLOAT_KEYS = tuple(name for name, f in FIELDS.items() if f.type is float)


class DuplicateKeyError(yaml.YAMLError):
    """A key written twice in one mapping of a YAML file."""

    def __init__(self, key, first, second):
        super().__init__(f"key {key!r} written twice")
        self.key, self.first, self.second = key, first, second


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader, but a key written twice in one mapping is an error (SafeLoader keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, value_node in node.value if isinstance(node, yaml.MappingNode) else []:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise DuplicateKeyError(key_node.value, seen[key], value_node)
            seen[key] = value_node
        return super().construct_mapping(node, deep)


def _where(node) -> str:
    shown = node.value if isinstance(node, yaml.ScalarNode) else "..."
    return f"line {node.start_mark.line + 1}: {shown}"


def _float(value):
    """`value` as a float, if it is one: YAML 1.1 reads 5e-4 (no dot) and nan (no leading dot) as strings."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _coerce(key: str, value, source: str):
    if key not in FIELDS:
        raise RecipeError(f"{source}: unknown recipe key '{key}'; known keys: {', '.join(FIELDS)}")
    kind = FIELDS[key].type
    if kind is float:
        value = _float(value)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
    }[kind]
    if not ok:
        raise RecipeError(f"{source}: '{key}' must be {kind.__name__}, got {value!r}")
    if kind is not float:
        return value
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise RecipeError(f"{source}: '{key}' must be a finite number, got {value}")
    return number


def known_recipes() -> list[str]:
    """The names of the recipes shipped in the package."""
    return sorted(p.name.removesuffix(".yaml") for p in RECIPE_DIR.iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str):
    """A YAML path as given, else the shipped recipe of that name (a pathlib.Path, or a Traversable where the
    package is not in a folder)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    return RECIPE_DIR / f"{name_or_path}.yaml"


def load_recipe(name_or_path: str = "baseline", overrides: dict | None = None) -> Recipe:
    path = recipe_path(name_or_path)
    if not path.is_file():
        raise RecipeError(
            f"recipe '{name_or_path}' not found (looked for {path}); known recipes: {', '.join(known_recipes())}"
        )
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8); a recipe is a YAML file of key: value lines"
        ) from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except DuplicateKeyError as exc:
        raise RecipeError(
            f"{path}: key '{exc.key}' is written twice ({_where(exc.first)}; {_where(exc.second)}): write each key once"
        ) from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of key: value lines")
    values = {key: _coerce(key, value, str(path)) for key, value in raw.items()}
    for key, value in (overrides or {}).items():
        if isinstance(value, str) and FIELDS.get(key) is not None and FIELDS[key].type is not str:
            try:
                value = yaml.load(value, Loader=StrictLoader)  # "--set momentum=0.9" arrives as a string
            except yaml.YAMLError:
                pass  # not YAML: _coerce names the key and the string as given
        values[key] = _coerce(key, value, "command line")
    recipe = Recipe(**values)
    check_recipe(recipe)
    return recipe


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def check_recipe(r: Recipe) -> None:
    not_finite = [
        f"{key} must be a finite number (got {getattr(r, key)})"
        for key in FLOAT_KEYS
        if not math.isfinite(getattr(r, key))
    ]
    if not_finite:  # before the range checks, which a NaN passes
        raise RecipeError("invalid recipe: " + "; ".join(not_finite))
    problems = []
    for key in ("epochs", "batch_size", "patience", "reference_batch_size", "eval_batch_size"):
        if getattr(r, key) < 1:
            problems.append(f"{key} must be >= 1 (got {getattr(r, key)})")
    if not r.base_lr > 0 or not math.isfinite(r.base_lr):
        problems.append(f"base_lr must be a positive number (got {r.base_lr})")
    if not 0.0 <= r.target_accuracy <= 1.0:
        problems.append(f"target_accuracy is a fraction between 0 and 1 (got {r.target_accuracy})")
    for key in ("weight_decay", "warmup_epochs", "grad_clip_norm", "extra_epochs"):
        if getattr(r, key) < 0:
            problems.append(f"{key} must be >= 0 (got {getattr(r, key)})")
    for key in ("momentum", "label_smoothing"):
        if not 0.0 <= getattr(r, key) < 1.0:
            problems.append(f"{key} must be in [0, 1) (got {getattr(r, key)})")
    if r.lr_schedule == "warmup_linear" and r.warmup_epochs > r.epochs:
        problems.append(
            f"warmup_epochs {r.warmup_epochs:g} is longer than epochs {r.epochs}: the learning rate "
            f"would still be rising when training ends, at {r.epochs / r.warmup_epochs:.0%} of its peak, "
            f"and never decay; lower warmup_epochs or raise epochs"
        )
    if r.nesterov and r.momentum == 0:
        problems.append("nesterov needs momentum > 0")
    if not 0.0 <= r.ema_decay < 1.0:
        problems.append(f"ema_decay must be in [0, 1) (got {r.ema_decay})")
    if not r.bn_lr_scale > 0 or not math.isfinite(r.bn_lr_scale):
        problems.append(f"bn_lr_scale must be a positive number (got {r.bn_lr_scale})")
    if r.startup_steps < 0:
        problems.append(f"startup_steps is a number of warm-up steps, >= 0 (got {r.startup_steps}; 0 = off)")
    if r.bn_recalibration < 0:
        problems.append(f"bn_recalibration is a number of training images, >= 0 (got {r.bn_recalibration}; 0 = off)")
    if r.augment and r.augmentation == "course" and r.data_pipeline == "device":
        problems.append(
            "augmentation: course (rotation, affine, colour jitter per image) runs in the DataLoader's workers: "
            "use data_pipeline: dataloader, or augmentation: crop_flip with the device pipeline"
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


def autocast_options(recipe: Recipe, device) -> dict:
    """torch.autocast's arguments for the recipe's precision: bfloat16 for bf16, else off."""
    return dict(device_type=device.type, dtype=torch.bfloat16, enabled=recipe.precision == "bf16")


def memory_format(recipe: Recipe) -> torch.memory_format:
    return torch.channels_last if recipe.channels_last else torch.contiguous_format


def slow_bf16_warning(device_type: str, precision: str) -> str | None:
    """Without oneDNN bf16 kernels every bf16 convolution takes a slow path."""
    if device_type != "cpu" or precision != "bf16" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (
        "warning: precision bf16 on a CPU without bfloat16 kernels (oneDNN found no AVX-512): each training "
        "step runs many times slower than in fp32; for a CPU run add --set precision=fp32 (a different "
        "recipe: its numbers are not the shipped recipe's)"
    )
