"""Hyperparameters: the Recipe, YAML recipes in cifar_wrn/recipes/, and --set overrides."""

import contextlib
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

import torch
import yaml

from .errors import UserError

RECIPE_DIR = resources.files(__package__) / "recipes"
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # SGD's step overflows on a learning rate or decay beyond it


class RecipeError(UserError):
    pass


@dataclass
class Recipe:
    # --- length and stopping
    epochs: int = 40
    target_accuracy: float = 0.85  # validation accuracy
    patience: int = 2  # epochs in a row at target to stop
    extra_epochs: int = 0  # more epochs while the target is reachable
    # --- batch and learning rate
    batch_size: int = 32  # images per process per step
    base_lr: float = 0.01
    lr_scaling: str = "linear"  # or none
    reference_batch_size: int = 32  # global batch of base_lr
    lr_schedule: str = "constant"  # warmup_linear decays to 0
    warmup_epochs: float = 0.0
    # --- optimizer and loss
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0  # conv/linear weights only
    label_smoothing: float = 0.0
    grad_clip_norm: float = 0.0  # max global gradient norm
    bn_lr_scale: float = 1.0  # lr multiplier for BN parameters
    bn_bias_lr_scale: float = 1.0  # extra lr multiplier for BN biases
    freeze_bn_scale: bool = False  # BN gammas stay at their initial value
    muon: bool = False  # Muon for the 4-D conv kernels
    muon_lr: float = 0.24  # kernels' lr with muon (not batch-scaled)
    muon_momentum: float = 0.6  # kernels' momentum with muon
    # --- numerics and data
    precision: str = "fp32"  # bf16: autocast
    channels_last: bool = False
    cudnn_benchmark: bool = False
    startup_steps: int = 0  # synthetic steps before the clock, undone after
    data_pipeline: str = "dataloader"  # device: the dataset on the device
    augment: bool = True
    augmentation: str = "crop_flip"  # course: its transform_train
    normalization: str = "cifar"  # cifar: its mean/std; course: 0.5, 0.5
    num_workers: int = 4
    eval_batch_size: int = 500  # per process
    seed: int = 0  # + rank for augmentation
    # --- levers, 0 = off
    ema_decay: float = 0.0  # evaluate an EMA of the weights
    ema_every: int = 1  # steps between EMA updates, at decay**ema_every
    ddp_bucket_view: bool = False
    ddp_broadcast_buffers: bool = True
    ddp_bucket_cap_mb: float = 25.0
    ddp_static_graph: bool = False
    grad_compression: str = "none"
    sync_bn: bool = False
    compile: bool = False  # the DDP model and the loss
    compile_mode: str = "default"  # torch.compile's mode
    compile_optimizer: bool = False  # optimizer step + EMA, one compiled function
    prefetch_indices: bool = False  # an epoch's batch indices on the device before its clock

    tta_flip: bool = False  # changes the metric
    bn_recalibration: int = 0  # images to re-estimate BN stats

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @property
    def ddp_options(self) -> dict:
        """DistributedDataParallel's keyword arguments (Accelerate's DistributedDataParallelKwargs take the same);
        broadcast_buffers only when off: torch 2.14 warns of the name (forward_sync_buffers, which 2.7 lacks)."""
        options = dict(gradient_as_bucket_view=self.ddp_bucket_view, static_graph=self.ddp_static_graph)
        return dict(
            options,
            bucket_cap_mb=self.ddp_bucket_cap_mb,
            **({} if self.ddp_broadcast_buffers else {"broadcast_buffers": False}),
        )


CHOICES = dict(
    lr_scaling=("linear", "none"),
    lr_schedule=("constant", "warmup_linear"),
    precision=("fp32", "bf16"),
    data_pipeline=("dataloader", "device"),
    grad_compression=("none", "bf16"),
    augmentation=("crop_flip", "course"),
    normalization=("cifar", "course"),
    compile_mode=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
)
FIELDS = {f.name: f for f in fields(Recipe)}


class StrictLoader(yaml.SafeLoader):
    """SafeLoader keeps the last of a key written twice (a merge key, <<, writes them twice too)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, value_node in node.value if isinstance(node, yaml.MappingNode) else []:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.YAMLError(f"line {key_node.start_mark.line + 1}: a merge key (<<): write each key itself")
            key = (key_node.tag, key_node.value)
            if key in seen:
                twice = f"({_where(seen[key])}; {_where(value_node)})"
                raise yaml.YAMLError(f"key '{key_node.value}' is written twice {twice}: write each key once")
            seen[key] = value_node
        return super().construct_mapping(node, deep)


def _where(node) -> str:
    return f"line {node.start_mark.line + 1}: {node.value if isinstance(node, yaml.ScalarNode) else '...'}"


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line, where and what (YAML's own text spans lines and names "<unicode string>", not the file)."""
    mark, what = getattr(exc, "problem_mark", None), getattr(exc, "problem", None) or str(exc)
    return (f"line {mark.line + 1}, column {mark.column + 1}: " if mark else "") + " ".join(what.split())


def _coerce(key: str, value, source: str):
    if key not in FIELDS:
        raise RecipeError(f"{source}: unknown recipe key '{key}'; known keys: {', '.join(FIELDS)}")
    kind = FIELDS[key].type
    if kind is float and isinstance(value, str):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 5e-4 and nan as strings
            value = float(value)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
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


def load_recipe(name_or_path: str = "baseline", overrides: dict | None = None) -> Recipe:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        path = RECIPE_DIR / f"{name_or_path}.yaml"  # a shipped recipe
    if not path.is_file():
        known = sorted(p.name.removesuffix(".yaml") for p in RECIPE_DIR.iterdir() if p.name.endswith(".yaml"))
        raise RecipeError(f"recipe '{name_or_path}' not found (looked for {path}); known recipes: {', '.join(known)}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader) or {}
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not a text file (byte {exc.start} is not UTF-8)") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of key: value lines")
    values = {key: _coerce(key, value, str(path)) for key, value in raw.items()}
    for key, value in (overrides or {}).items():
        if isinstance(value, str) and key in FIELDS and FIELDS[key].type is not str:  # from --set
            with contextlib.suppress(yaml.YAMLError):
                value = yaml.load(value, Loader=StrictLoader)
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


def check_recipe(r: Recipe):
    """Ranges only: _coerce refused the values that are not finite."""
    problems = []

    def need(keys, ok, what: str):
        problems.extend(f"{k} {what} (got {getattr(r, k)!r})" for k in keys.split() if not ok(getattr(r, k)))

    need("epochs batch_size patience reference_batch_size eval_batch_size ema_every", lambda v: v >= 1, "must be >= 1")
    need("base_lr bn_lr_scale bn_bias_lr_scale muon_lr ddp_bucket_cap_mb", lambda v: v > 0, "must be a positive number")
    need("target_accuracy", lambda v: 0 <= v <= 1, "is a fraction between 0 and 1")
    zero_up = "weight_decay warmup_epochs grad_clip_norm extra_epochs startup_steps bn_recalibration num_workers"
    need(zero_up, lambda v: v >= 0, "must be >= 0")
    need("momentum label_smoothing ema_decay muon_momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
    need("weight_decay", lambda v: v <= FLOAT32_MAX, f"must be at most {FLOAT32_MAX:.2g}, the largest float32")
    need("seed", lambda v: 0 <= v < 2**63, "must be in [0, 2**63)")  # torch's are 64-bit: seed + rank, + epoch
    if r.lr_schedule == "warmup_linear" and r.warmup_epochs > r.epochs:
        problems.append(
            f"warmup_epochs {r.warmup_epochs:g} is longer than epochs {r.epochs}: the learning rate "
            f"would still be rising when training ends, at {r.epochs / r.warmup_epochs:.0%} of its peak"
        )
    if r.nesterov and r.momentum == 0:
        problems.append("nesterov needs momentum > 0")
    if r.augment and r.augmentation == "course" and r.data_pipeline == "device":
        problems.append(
            "augmentation: course runs in the DataLoader's workers: use data_pipeline: dataloader, or "
            "augmentation: crop_flip"
        )
    for key, allowed in CHOICES.items():
        need(key, allowed.__contains__, f"must be one of {', '.join(allowed)}")
    if problems:
        raise RecipeError("invalid recipe: " + "; ".join(problems))


as_dict = asdict  # a Recipe as {key: value}


def slow_bf16_warning(device_type: str, precision: str) -> str | None:
    if device_type != "cpu" or precision != "bf16" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (
        "warning: precision bf16 on a CPU without bfloat16 kernels (oneDNN found no AVX-512): each step runs "
        "many times slower than in fp32; add --set precision=fp32 (a different recipe)"
    )
