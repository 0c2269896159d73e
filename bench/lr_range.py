"""Learning-rate range test: how high can the rate go before the course WideResNet diverges?

    python bench/lr_range.py --data-dir data [--recipe fast] [--batch-size 256] [--max-lr 0.4] [--steps 60]
                             [--set KEY=VALUE ...] [--clip-norm X] [--stop-after N]

One process, no DDP, the real model and real CIFAR-10 through the recipe's own pipeline. The rate
rises linearly from max_lr/steps to max_lr over --steps steps (the shape of the recipe's warmup),
and every step prints the rate, the loss, the gradient norm before clipping and the largest
absolute logit, until --steps or a non-finite loss. Where the loss stops falling and the gradient
norm takes off is the rate the warmup must not outrun. --clip-norm clips the gradient norm to X
(torch.nn.utils.clip_grad_norm_) to see whether that removes the divergence.
"""

import argparse
import math
import time

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from cifar_wrn.data import CIFAR10, load_split
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_optimizer
from cifar_wrn.pipeline import DeviceBatches
from cifar_wrn.recipe import load_recipe, parse_set


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--recipe", default="fast")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--batch-size", type=int, help="images per step (default: the recipe's)")
    p.add_argument("--max-lr", type=float, default=0.4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--stop-after", type=int, help="stop after this many steps (default: --steps)")
    p.add_argument("--clip-norm", type=float, help="clip the gradient norm to this value")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    recipe = load_recipe(args.recipe, parse_set(args.set))
    batch_size = args.batch_size or recipe.batch_size

    torch.manual_seed(args.seed)
    images, labels = load_split(args.data_dir, train=True)
    fmt = torch.channels_last if recipe.channels_last else torch.contiguous_format
    model = WideResNet().to(device, memory_format=fmt).train()
    optimizer = build_optimizer(model, recipe, args.max_lr)
    if recipe.data_pipeline == "device":
        data = DeviceBatches(
            images,
            labels,
            device,
            augment=recipe.augment,
            channels_last=recipe.channels_last,
        )
        loader = DataLoader(data, batch_size=None, sampler=BatchSampler(RandomSampler(data), batch_size, True))
    else:
        loader = DataLoader(
            CIFAR10(images, labels, augment=recipe.augment),
            batch_size=batch_size,
            shuffle=True,
            drop_last=True,
        )
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32

    print(
        f"# lr range: recipe {args.recipe} {args.set}, batch {batch_size}, lr up to {args.max_lr} over "
        f"{args.steps} steps, clip {args.clip_norm}, {recipe.precision}, device {device}"
    )
    print("| step | lr | loss | grad norm | max abs logit | s/step |\n|---|---|---|---|---|---|")
    batches = iter(loader)
    ratios = [group["lr"] / args.max_lr for group in optimizer.param_groups]  # bn_lr_scale, if any
    for step in range(args.stop_after or args.steps):
        t0 = time.perf_counter()
        lr = args.max_lr * (step + 1) / args.steps
        for group, ratio in zip(optimizer.param_groups, ratios):
            group["lr"] = lr * ratio
        x, y = next(batches)
        x, y = x.to(device, memory_format=fmt), y.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(x)
            loss = criterion(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm or math.inf)
        optimizer.step()
        print(
            f"| {step + 1} | {lr:.4f} | {loss.item():.4f} | {norm.item():.3g} | "
            f"{logits.detach().abs().max().item():.3g} | {time.perf_counter() - t0:.1f} |",
            flush=True,
        )
        if not math.isfinite(loss.item()):
            print(f"non-finite loss at step {step + 1}, lr {lr:.4f}")
            return


if __name__ == "__main__":
    main()
