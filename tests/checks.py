"""Checks of what a training run wrote (its log, saved weights, traces, stderr), shared by the trainers' tests."""

import pytest
import torch
from helpers import TRAIN_IMAGES, VAL_IMAGES


def check_profile(log_path, trace_dir):
    """--profile records: every phase, non-negative, summing to the epoch time within 5%; one trace per rank."""
    from cifar_wrn.profiling import PHASES
    from cifar_wrn.runlog import read_log

    _, epochs = read_log(log_path)
    for e in epochs:
        assert set(e["profile"]) == set(PHASES) and all(v >= 0 for v in e["profile"].values())
        assert sum(e["profile"].values()) == pytest.approx(e["epoch_time"], rel=0.05)
        assert e["profile"]["forward"] > 0 and e["profile"]["backward"] > 0
        assert 0 <= e["comm_estimate"] < e["epoch_time"]
    traces = sorted(p.name.split(".")[0] for p in trace_dir.iterdir())
    assert traces == ["rank0", "rank1"]


def check_metrics_of_saved_weights(log_path, weights_path, cifar_dir):
    """The last logged validation metrics (bf16, flip TTA) equal one process evaluating the saved weights."""
    from torch.utils.data import BatchSampler, DataLoader

    from cifar_wrn.cifar_files import load_split
    from cifar_wrn.datasets import DeviceBatches
    from cifar_wrn.evaluation import evaluate
    from cifar_wrn.model import WideResNet
    from cifar_wrn.runlog import read_log

    _, epochs = read_log(log_path)
    model = WideResNet(width=4)
    model.load_state_dict(torch.load(weights_path))
    val = DeviceBatches(*load_split(cifar_dir, train=False, subset=VAL_IMAGES), "cpu", augment=False)
    loader = DataLoader(val, batch_size=None, sampler=BatchSampler(range(VAL_IMAGES), 50, drop_last=False))
    totals = evaluate(
        model,
        loader,
        torch.ones(VAL_IMAGES, dtype=torch.bool),
        torch.device("cpu"),
        dict(device_type="cpu", dtype=torch.bfloat16),
        tta_flip=True,
    )
    assert epochs[-1]["val_accuracy"] == pytest.approx(totals[1].item() / VAL_IMAGES, abs=1e-12)
    assert epochs[-1]["val_loss"] == pytest.approx(totals[0].item() / VAL_IMAGES, rel=1e-3)  # bf16 batches differ


def first_batchnorm(model: torch.nn.Module) -> str:
    """The name of the model's first BatchNorm, the one just after its first convolution (the course's WideResNet:
    input_block.cbr.1). Its statistics come from the images through that one convolution, which rounds the same
    in a run and in recalibrated_again: they match exactly (0 measured); rounding differences start after it."""
    return next(name for name, module in model.named_modules() if isinstance(module, torch.nn.BatchNorm2d))


def recalibrated_again(weights_path, cifar_dir, images: int, world_size: int) -> tuple[dict, dict]:
    """The saved width-4 network's state_dict, and the same with its BatchNorm statistics re-estimated: 32 images
    per batch, bf16 and channels_last, as the tests' fast recipe runs, on each rank's recalibration images,
    averaged over the ranks (recalibrated, below)."""
    from cifar_wrn.cifar_files import load_split
    from cifar_wrn.datasets import DeviceBatches
    from cifar_wrn.model import WideResNet
    from cifar_wrn.recipe import load_recipe

    saved = WideResNet(width=4)
    saved.load_state_dict(torch.load(weights_path))
    train_set = DeviceBatches(*load_split(cifar_dir, train=True, subset=TRAIN_IMAGES), "cpu", augment=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the threads of each of the run's processes on 2 cores: bf16 rounds the same way
    again = recalibrated(
        saved.to(memory_format=torch.channels_last),
        train_set,
        load_recipe("fast", {"batch_size": 32, "bn_recalibration": images}),
        world_size,
    )
    torch.set_num_threads(threads)
    return saved.state_dict(), again.state_dict()


def check_bn_recalibrated(weights_path, cifar_dir, images: int, world_size: int):
    """The saved network's BatchNorm statistics are its own: re-estimating them (recalibrated_again) gives them
    back, the first BatchNorm's to rounding, the others' within 3 %."""
    from cifar_wrn.model import WideResNet

    saved, again = recalibrated_again(weights_path, cifar_dir, images, world_size)
    first = [key for key in again if key.startswith(f"{first_batchnorm(WideResNet(width=4))}.running")]
    assert len(first) == 2, sorted(again)  # its running_mean and running_var, as the model names them
    for key, expected in again.items():
        if "running" in key:
            error = ((saved[key] - expected).norm() / expected.norm()).item()
            # bf16 rounding differs after the first convolution (0 before it, measured) and grows with depth
            # (< 2 % measured); the ranks' own statistics differ from their mean by 1-37 %: a missing average or
            # recalibration fails.
            assert error < (1e-6 if key in first else 0.03), (key, error)


def check_slow_bf16_warning(stderr: str):
    """A bf16 run on this CPU warned once (per node) where the CPU lacks bfloat16 kernels, and not otherwise."""
    from cifar_wrn.recipe import slow_bf16_warning

    warning = slow_bf16_warning("cpu", "bf16")
    if warning:
        assert stderr.count(warning) == 1, stderr[-3000:]
    else:
        assert "without bfloat16 kernels" not in stderr, stderr[-3000:]


def parameter_distance(weights_a, weights_b, width: int = 4) -> float:
    """L2 distance between the trainable parameters (not the BatchNorm buffers) of two saved state_dicts."""
    from cifar_wrn.model import WideResNet

    a, b = torch.load(weights_a), torch.load(weights_b)
    names = [name for name, _ in WideResNet(width=width).named_parameters()]
    return sum(((a[n].double() - b[n].double()) ** 2).sum() for n in names).sqrt().item()


def recalibrated(network, train_set, recipe, world_size: int):
    """A copy of `network` recalibrated on the CPU as a `world_size`-process run would: each rank's share
    re-estimated alone, then the statistics averaged."""
    import copy

    from cifar_wrn.bn_recalibration import recalibrate_bn, recalibration_batches

    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=recipe.precision == "bf16")
    shares = []
    for rank in range(world_size):
        share = copy.deepcopy(network)
        batches = recalibration_batches(train_set, recipe, rank, world_size, "cpu")
        recalibrate_bn(share, batches, autocast, lambda _: None)
        shares.append(dict(share.named_buffers()))
    result = copy.deepcopy(network)
    for name, buffer in result.named_buffers():
        if name.endswith(("running_mean", "running_var")):
            buffer.copy_(sum(share[name] for share in shares) / world_size)
    return result


def load_checkpoint(folder) -> dict:
    """raw_ddp.py's checkpoint in `folder`, read as a resume reads it (its keys checked)."""
    from cifar_wrn.raw_side import RawCheckpointer

    checkpointer = RawCheckpointer(folder)
    return checkpointer.load(checkpointer.path)


def read_training_state(folder) -> dict:
    """accel_train.py's training_state.pt in the state-<n> `folder`, read as a resume reads it."""
    from pathlib import Path

    from cifar_wrn.accel_side import TRAINING_STATE, AccelCheckpointer

    return AccelCheckpointer(None).load(Path(folder) / TRAINING_STATE)


def checkpoint_keys(trainer: str) -> tuple:
    """Every key a checkpoint of `trainer` ("raw" or "accel") holds."""
    from cifar_wrn.accel_side import AccelCheckpointer
    from cifar_wrn.checkpoints import KEYS
    from cifar_wrn.raw_side import RawCheckpointer

    return (*KEYS, *(RawCheckpointer if trainer == "raw" else AccelCheckpointer).OWN_KEYS)


def check_images_per_sec_is_the_sum(log_path, rank_times, stdout: str):
    """Run with helpers.slow_rank_env(rank_times, ...): each logged Images/sec (and the printed one) is the sum of
    the two ranks' own rates (this rank's images over its own epoch time), not rank 0's rate x 2: rank 1's
    epochs were made clearly longer, so the two differ."""
    import re

    from cifar_wrn.runlog import read_log

    header, epochs = read_log(log_path)
    per_rank = header["steps_per_epoch"] * header["per_device_batch_size"]  # each rank's images per epoch
    printed = [float(r) for r in re.findall(r"Images/sec = ([\d.]+)", stdout)]
    assert len(printed) == len(epochs) >= 1
    for e, shown in zip(epochs, printed, strict=True):
        seconds = [float((rank_times / f"rank-{r}-epoch-{e['epoch']}").read_text()) for r in (0, 1)]
        assert e["epoch_time"] == seconds[0]  # the log's epoch time is rank 0's clock
        assert seconds[1] > 1.5 * seconds[0], seconds  # rank 1 was slowed: the rates differ
        own_rates = [per_rank / s for s in seconds]
        assert e["images_per_sec"] == pytest.approx(sum(own_rates), rel=1e-9)
        assert e["images_per_sec"] < 0.9 * 2 * own_rates[0]  # not rank 0's rate x world size
        assert shown == pytest.approx(e["images_per_sec"], abs=0.051)  # printed to 1 decimal
