"""Training-step images/sec of the fast recipe against the baseline recipe, same device, real model.

    python bench/train_step.py [--device cpu|cuda] [--threads N] [--steps 3] [--fast-batch 256] [--ablation]
    python bench/train_step.py --device cpu --fp32 --fast-batch 32 --warmup 1 --steps 1 --repeats 1   # a CPU's bf16

One process, no DDP: this isolates what the recipe changes per step (precision, memory layout,
batch size, cuDNN autotuning, data pipeline), not the communication. Each recipe runs warm-up steps,
then --steps timed steps of forward + backward + SGD step on the real WideResNet (17.1 M parameters),
with batches from that recipe's own data pipeline. The two recipes alternate --repeats times and
the best rate of each is kept; the ratio fast / baseline comes from the same run. --ablation adds
the steps in between (baseline + bf16, + channels_last, + the fast batch size, + the on-device
pipeline = fast), each against the baseline of the same run. --fp32 adds the fast recipe in fp32: whether
this device's bf16 is fast at all (a CPU without AVX-512 has no bfloat16 kernels; raw_ddp.py warns of it).
"""

import argparse
import dataclasses
import time

import torch
from common import add_timing_flags, apply_timing_flags  # bench/common.py
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from cifar_wrn.datasets import CIFAR10, DeviceBatches
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_optimizer, scaled_lr
from cifar_wrn.recipe import load_recipe

CLOCK = time.perf_counter  # or time.process_time with --clock cpu


def setup(recipe, batch_size, device, images, labels):
    torch.manual_seed(0)
    fmt = torch.channels_last if recipe.channels_last else torch.contiguous_format
    model = WideResNet().to(device, memory_format=fmt).train()
    optimizer = build_optimizer(model, recipe, scaled_lr(recipe, batch_size))
    if recipe.data_pipeline == "device":
        data = DeviceBatches(images, labels, device, augment=True, channels_last=recipe.channels_last)
        loader = DataLoader(data, batch_size=None, sampler=BatchSampler(RandomSampler(data), batch_size, True))
    else:
        loader = DataLoader(
            CIFAR10(images, labels, augment=True),
            batch_size=batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=4 if device.type == "cuda" else 0,
            pin_memory=device.type == "cuda",
        )
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    dtype = torch.bfloat16 if recipe.precision == "bf16" else None
    batches = iter(loader)

    def step():
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True, memory_format=fmt), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if recipe.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm)
        optimizer.step()

    return step


def rate(step, batch_size, steps, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = CLOCK()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch_size / (CLOCK() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_flags(p)
    p.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fast-batch", type=int, help="per-process batch of the fast recipe (default: the recipe's)")
    p.add_argument("--ablation", action="store_true", help="also time the steps from baseline to fast one by one")
    p.add_argument("--fp32", action="store_true", help="also time fast.yaml with precision fp32")
    args = p.parse_args()
    global CLOCK
    CLOCK = apply_timing_flags(args)
    device = torch.device(args.device)
    images = torch.randint(0, 256, (8192, 3, 32, 32), dtype=torch.uint8)  # content does not change step time
    labels = torch.randint(0, 10, (8192,))
    base, fast = load_recipe("baseline"), load_recipe("fast")
    fast_batch = args.fast_batch or fast.batch_size
    recipes, batch = {"baseline": base}, {"baseline": base.batch_size}
    if args.ablation:
        bf16 = dataclasses.replace(base, precision="bf16")
        nhwc = dataclasses.replace(bf16, channels_last=True)
        recipes.update({"+ bf16": bf16, "+ channels_last": nhwc, f"+ batch {fast_batch}": nhwc})
        batch.update(
            {"+ bf16": base.batch_size, "+ channels_last": base.batch_size, f"+ batch {fast_batch}": fast_batch}
        )
    recipes["fast"], batch["fast"] = fast, fast_batch
    if args.fp32:
        recipes["fast in fp32"], batch["fast in fp32"] = dataclasses.replace(fast, precision="fp32"), fast_batch
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # for all: only the recipe differences are measured
    steps = {name: setup(recipes[name], batch[name], device, images, labels) for name in recipes}
    print(
        f"# train step: real WideResNet, device {device}, {args.threads} threads, {args.clock} clock; baseline batch "
        f"{batch['baseline']} fp32, fast batch {batch['fast']} {fast.precision} "
        f"channels_last={fast.channels_last} pipeline={fast.data_pipeline}"
    )
    for name in steps:
        for _ in range(args.warmup):
            steps[name]()
    best = {name: 0.0 for name in steps}
    for _ in range(args.repeats):
        for name in steps:
            best[name] = max(best[name], rate(steps[name], batch[name], args.steps, device))
    print("| variant | per-process batch | images/sec | vs baseline | vs fast |\n|---|---|---|---|---|")
    for name in steps:
        print(
            f"| {name} | {batch[name]} | {best[name]:.1f} | {best[name] / best['baseline']:.2f}x | "
            f"{best[name] / best['fast']:.3f}x |"
        )
    print(f"ratio fast/baseline {best['fast'] / best['baseline']:.2f}x")


if __name__ == "__main__":
    main()
