"""Images/sec of the two data pipelines with the same augmentation, device and thread count.

    python bench/data_pipeline.py [--data-dir data] [--device cpu|cuda] [--threads N] [--batch-size 256]

baseline: DataLoader over cifar_wrn.datasets.CIFAR10 (per-image RandomCrop + flip + normalise, collated);
          num_workers=0 on CPU (workers would take the same cores), --workers on GPU.
device:   cifar_wrn.datasets.DeviceBatches behind DataLoader(batch_size=None, sampler=BatchSampler(...)):
          the whole uint8 set on the device, one batched crop/flip/normalise per step.
seeded:   the baseline with each image augmented from its own seed (seed, epoch, index), as the trainers do
          (CIFAR10(seed=0)): what exact resumes cost, as the ratio seeded / baseline.
Both produce normalised float batches on --device; the ratio is device / baseline from the same run.
"""

import argparse
import time

import torch
from common import add_timing_flags, apply_timing_flags  # bench/common.py
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from cifar_wrn.cifar_files import dataset_present, load_split
from cifar_wrn.datasets import CIFAR10, DeviceBatches

CLOCK = time.perf_counter  # or time.process_time with --clock cpu


def images_per_sec(loader, device, batches: int) -> float:
    it = iter(loader)
    next(it)  # warm-up: worker start, first allocation
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = CLOCK()
    n = 0
    for _ in range(batches):
        x, y = next(it)
        x = x.to(device, non_blocking=True)
        n += len(y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (CLOCK() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data", help="CIFAR-10 folder; random images when it is missing")
    add_timing_flags(p)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers for the baseline on GPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--augmentation", choices=["crop_flip", "course"], default="crop_flip", help="the per-image one")
    args = p.parse_args()
    global CLOCK
    CLOCK = apply_timing_flags(args)
    device = torch.device(args.device)
    if dataset_present(args.data_dir):
        images, labels = load_split(args.data_dir, train=True)
        source = f"CIFAR-10 train split from {args.data_dir}"
    else:
        images = torch.randint(0, 256, (50_000, 3, 32, 32), dtype=torch.uint8)
        labels = torch.randint(0, 10, (50_000,))
        source = "random uint8 images (no data dir)"
    per_epoch = len(labels) // args.batch_size
    if args.batches + 1 > per_epoch:  # +1: the warm-up batch; each timing is one pass of a fresh iterator
        p.error(
            f"--batches {args.batches} plus 1 warm-up batch is more than the {per_epoch} batches of "
            f"{args.batch_size} images in one epoch of {len(labels)}: use --batches {per_epoch - 1} or fewer"
        )
    workers = args.workers if device.type == "cuda" else 0
    per_image = dict(
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
    )
    baseline = DataLoader(CIFAR10(images, labels, True, args.augmentation), **per_image)
    seeded = DataLoader(CIFAR10(images, labels, True, args.augmentation, seed=0), **per_image)
    on_device = DeviceBatches(images, labels, device, augment=True, seed=0)
    fast = DataLoader(
        on_device, batch_size=None, sampler=BatchSampler(RandomSampler(on_device), args.batch_size, drop_last=True)
    )
    print(
        f"# data pipeline: {source}; device {device}, {args.threads} threads, {args.clock} clock, "
        f"batch {args.batch_size}, {args.augmentation} per image, "
        f"{args.batches} batches x {args.repeats} repeats (best of each)"
    )
    rates = {"baseline": 0.0, "seeded": 0.0, "device": 0.0}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits all alike
        for name, loader in (("baseline", baseline), ("seeded", seeded), ("device", fast)):
            rates[name] = max(rates[name], images_per_sec(loader, device, args.batches))
    print(f"baseline DataLoader   {rates['baseline']:12.0f} images/sec")
    print(f"  per-image seeds     {rates['seeded']:12.0f} images/sec")
    print(f"ratio seeded/baseline {rates['seeded'] / rates['baseline']:12.2f}x")
    print(f"on-device pipeline    {rates['device']:12.0f} images/sec")
    print(f"ratio device/baseline {rates['device'] / rates['baseline']:12.2f}x")


if __name__ == "__main__":
    main()
