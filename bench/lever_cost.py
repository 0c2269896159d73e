"""What the levers of docs/optimizations.md 14 cost per step, on the CPU, at the real width (no GPU needed).

    python bench/lever_cost.py [--threads 1] [--batch 8] [--per-process 128] [--repeats 3]

A whole training step of the real WideResNet at 128 images takes tens of seconds on this machine's
CPU, so this times the two parts apart, in one run, with the process's CPU clock (other load on a
shared machine barely moves it): optimizer.step() alone (random gradients) for fast.yaml's SGD and
for fast.yaml with each lever on, and one forward + backward of fast.yaml (bf16, channels_last) at
--batch images. It prints each optimizer step in ms and the step's cost relative to fast.yaml's
at --per-process images, with the forward + backward scaled linearly from --batch (an estimate:
state it as one), and the time of a batch's flips, random and alternating. On a GPU,
bench/train_step.py --levers measures whole steps directly.
"""

import argparse
import dataclasses
import time

import torch

from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_optimizer
from cifar_wrn.pipeline import alternating_flips, random_crop_flip
from cifar_wrn.recipe import load_recipe

# Lookahead timed with a pull after every step (k = 1): its cost at k = 5 is a fifth of the difference.
LEVERS = {
    "muon": dict(muon=True),
    "lookahead, k = 1": dict(lookahead_steps=1),
    "BN bias x16, scales frozen": dict(bn_bias_lr_scale=16.0, freeze_bn_scale=True),
}


def best_seconds(work, repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        work()
        times.append(time.process_time() - t0)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="images of the timed forward + backward")
    p.add_argument("--per-process", type=int, default=128, help="images per step the share is computed for")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fast = load_recipe("fast")
    model = WideResNet().to(memory_format=torch.channels_last)
    images = torch.randn(args.batch, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (args.batch,))

    def forward_backward():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()

    per_image = best_seconds(forward_backward, args.repeats) / args.batch
    for p_ in model.parameters():
        p_.grad = torch.randn_like(p_) * 1e-3
    optimizer_ms = {}
    for name, overrides in {"fast.yaml (SGD)": {}, **LEVERS}.items():
        optimizer = build_optimizer(model, dataclasses.replace(fast, **overrides), lr=0.1)
        optimizer_ms[name] = best_seconds(optimizer.step, args.repeats) * 1e3
    uint8 = torch.randint(0, 256, (args.per_process, 3, 32, 32), dtype=torch.uint8)
    flips, generator = alternating_flips(args.per_process, 0), torch.Generator().manual_seed(0)
    flip_ms = [
        1e3 * best_seconds(lambda m=mask: random_crop_flip(uint8, generator, 0, m), args.repeats)
        for mask in (None, flips)
    ]
    step = per_image * args.per_process * 1e3
    print(
        f"# real WideResNet, CPU, {args.threads} thread(s), CPU clock; forward + backward {per_image * 1e3:.1f} ms "
        f"per image (bf16, channels_last, batch {args.batch}), so ~{step:.0f} ms at {args.per_process} per process"
    )
    print(f"| variant | optimizer step (ms) | step at {args.per_process} vs fast.yaml |\n|---|---|---|")
    base = step + optimizer_ms["fast.yaml (SGD)"]
    for name, ms in optimizer_ms.items():
        print(f"| {name} | {ms:.1f} | {(step + ms) / base:.3f}x |")
    print(
        f"flips of a batch of {args.per_process} (uint8, crop_padding 0): random {flip_ms[0]:.2f} ms, "
        f"alternating {flip_ms[1]:.2f} ms"
    )


if __name__ == "__main__":
    main()
