"""The structural levers (docs/optimizations.md, 14): Muon, BatchNorm rates, Lookahead, alternating flips."""

import json
import sys

import pytest
import torch
from helpers import REPO, TINY, cpu_env, data_flags, free_port, run
from helpers import raw_ddp as run_raw
from torch.utils.data import BatchSampler, DistributedSampler

from cifar_wrn.data import MEAN, STD, SkipFirst
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import NS_COEFFICIENTS, MuonSGD, build_optimizer, build_training, orthogonalise
from cifar_wrn.pipeline import DeviceBatches, alternating_flips
from cifar_wrn.recipe import Recipe, RecipeError, load_recipe
from cifar_wrn.runlog import read_log

LEVERS = [
    "muon=true",
    "muon_lr=0.05",
    "lookahead_steps=3",
    "lookahead_alpha=0.5",
    "bn_bias_lr_scale=4",
    "freeze_bn_scale=true",
    "augment=true",
    "crop_padding=0",
    "alternating_flip=true",
]


def newton_schulz_float64(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference: the same polynomial iteration in float64, written directly on the matrix as given
    (X <- a X + b (X X^T) X + c (X X^T)^2 X), without the bf16 rounding or the transposition."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.double() / matrix.double().norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x


def kernel_grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


# ----------------------------------------------------------------------------- Muon


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
@pytest.mark.parametrize("steps", [3, 5])
def test_orthogonalised_update_has_singular_values_near_one(shape, steps):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out = orthogonalise(matrix, steps).float()
    assert out.shape == shape
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.5 and singular.max() < 1.5, singular
    assert torch.linalg.svdvals(matrix).max() / torch.linalg.svdvals(matrix).min() > 3  # it was far from that
    reference = newton_schulz_float64(matrix, steps)
    exact = orthogonalise(matrix.double(), steps, dtype=torch.float64)  # the same code without bf16
    assert (exact - reference).norm() < 1e-8 * reference.norm()  # (the 1e-7 added to the norm)
    assert (out.double() - reference).norm() < 0.06 * reference.norm()  # bf16 rounding only (2-4 %)


@pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon (2.7.1, Falcon's, has none)"
)
def test_muon_step_on_a_kernel_equals_torch_optim_muon_on_the_matrix():
    """Without momentum (torch.optim.Muon's momentum is an average, a scale the orthogonalisation removes, but
    one that bf16 rounds differently) and for a kernel with out <= in*k*k (torch's rate adjustment is 1)."""
    torch.manual_seed(0)
    kernel = torch.nn.Parameter(torch.randn(8, 4, 3, 3) * 0.1)
    matrix = torch.nn.Parameter(kernel.detach().reshape(8, -1).clone())
    start = kernel.detach().clone()
    ours = MuonSGD([{"params": [kernel], "muon": True}], lr=0.1, momentum=0.0, nesterov=False)
    theirs = torch.optim.Muon([matrix], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, ns_steps=3)
    for grad in kernel_grads((8, 4, 3, 3), 3):
        kernel.grad, matrix.grad = grad.clone(), grad.reshape(8, -1).clone()
        ours.step()
        theirs.step()
    theirs_moved = matrix.detach().view(8, 4, 3, 3) - start
    ours_moved = kernel.detach() - start
    # both orthogonalise in bf16, in differently fused operations: agreement to bf16's few per cent
    assert theirs_moved.norm() > 0.3 and (ours_moved - theirs_moved).norm() < 0.04 * theirs_moved.norm()


def test_muon_nesterov_momentum_and_renormalisation_follow_airbench_rule():
    """Two steps with momentum 0.6, Nesterov, renormalisation: against the rule written out in float64."""
    torch.manual_seed(0)
    kernel = torch.nn.Parameter(torch.randn(8, 4, 3, 3) * 0.1)
    expected = kernel.detach().double().clone()
    optimizer = MuonSGD(
        [{"params": [kernel], "muon": True, "renormalize": True, "momentum": 0.6, "nesterov": True}],
        lr=0.2,
        momentum=0.9,
        nesterov=False,
    )
    buffer = torch.zeros(8, 4, 3, 3)
    for grad in kernel_grads((8, 4, 3, 3), 2, seed=3):
        kernel.grad = grad.clone()
        optimizer.step()
        buffer = buffer * 0.6 + grad  # in float32, as the optimizer: exactly its buffer
        update = newton_schulz_float64((grad + 0.6 * buffer).reshape(8, -1), 3).view_as(expected)
        expected = expected * (8**0.5 / expected.norm()) - 0.2 * update
    assert torch.equal(optimizer.state[kernel]["momentum_buffer"], buffer)  # plain momentum (not an average)
    assert (kernel.detach().double() - expected).norm() < 0.02 * expected.norm()


def test_muon_groups_hold_every_kernel_and_renormalise_only_those_a_batchnorm_follows():
    model = WideResNet(width=4)
    optimizer = build_optimizer(model, Recipe(muon=True, momentum=0.9, nesterov=True), lr=0.1)
    assert isinstance(optimizer, MuonSGD)
    muon = [g for g in optimizer.param_groups if g["muon"]]
    renormalised = {id(p) for g in muon if g["renormalize"] for p in g["params"]}
    kernels = [p for p in model.parameters() if p.ndim == 4]
    assert {id(p) for g in muon for p in g["params"]} == {id(p) for p in kernels} and len(kernels) == 16
    shortcuts = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)}
    assert len(shortcuts) == 3 and renormalised == {id(p) for p in kernels} - shortcuts
    assert all(g["lr"] == 0.24 and g["momentum"] == 0.6 and g["weight_decay"] == 0 for g in muon)
    sgd = [p for g in optimizer.param_groups if not g["muon"] for p in g["params"]]
    assert all(p.ndim <= 2 for p in sgd) and any(p.ndim == 2 for p in sgd)  # BatchNorm, biases, the head


def test_sgd_groups_step_exactly_like_torch_sgd():
    """MuonSGD's non-Muon groups (here all of them, with Lookahead off) are torch.optim.SGD, bit for bit."""
    models = [WideResNet(width=2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    recipe = Recipe(momentum=0.9, nesterov=True, weight_decay=5e-4, bn_lr_scale=4.0)
    reference = build_optimizer(models[0], recipe, lr=0.1)
    ours = MuonSGD(
        [dict(g) for g in build_optimizer(models[1], recipe, lr=0.1).param_groups], lr=0.1, momentum=0.9, nesterov=True
    )
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for model, optimizer in zip(models, (reference, ours)):
        torch.manual_seed(1)  # the same dropout masks
        for _ in range(3):
            optimizer.zero_grad()
            model(images).square().mean().backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert not torch.equal(models[0].input_block.cbr[0].weight, WideResNet(width=2).input_block.cbr[0].weight)


# ----------------------------------------------------------------------------- BatchNorm rates


def test_frozen_batchnorm_scales_never_move_and_the_bias_group_has_its_rate():
    recipe = load_recipe("fast", {"bn_bias_lr_scale": 16.0, "freeze_bn_scale": True})
    model = WideResNet(width=2)
    lr, optimizer, scheduler, _ = build_training(model, recipe, global_batch_size=256, steps_per_epoch=10)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    assert all(group_of[id(m.bias)]["lr"] == group_of[id(norms[0].bias)]["lr"] for m in norms)
    scales = [m.weight.detach().clone() for m in norms]
    biases = [m.bias.detach().clone() for m in norms]
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), torch.arange(8)).backward()
        optimizer.step()
        scheduler.step()
    factor = scheduler.get_last_lr()[0] / lr  # the schedule's multiplier after 4 steps
    assert group_of[id(norms[0].bias)]["lr"] == pytest.approx(lr * 4 * 16 * factor)
    assert group_of[id(norms[0].weight)]["lr"] == 0.0 and group_of[id(model.fc.bias)]["lr"] == pytest.approx(
        lr * 4 * factor
    )  # the other biases keep bn_lr_scale
    assert all(torch.equal(m.weight, s) for m, s in zip(norms, scales))
    assert norms[0].weight.grad is not None  # they do get gradients: the optimizer leaves them where they are
    assert any(not torch.equal(m.bias, b) for m, b in zip(norms, biases))


def test_default_levers_keep_todays_optimizer():
    for recipe in (Recipe(), load_recipe("fast")):
        optimizer = build_optimizer(WideResNet(width=2), recipe, lr=0.1)
        assert type(optimizer) is torch.optim.SGD and len(optimizer.param_groups) == 2


# ----------------------------------------------------------------------------- Lookahead


def test_lookahead_pulls_slow_weights_every_k_steps():
    """k = 3, alpha = 0.5, on a linear layer: live weights after SGD steps, the slow ones by the rule."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    plain = torch.nn.Linear(4, 3)
    plain.load_state_dict(layer.state_dict())
    optimizer = MuonSGD(layer.parameters(), lr=0.1, momentum=0.9, nesterov=True, lookahead_steps=3, lookahead_alpha=0.5)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    slow = [p.detach().clone() for p in plain.parameters()]
    inputs = torch.randn(7, 8, 4, generator=torch.Generator().manual_seed(1))
    for step, x in enumerate(inputs, start=1):
        for model, opt in ((layer, optimizer), (plain, sgd)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        if step % 3 == 0:  # the rule, by hand
            with torch.no_grad():
                for s, p in zip(slow, plain.parameters()):
                    s += 0.5 * (p - s)
                    p.copy_(s)
        torch.testing.assert_close(
            list(layer.parameters()), list(plain.parameters()), rtol=1e-5, atol=1e-6
        )  # lerp rounds its own way
    assert not torch.equal(optimizer.state[layer.weight]["slow"], layer.weight.detach())  # 1 step after a pull
    torch.testing.assert_close(
        optimizer.state[layer.weight]["slow"], slow[0], rtol=1e-5, atol=1e-6
    )  # lerp rounds its own way


def test_state_dict_round_trip_continues_exactly():
    """Muon + Lookahead + frozen scales: 3 steps, state_dict into a fresh model and optimizer, 4 more steps,
    equals 7 steps straight (momentum buffers, slow weights and the step count all travel)."""
    recipe = load_recipe("fast", {k: v for k, v in (o.split("=") for o in LEVERS[:6])})
    images = torch.randn(7, 8, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def train(model, optimizer, scheduler, batches):
        for x in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), torch.arange(8)).backward()
            optimizer.step()
            scheduler.step()

    def fresh():
        torch.manual_seed(0)
        model = WideResNet(width=2)
        return (model, *build_training(model, recipe, 256, steps_per_epoch=3)[1:3])

    straight = fresh()
    torch.manual_seed(1)
    train(*straight, images)
    first = fresh()
    torch.manual_seed(1)
    train(*first, images[:3])
    saved, rng = [first[0].state_dict(), first[1].state_dict(), first[2].state_dict()], torch.get_rng_state()
    assert "slow" in saved[1]["state"][0] and saved[1]["state"][0]["lookahead_count"] == 3
    second = fresh()
    for obj, state in zip(second, saved):
        obj.load_state_dict(state)
    torch.set_rng_state(rng)  # the dropout masks continue too
    train(*second, images[3:])
    assert all(torch.equal(a, b) for a, b in zip(straight[0].state_dict().values(), second[0].state_dict().values()))


# ----------------------------------------------------------------------------- alternating flips


def test_alternating_flips_show_every_image_once_mirrored_over_two_epochs():
    n, world_size = 40, 2
    images = torch.randint(0, 256, (n, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    normalised = (images.float() - torch.tensor(MEAN).view(1, 3, 1, 1) * 255) / (
        torch.tensor(STD).view(1, 3, 1, 1) * 255
    )
    flips = alternating_flips(n, seed=5)
    assert torch.equal(flips, alternating_flips(n, seed=5)) and 0 < flips.sum() < n  # the same on every rank
    mirrored = {}  # (epoch, image) -> mirrored?
    for epoch in (3, 4):
        for rank in range(world_size):
            data = DeviceBatches(images, torch.arange(n), "cpu", augment=True, seed=rank, crop_padding=0, flips=flips)
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            for indices in SkipFirst(BatchSampler(sampler, 4, drop_last=True)):
                batch, labels = data[indices]
                for image, i in zip(batch, labels.tolist()):
                    flipped = torch.allclose(image, normalised[i].flip(2))
                    assert flipped or torch.allclose(image, normalised[i])
                    mirrored[epoch, i] = flipped
    assert len(mirrored) == 2 * n
    assert all(mirrored[3, i] != mirrored[4, i] for i in range(n))
    assert all(mirrored[4, i] == bool(flips[i]) for i in range(n))  # even epochs: the bit itself


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"muon_lr": 0.0}, "muon_lr must be a positive number"),
        ({"muon_momentum": 1.0}, r"muon_momentum must be in \[0, 1\)"),
        ({"bn_bias_lr_scale": -1.0}, "bn_bias_lr_scale must be a positive number"),
        ({"lookahead_steps": -1}, "lookahead_steps must be >= 0"),
        ({"lookahead_alpha": 0.0}, r"lookahead_alpha must be in \(0, 1\]"),
        ({"alternating_flip": True}, "alternating_flip needs augment: true and data_pipeline: device"),
        ({"alternating_flip": True, "augment": True, "data_pipeline": "dataloader"}, "alternating_flip needs"),
    ],
)
def test_lever_values_are_checked(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("fast", overrides)


@pytest.mark.slow
def test_a_bad_lever_value_is_one_error_line(cifar_dir):
    result = run_raw("--num-gpus", 2, *TINY, "--data-dir", cifar_dir, "--set", "lookahead_alpha=2")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: invalid recipe")
    assert "lookahead_alpha must be in (0, 1]" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- under DDP, end to end


@pytest.mark.slow
def test_replicas_stay_identical_with_muon_and_lookahead(tmp_path):
    """tests/ddp_equivalence.py with the levers: bitwise equal weights on both ranks after every step, and
    the same weights as one process on both ranks' batches (up to the bf16 of Newton-Schulz)."""
    out = tmp_path / "result.json"
    levers = {"muon": True, "muon_lr": 0.02, "lookahead_steps": 2, "lookahead_alpha": 0.5}
    result = run(
        [sys.executable, REPO / "tests" / "ddp_equivalence.py", out, free_port(), json.dumps(levers)],
        timeout=120,
        env=cpu_env(PYTHONPATH=REPO),
    )
    assert result.returncode == 0, result.stderr
    checks = json.loads(out.read_text())
    assert checks["identical"], "parameters differ between ranks"
    assert checks["max_change"] > 1e-3
    assert checks["max_diff_vs_single"] < 0.1 * checks["max_change"]


@pytest.mark.slow
def test_every_lever_end_to_end_and_resumed_exactly(cifar_dir, tmp_path):
    """2 processes, the fast recipe with every lever on: it trains, and a run stopped after epoch 1 and
    resumed from its checkpoint ends with the same weights and metrics as one that was not."""
    common = [
        "--num-gpus",
        2,
        *TINY,
        "--recipe",
        "fast",
        "--batch-size",
        32,
        *data_flags(cifar_dir),
        "--dist-timeout",
        60,
        *[a for o in LEVERS + ["lr_schedule=constant", "extra_epochs=0"] for a in ("--set", o)],
    ]
    # (extra_epochs=0: fast.yaml's safety net could add an epoch after --epochs 1 or 2; tests/test_safety_net.py)
    straight = run_raw(*common, "--epochs", 2, "--save", tmp_path / "a.pt", "--log-json", tmp_path / "a.jsonl")
    assert straight.returncode == 0, straight.stderr
    first = run_raw(*common, "--epochs", 1, "--checkpoint-dir", tmp_path / "ck")
    assert first.returncode == 0, first.stderr
    # (a constant schedule: with warmup_linear the budget `epochs` is part of the recipe and cannot change)
    second = run_raw(
        *common,
        "--epochs",
        2,
        "--checkpoint-dir",
        tmp_path / "ck",
        "--resume",
        "--save",
        tmp_path / "b.pt",
        "--log-json",
        tmp_path / "b.jsonl",
    )
    assert second.returncode == 0 and "Resuming from" in second.stdout, second.stderr
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    (header, ea), (_, eb) = read_log(tmp_path / "a.jsonl"), read_log(tmp_path / "b.jsonl")
    assert ea[-1]["val_accuracy"] == eb[-1]["val_accuracy"] and header["recipe"]["muon"] is True
