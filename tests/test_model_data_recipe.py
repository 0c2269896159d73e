"""Pure, single-process tests: the model, data loading and validation, recipes."""

import ast
import importlib
import pickle
import re
from dataclasses import fields, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import REPO, TRAIN_IMAGES, VAL_IMAGES, write_cifar
from torch.utils.data import DistributedSampler

from cifar_wrn.accel_side import AccelProcess, resolve_accel_launch
from cifar_wrn.cifar_files import DataError, load_split
from cifar_wrn.datasets import CIFAR10, DeviceBatches
from cifar_wrn.evaluation import evaluate, real_sample_mask, tta_logits
from cifar_wrn.model import WideResNet, count_parameters
from cifar_wrn.optim import build_optimizer, build_scheduler, scaled_lr
from cifar_wrn.raw_side import resolve_raw_launch
from cifar_wrn.recipe import Recipe, RecipeError, load_recipe, parse_set, slow_bf16_warning
from cifar_wrn.run import Process

# ----------------------------------------------------------------------------- model


def test_default_model_is_the_course_network():
    model = WideResNet()
    assert count_parameters(model) == 17_117_754  # the course script's WideResNet, counted there
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_model_structure():
    model = WideResNet(width=4)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    shortcuts = [m for m in convs if m.kernel_size == (1, 1)]
    assert len(convs) == 1 + 6 * 2 + 3 and len(shortcuts) == 3  # input block, 2 per block, 3 width changes
    assert all(m.bias is not None for m in shortcuts) and all(m.bias is None for m in convs if m not in shortcuts)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.01] * 6
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in model.modules()) == 2


# The course script's classes, written out from its text (the reference the model must equal).
class SpecCbr(torch.nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.cbr = torch.nn.Sequential(
            torch.nn.Conv2d(i, o, kernel_size=3, stride=(1, 1), padding="same", bias=False),
            torch.nn.BatchNorm2d(o),
            torch.nn.ReLU(),
        )

    def forward(self, x):
        return self.cbr(x)


class SpecBlock(torch.nn.Module):
    def __init__(self, i, o, scale_input):
        super().__init__()
        self.scale_input = scale_input
        if scale_input:
            self.scale = torch.nn.Conv2d(i, o, kernel_size=1, stride=(1, 1), padding="same")
        self.layer1 = SpecCbr(i, o)
        self.dropout = torch.nn.Dropout(p=0.01)
        self.layer2 = SpecCbr(o, o)

    def forward(self, x):
        out = self.layer2(self.dropout(self.layer1(x)))
        return out + (self.scale(x) if self.scale_input else x)


class SpecWideResNet(torch.nn.Module):
    def __init__(self, num_classes, c=(3, 16, 160, 320, 640)):
        super().__init__()
        self.input_block = SpecCbr(c[0], c[1])
        self.block1 = SpecBlock(c[1], c[2], 1)
        self.block2 = SpecBlock(c[2], c[2], 0)
        self.pool1 = torch.nn.MaxPool2d(2)
        self.block3 = SpecBlock(c[2], c[3], 1)
        self.block4 = SpecBlock(c[3], c[3], 0)
        self.pool2 = torch.nn.MaxPool2d(2)
        self.block5 = SpecBlock(c[3], c[4], 1)
        self.block6 = SpecBlock(c[4], c[4], 0)
        self.pool = torch.nn.AvgPool2d(7)
        self.flat = torch.nn.Flatten()
        self.fc = torch.nn.Linear(c[4], num_classes)

    def forward(self, x):
        out = self.input_block(x)
        for layer in (self.block1, self.block2, self.pool1, self.block3, self.block4, self.pool2):
            out = layer(out)
        for layer in (self.block5, self.block6, self.pool, self.flat, self.fc):
            out = layer(out)
        return out


def bn_keys(prefix, channels):
    return [(f"{prefix}.{name}", [channels]) for name in ("weight", "bias", "running_mean", "running_var")] + [
        (f"{prefix}.num_batches_tracked", [])
    ]


# The course's state_dict, key by key, in creation order (block, input channels, output channels, scale_input).
COURSE_BLOCKS = [("block1", 16, 160, 1), ("block2", 160, 160, 0), ("block3", 160, 320, 1)]
COURSE_BLOCKS += [("block4", 320, 320, 0), ("block5", 320, 640, 1), ("block6", 640, 640, 0)]
COURSE_KEYS = [("input_block.cbr.0.weight", [16, 3, 3, 3])] + bn_keys("input_block.cbr.1", 16)
for _name, _in, _out, _scale in COURSE_BLOCKS:
    if _scale:
        COURSE_KEYS += [(f"{_name}.scale.weight", [_out, _in, 1, 1]), (f"{_name}.scale.bias", [_out])]
    COURSE_KEYS += [(f"{_name}.layer1.cbr.0.weight", [_out, _in, 3, 3])] + bn_keys(f"{_name}.layer1.cbr.1", _out)
    COURSE_KEYS += [(f"{_name}.layer2.cbr.0.weight", [_out, _out, 3, 3])] + bn_keys(f"{_name}.layer2.cbr.1", _out)
COURSE_KEYS += [("fc.weight", [10, 640]), ("fc.bias", [10])]


def test_the_state_dict_is_the_courses_key_for_key():
    state = WideResNet().state_dict()
    assert [(k, list(v.shape)) for k, v in state.items()] == COURSE_KEYS
    assert len(COURSE_KEYS) == 1 + 5 + 6 * 12 + 3 * 2 + 2


def test_same_seed_same_weights_and_outputs_as_the_course_script():
    torch.manual_seed(3)
    ours = WideResNet(num_classes=10)
    torch.manual_seed(3)
    spec = SpecWideResNet(10)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), spec.state_dict().values()))
    spec.load_state_dict(ours.state_dict())  # the same keys: a course state_dict loads, and ours into theirs
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours.eval()(images), spec.eval()(images))


def test_the_head_averages_the_top_left_7x7_window_as_the_course_does():
    """AvgPool2d(7) on the 8x8 map: the last row and column do not reach the classifier."""
    model = WideResNet(width=4).eval()
    features = torch.randn(1, 16, 8, 8)
    changed = features.clone()
    changed[..., 7, :] += 5.0
    changed[..., :, 7] -= 3.0
    head = lambda x: model.fc(model.flat(model.pool(x)))
    with torch.no_grad():
        assert torch.equal(head(features), head(changed))
        assert torch.allclose(model.pool(features).flatten(), features[..., :7, :7].mean((2, 3)).flatten(), atol=1e-6)


# ----------------------------------------------------------------------------- data


def test_load_split_reads_official_layout(cifar_dir):
    images, labels = load_split(cifar_dir, train=True, subset=TRAIN_IMAGES)
    assert images.shape == (TRAIN_IMAGES, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() <= 9
    images, labels = load_split(cifar_dir, train=False, subset=7)
    assert images.shape == (7, 3, 32, 32) and len(labels) == 7
    # rows are CHW-planar: the first 1024 bytes of a row are the red plane
    with open(cifar_dir / "cifar-10-batches-py" / "test_batch", "rb") as f:
        row = pickle.load(f)["data"][0]
    assert torch.equal(images[0, 0].flatten(), torch.from_numpy(row[:1024].copy()))


def test_full_size_is_required_without_subset(cifar_dir):
    with pytest.raises(DataError, match="expected 50000"):
        load_split(cifar_dir, train=True)
    with pytest.raises(DataError, match="val-subset 500: must be between 1 and 101"):
        load_split(cifar_dir, train=False, subset=500)


def test_missing_folder_says_how_to_provide(tmp_path):
    with pytest.raises(DataError, match="extract the official cifar-10-python.tar.gz into") as err:
        load_split(tmp_path, train=True, subset=1)
    assert str(tmp_path) in str(err.value) and "CIFAR10_URL" in str(err.value)
    assert "shared/" not in str(err.value) and "prepare_cifar10" not in str(err.value)  # nothing a user lacks


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:1000]), "truncated or corrupt"),
        (
            lambda p: pickle.dump({"data": np.zeros((4, 3072), np.float32), "labels": [0] * 4}, open(p, "wb")),
            "must be uint8",
        ),
        (
            lambda p: pickle.dump({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1, 2, 10]}, open(p, "wb")),
            "labels must be 0-9",
        ),
        (
            lambda p: pickle.dump({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1]}, open(p, "wb")),
            "4 images but 2 labels",
        ),
        (lambda p: pickle.dump([1, 2, 3], open(p, "wb")), "not a CIFAR-10 batch"),
    ],
)
def test_damaged_file_is_named(tmp_path, damage, message):
    write_cifar(tmp_path, per_train_file=4, val_images=4)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    damage(path)
    with pytest.raises(DataError, match=message) as err:
        load_split(tmp_path, train=True, subset=4)
    assert "data_batch_3" in str(err.value)


# CIFAR-10's per-channel mean and standard deviation over its 50,000 training images (pixels scaled to [0, 1]),
# written out here, not read from cifar_wrn.datasets: a wrong constant there fails the normalisation tests.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
NORMALIZATIONS = {"cifar": (CIFAR10_MEAN, CIFAR10_STD), "course": ((0.5,) * 3, (0.5,) * 3)}


def normalised(images: torch.Tensor, normalization: str) -> torch.Tensor:
    """uint8 images (N, 3, H, W) as the trainers should normalise them: scaled to [0, 1], then per channel."""
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in NORMALIZATIONS[normalization])
    return (images.float() / 255 - mean) / std


def test_dataset_normalises_and_augments():
    images = torch.full((8, 3, 32, 32), 128, dtype=torch.uint8)
    labels = torch.arange(8)
    plain = CIFAR10(images, labels, augment=False)
    x, y = plain[3]
    expected = (128 / 255 - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    assert x.dtype == torch.float32 and x.shape == (3, 32, 32) and y == 3
    torch.testing.assert_close(x[:, 5, 5], expected)
    # with augmentation, random crops of a constant image show the zero padding sometimes
    torch.manual_seed(0)
    padded = sum(bool((CIFAR10(images, labels, augment=True)[0][0] < expected.min() - 1).any()) for _ in range(50))
    assert 30 < padded <= 50


def test_a_data_dir_that_is_the_batches_folder_itself_names_its_parent(cifar_dir):
    inner = cifar_dir / "cifar-10-batches-py"
    with pytest.raises(DataError) as refused:
        load_split(inner, True, 10)
    problem = str(refused.value)
    assert f"{inner} holds data_batch_1 itself" in problem and f"--data-dir {cifar_dir.resolve()}" in problem
    with pytest.raises(DataError) as refused:
        load_split(cifar_dir / "nothing", True, 10)
    assert "holds data_batch_1" not in str(refused.value)


def test_both_trainers_take_both_cpu_flags():
    """raw_ddp.py's --device cpu and accel_train.py's --cpu each work in the other trainer too."""
    import accel_train
    import raw_ddp

    assert raw_ddp.parse_args(["--cpu"]).device == "cpu" and raw_ddp.parse_args(["--device", "cpu"]).device == "cpu"
    cpu = lambda *flags: resolve_accel_launch(accel_train.parse_args(list(flags)))[0].device == "cpu"
    assert cpu("--device", "cpu") and cpu("--cpu")
    assert cpu("--train-subset", "8") == (not torch.cuda.is_available())  # auto: the CPU only without CUDA
    assert raw_ddp.parse_args([]).device == "auto"


def batch_indices(loader) -> list[int]:
    """The dataset indices a loader of raw_ddp.build_data's deals, in order (its sampler's, no images loaded)."""
    batches = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler  # per image / on device
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("pipeline", ["dataloader", "device"])
def test_sampler_shards_are_disjoint_cover_and_reshuffle(cifar_dir, monkeypatch, pipeline):
    """raw_ddp.build_data's samplers for 2 ranks (one process builds both, its two collectives stood in for):
    each epoch the ranks' training batches are disjoint and together every training image once (320 = 2 x 5 x
    32: nothing dropped); set_epoch, as the epoch loop calls it (R1.6), gives a new order; the validation
    batches (101 images, padded to 2 x 51) with each rank's mask count every image once."""
    import raw_ddp

    monkeypatch.setattr(raw_ddp.dist, "barrier", lambda: None)
    flags = ["--device", "cpu", "--data-dir", cifar_dir, "--train-subset", TRAIN_IMAGES, "--val-subset", VAL_IMAGES]
    flags += ["--batch-size", 32, "--set", f"data_pipeline={pipeline}", "--set", "num_workers=0"]
    flags += ["--set", "augmentation=crop_flip"]  # the course's needs the DataLoader pipeline
    settings, recipe = resolve_raw_launch(raw_ddp.parse_args([str(f) for f in flags]))
    ranks = [raw_ddp.build_data(settings, recipe, Process(rank, rank, 2, torch.device("cpu"))) for rank in (0, 1)]
    orders = []
    for epoch in (0, 1):
        for data in ranks:
            data.train_sampler.set_epoch(epoch)
        shards = [[int(i) for batch in data.train_batches for i in batch] for data in ranks]  # device: tensor rows
        assert [len(shard) for shard in shards] == [data.steps_per_epoch * 32 for data in ranks] == [160, 160]
        assert not set(shards[0]) & set(shards[1]) and set(shards[0]) | set(shards[1]) == set(range(TRAIN_IMAGES))
        orders.append(shards)
    assert orders[0][0] != orders[1][0] and orders[0][1] != orders[1][1]  # a new order each epoch
    val = [batch_indices(data.val_loader) for data in ranks]
    assert [len(v) for v in val] == [51, 51] and len(set(val[0]) & set(val[1])) == 1  # one padding repeat
    counted = [i for v, data in zip(val, ranks) for i, keep in zip(v, data.val_mask) if keep]
    assert sorted(counted) == list(range(VAL_IMAGES))


@pytest.mark.parametrize("n, world", [(101, 2), (100, 2), (10, 3), (7, 4)])
def test_real_sample_mask_counts_each_image_once(n, world):
    seen = []
    for rank in range(world):
        sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank, shuffle=False)
        mask = real_sample_mask(sampler)
        seen += [i for i, keep in zip(sampler, mask) if keep]
    assert sorted(seen) == list(range(n))


def test_evaluate_returns_exact_sums():
    torch.manual_seed(0)
    model = WideResNet(width=4).eval()
    images, labels = torch.randn(10, 3, 32, 32), torch.randint(0, 10, (10,))
    loader = torch.utils.data.DataLoader(list(zip(images, labels)), batch_size=4)
    mask = torch.tensor([True] * 9 + [False])
    totals = evaluate(model, loader, mask, torch.device("cpu"))
    with torch.no_grad():
        logits = model(images[:9])
    assert totals[2] == 9
    assert totals[1] == (logits.argmax(1) == labels[:9]).sum()
    torch.testing.assert_close(
        totals[0].float(), torch.nn.functional.cross_entropy(logits, labels[:9], reduction="sum")
    )
    flipped = evaluate(model, loader, mask, torch.device("cpu"), tta_flip=True)
    with torch.no_grad():
        logits = tta_logits(model, images[:9], flip=True)
    torch.testing.assert_close(
        flipped[0].float(), torch.nn.functional.cross_entropy(logits, labels[:9], reduction="sum")
    )
    assert flipped[0] != totals[0]  # the mirrored view changed the logits


@pytest.mark.parametrize("channels_last", [False, True])
def test_tta_logits_weights_each_view(channels_last):
    """With a "model" whose logits are its input pixels, tta_logits is visibly the documented mean: the image, or
    half on the image and half on its mirror, in either layout."""
    x = torch.arange(2 * 3 * 5 * 5, dtype=torch.float32).reshape(2, 3, 5, 5)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    pixels = lambda images: images.flatten(1)  # noqa: E731
    torch.testing.assert_close(tta_logits(pixels, x), pixels(x))
    torch.testing.assert_close(tta_logits(pixels, x, flip=True), (pixels(x) + pixels(x.flip(3))) / 2)


def test_bf16_tta_views_are_averaged_in_fp32():
    """Under bf16 autocast the views' logits are bf16; their mean is taken in fp32 (as accel_train.py's prepared
    model returns fp32), so both trainers compute the same validation from the same weights."""
    model = WideResNet(width=4).eval()
    images = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain, mirrored = model(images), model(images.flip(3))
        averaged = tta_logits(model, images, flip=True)
    assert plain.dtype == torch.bfloat16 and averaged.dtype == torch.float32
    assert torch.equal(averaged, 0.5 * plain.float() + 0.5 * mirrored.float())


# ----------------------------------------------------------------------------- recipes


def test_baseline_recipe_is_the_course_default():
    recipe = load_recipe("baseline")
    assert (recipe.batch_size, recipe.base_lr, recipe.epochs, recipe.target_accuracy, recipe.patience) == (
        32,
        0.01,
        40,
        0.85,
        2,
    )
    # the course script: torch.optim.SGD(lr=0.01, momentum=0.9), fp32, its transform_train and Normalize(0.5)
    assert recipe.precision == "fp32" and recipe.momentum == 0.9 and not recipe.nesterov
    assert (recipe.lr_schedule, recipe.weight_decay, recipe.label_smoothing) == ("constant", 0.0, 0.0)
    assert recipe.augment and (recipe.augmentation, recipe.normalization) == ("course", "course")
    assert (recipe.lr_scaling, recipe.reference_batch_size, recipe.data_pipeline) == ("linear", 32, "dataloader")


def test_each_recipe_key_has_one_comment_line_of_at_most_120_characters():
    """recipes/*.yaml: a header of at most 3 comment lines, then `key: value  # what, unit, why` on one line a key;
    the measurements and run histories behind a value live in docs/optimizations.md, not in the recipe."""
    for path in sorted((REPO / "cifar_wrn" / "recipes").glob("*.yaml")):
        lines = path.read_text().splitlines()
        header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        assert header <= 3, f"{path.name}: a header of {header} comment lines"
        for line in lines[header:]:
            assert len(line) <= 120 and re.fullmatch(r"[a-z_0-9]+: \S+ +# \S.*", line), f"{path.name}: {line!r}"


def test_recipe_overrides_are_typed():
    recipe = load_recipe("baseline", {**parse_set(["momentum=0.5", "precision=bf16", "nesterov=true"]), "epochs": 3})
    assert recipe.momentum == 0.5 and recipe.precision == "bf16" and recipe.nesterov is True and recipe.epochs == 3


def test_the_course_augmentation_is_the_course_scripts_transform_train():
    """Under one seed, augmentation: course gives what the course's transforms give, in their order, with
    its Normalize((0.5,) * 3, (0.5,) * 3)."""
    from torchvision.transforms import v2

    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    course = v2.Compose(
        [
            v2.RandomHorizontalFlip(),
            v2.RandomRotation(10),
            v2.RandomAffine(0, shear=10, scale=(0.8, 1.2)),
            v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )
    ours = CIFAR10(images, torch.arange(4), augment=True, augmentation="course", normalization="course")
    for i in range(4):
        torch.manual_seed(i)
        expected = course(images[i])
        torch.manual_seed(i)
        torch.testing.assert_close(ours[i][0], expected, rtol=0, atol=0)
    plain = CIFAR10(images, torch.arange(4), augment=False, normalization="course")[1][0]
    torch.testing.assert_close(plain, (images[1].float() / 255 - 0.5) / 0.5)
    crop_flip = CIFAR10(images, torch.arange(4), augment=True, normalization="course")
    torch.manual_seed(0)
    assert not torch.equal(crop_flip[0][0], (torch.manual_seed(0), course(images[0]))[1])


def test_the_course_augmentation_needs_the_dataloader_pipeline():
    with pytest.raises(RecipeError, match="augmentation: course .* use data_pipeline: dataloader"):
        load_recipe("baseline", {"data_pipeline": "device"})
    assert load_recipe("baseline", {"data_pipeline": "device", "augmentation": "crop_flip"}).augment
    with pytest.raises(RecipeError, match="augmentation must be one of crop_flip, course"):
        load_recipe("baseline", {"augmentation": "randaugment"})


def test_the_device_pipeline_normalises_as_the_recipe_says():
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for normalization in ("cifar", "course"):
        device = DeviceBatches(images, torch.arange(4), "cpu", augment=False, normalization=normalization)[[0, 1, 2, 3]]
        per_image = torch.stack(
            [CIFAR10(images, torch.arange(4), False, normalization=normalization)[i][0] for i in range(4)]
        )
        torch.testing.assert_close(device[0], normalised(images, normalization))
        torch.testing.assert_close(per_image, normalised(images, normalization))


@pytest.mark.parametrize("kernels", [False, True])
def test_bf16_on_a_cpu_without_bfloat16_kernels_is_warned_of(monkeypatch, kernels):
    """Only bf16 on a CPU whose oneDNN lacks the kernels: the warning names the way out (precision=fp32)."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: kernels)
    warning = slow_bf16_warning("cpu", "bf16")
    if kernels:
        assert warning is None
    else:
        assert warning.startswith("warning: precision bf16 on a CPU without bfloat16 kernels")
        assert "--set precision=fp32" in warning
    assert slow_bf16_warning("cpu", "fp32") is None and slow_bf16_warning("cuda", "bf16") is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"momentun": "0.9"}, "unknown recipe key 'momentun'"),
        ({"epochs": "ten"}, "'epochs' must be int"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"target_accuracy": 85}, "target_accuracy is a fraction"),
        ({"grad_clip_norm": -1}, "grad_clip_norm must be >= 0"),
    ],
)
def test_bad_overrides_are_rejected(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("baseline", overrides)


def test_recipe_file_unknown_key_and_missing(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("epochs: 3\nlearning_rate: 0.1\n")
    with pytest.raises(RecipeError, match="unknown recipe key 'learning_rate'"):
        load_recipe(str(path))
    with pytest.raises(RecipeError, match="known recipes: baseline"):
        load_recipe("no-such-recipe")
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        parse_set(["momentum"])


def learning_rates(recipe: Recipe, steps: int, steps_per_epoch: int = 10) -> list:
    """The learning rate of each of the first `steps` optimizer steps (peak lr 1.0)."""
    opt = build_optimizer(WideResNet(width=4), recipe, lr=1.0)
    sched = build_scheduler(opt, recipe, steps_per_epoch)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_linear_lr_scaling_and_schedule():
    recipe = Recipe()
    assert scaled_lr(recipe, 64) == pytest.approx(0.02)
    assert scaled_lr(Recipe(lr_scaling="none"), 64) == 0.01
    warm = Recipe(epochs=2, lr_schedule="warmup_linear", warmup_epochs=0.5, weight_decay=5e-4, momentum=0.9)
    opt = build_optimizer(WideResNet(width=4), warm, lr=1.0)
    assert [g["weight_decay"] for g in opt.param_groups] == [5e-4, 0.0]
    assert all(p.ndim <= 1 for p in opt.param_groups[1]["params"])
    lrs = learning_rates(warm, steps=20)
    assert lrs[0] == pytest.approx(0.2) and lrs[4] == pytest.approx(1.0)  # 5 warmup steps
    assert lrs[-1] == pytest.approx(1 / 15) and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_random_crops_shift_by_at_most_4_pixels():
    """White images: the zero padding (negative once normalised) reaches exactly 4 pixels in, in both pipelines."""
    from cifar_wrn.datasets import DeviceBatches

    white = torch.full((256, 3, 32, 32), 255, dtype=torch.uint8)
    labels = torch.zeros(256, dtype=torch.long)
    device_batch = DeviceBatches(white, labels, "cpu", augment=True)[list(range(256))][0]
    torch.manual_seed(0)
    per_image = torch.stack([CIFAR10(white, labels, augment=True)[i][0] for i in range(256)])
    pad = 4
    for x in (device_batch, per_image):
        padding = x[:, 0] < 0
        assert not padding[:, pad : 32 - pad, pad : 32 - pad].any()
        assert padding[:, pad - 1].any() and padding[:, :, 32 - pad].any()


def test_bn_lr_scale_multiplies_the_no_decay_groups_rate_through_the_schedule():
    recipe = load_recipe("fast", {"bn_lr_scale": 4.0})
    model = WideResNet(width=4)
    optimizer = build_optimizer(model, recipe, 0.1)
    decay, no_decay = optimizer.param_groups
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim <= 1 for p in no_decay["params"])
    assert (decay["lr"], no_decay["lr"]) == (0.1, pytest.approx(0.4))
    scheduler = build_scheduler(optimizer, recipe, steps_per_epoch=10)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    assert no_decay["lr"] == pytest.approx(4 * decay["lr"]) and 0 < decay["lr"] < 0.1
    default = build_optimizer(model, load_recipe("baseline"), 0.1)
    assert [g["lr"] for g in default.param_groups] == [0.1, 0.1]


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf")])
def test_bn_lr_scale_is_checked(value):
    with pytest.raises(RecipeError, match="bn_lr_scale'? must be a (positive|finite) number"):  # inf: finite
        load_recipe("fast", {"bn_lr_scale": value})


@pytest.mark.parametrize(
    "key", ["alternating_flip", "lookahead_steps", "anneal_epochs", "residual_bn_init", "tta_translate"]
)
def test_keys_that_left_the_recipe_are_refused_by_name(key):
    """An old recipe or --set with a key whose code left the project (docs/record/optimizations.md, "Where the code
    went") stops with the key named, never silently."""
    with pytest.raises(RecipeError, match=f"unknown recipe key '{key}'"):
        load_recipe("fast", {key: 1})


class SignalsItself(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGUSR1)  # what srun does to every process on a stop request
        return i


@pytest.mark.slow  # DataLoader worker processes (started inside the project's code)
def test_loader_workers_survive_a_stop_signal():
    from cifar_wrn.loaders import ignore_stop_signal

    loader = torch.utils.data.DataLoader(
        SignalsItself(), batch_size=2, num_workers=1, worker_init_fn=ignore_stop_signal, multiprocessing_context="spawn"
    )
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    bare = torch.utils.data.DataLoader(SignalsItself(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(RuntimeError, match="killed by signal|exited unexpectedly"):
        list(bare)  # without it the worker dies: the test can fail


def test_the_fused_sgd_update_equals_the_per_tensor_loop():
    """build_optimizer fuses the update on a GPU; with the fast recipe's groups (weight decay on kernels only, a
    scaled LR for BatchNorm, Nesterov momentum), 5 steps of the fused and the looped update agree to rounding.
    Both optimizers get the same gradients each step: a second forward would let the 5 steps amplify the
    rounding (batch 8 at lr 0.2 is chaotic enough to leave 1e-5 on some seeds), which is not the update's."""
    torch.manual_seed(0)
    recipe = load_recipe("fast")
    models = [WideResNet(width=4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = [p.detach().clone() for p in models[0].parameters()]
    optimizers = [build_optimizer(m, recipe, lr=0.2, fused=fused) for m, fused in zip(models, (True, False))]
    assert optimizers[0].defaults["fused"] and not optimizers[1].defaults["fused"]
    for _ in range(5):
        images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        optimizers[0].zero_grad()
        torch.nn.functional.cross_entropy(models[0](images), labels).backward()
        for a, b in zip(*(m.parameters() for m in models)):
            b.grad = a.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # rounding of the update alone
    assert all(not torch.equal(a, b) for a, b in zip(models[0].parameters(), start))  # every parameter moved


def recipe_reads(path) -> set[str]:
    """The Recipe fields a file reads as attributes of a recipe (`recipe.x`, `run.recipe.x`, `r.x`, and `self.x` in
    the Recipe class's own methods, such as ddp_options), outside check_recipe (which reads them to refuse bad
    values, not to act on them)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    checks = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "check_recipe"]
    skipped = {id(n) for check in checks for n in ast.walk(check)}
    own = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "Recipe" for n in ast.walk(c)}
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in skipped
        if (isinstance(node.value, ast.Name) and node.value.id in ("recipe", "r"))
        or (isinstance(node.value, ast.Name) and node.value.id == "self" and id(node) in own)
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "recipe")
    }


def test_every_recipe_key_is_read_by_the_training_code():
    """A key that no trainer, and no package module but the report's, reads is a key without an effect (bench/
    sets flags itself, so it does not count): cudnn_benchmark was one from c64c708 on."""
    files = [REPO / "raw_ddp.py", REPO / "accel_train.py", *sorted((REPO / "cifar_wrn").glob("*.py"))]
    read = set().union(*map(recipe_reads, files))
    assert {f.name for f in fields(Recipe)} - read == set()


@pytest.mark.parametrize("trainer", ["raw_ddp", "accel_train"])
@pytest.mark.parametrize("name, autotuned", [("fast", True), ("baseline", False)])
def test_the_recipe_sets_cudnn_autotuning_as_the_model_is_built(monkeypatch, trainer, name, autotuned):
    """build_model leaves torch.backends.cudnn.benchmark as the recipe says, whatever it was (the flag can be set
    and read without CUDA); DDP and Accelerate's prepare() are stood in for: one process, no group."""
    module = importlib.import_module(trainer)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not autotuned)
    monkeypatch.setattr(module, "DDP", lambda model, **options: model, raising=False)
    accelerator = SimpleNamespace(prepare=lambda *objects: objects, unwrap_model=lambda model: model)
    recipe = replace(load_recipe(name), compile=False)
    process = AccelProcess(0, 0, 1, torch.device("cpu"), accelerator)
    train_set = DeviceBatches(torch.zeros(64, 3, 32, 32, dtype=torch.uint8), torch.zeros(64), "cpu", augment=False)
    settings = SimpleNamespace(model_width=4, progress="off")
    module.build_model(settings, recipe, process, SimpleNamespace(steps_per_epoch=4, train_set=train_set))
    assert torch.backends.cudnn.benchmark is autotuned
