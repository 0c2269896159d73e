"""Host synchronisations per training step, counted with torch.cuda.set_sync_debug_mode("warn").

    python bench/sync_count.py --set batch_size=256             # fast.yaml as the GPU sessions run it
    python bench/sync_count.py --recipe fast --steps 20 --set ema_decay=0   # without the EMA

A host synchronisation makes the CPU wait for the GPU, so the next step's kernels are queued late. This runs
raw_ddp.py's training step in one process (world size 1: a real process group, so DDP's hooks and StepGuard's
all-reduce run as in a run), the real WideResNet and the recipe's own optimizer, scheduler, EMA and on-device
batches (random uint8 images: their content changes no synchronisation). After --warmup steps, each phase of
--steps steps runs with warnings recorded; every "synchronizing CUDA operation" warning is counted against its
phase and its source line. StepGuard's agreement every 10 steps and at an epoch's end reads its flags by
design (a stop signal must be seen); everything else is a candidate for removal.
On the CPU (--device cpu) nothing is counted (sync debug mode is CUDA's): a smoke test of the script itself.
"""

import argparse
import collections
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from cifar_wrn.datasets import DeviceBatches
from cifar_wrn.ema import build_ema
from cifar_wrn.errors import UserError
from cifar_wrn.launchers import free_port
from cifar_wrn.loaders import SkipFirst
from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_optimizer, build_scheduler, scaled_lr
from cifar_wrn.recipe import load_recipe, parse_set
from cifar_wrn.resilience import StepGuard

REPO = Path(__file__).resolve().parent.parent
PHASES = ("data", "forward", "backward", "clip", "optimizer", "scheduler", "ema", "guard")


class SyncCounter:
    """Runs a phase with warnings recorded and counts the synchronisation warnings per phase and source line."""

    def __init__(self):
        self.counts, self.sources = collections.Counter(), collections.defaultdict(collections.Counter)

    def __call__(self, phase: str, fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
        for w in caught:
            if "synchroniz" in str(w.message):
                self.counts[phase] += 1
                where = Path(w.filename)
                where = where.relative_to(REPO) if where.is_relative_to(REPO) else Path(*where.parts[-2:])
                self.sources[phase][f"{where}:{w.lineno}"] += 1
        return result


def training_step(recipe, device, model_width: int):
    """raw_ddp.py's step (data, forward, backward, clip, optimizer, scheduler, EMA, StepGuard), phase by phase."""
    torch.manual_seed(recipe.seed)
    memory_format = torch.channels_last if recipe.channels_last else torch.contiguous_format
    raw_model = WideResNet(width=model_width).to(device, memory_format=memory_format)
    torch.backends.cudnn.benchmark = recipe.cudnn_benchmark
    model = DDP(
        raw_model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=recipe.ddp_bucket_view,
        static_graph=recipe.ddp_static_graph,
    )
    eval_model = raw_model if recipe.ema_decay == 0 else build_ema(raw_model, recipe.ema_decay)
    images = torch.randint(0, 256, (recipe.batch_size * 8, 3, 32, 32), dtype=torch.uint8)
    data = DeviceBatches(
        images,
        torch.randint(0, 10, (len(images),)),
        device,
        augment=recipe.augment,
        channels_last=recipe.channels_last,
    )
    # as raw_ddp.py's: the epoch's batches go to the device in one copy (SkipFirst over a DistributedSampler)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=recipe.seed)
    loader = DataLoader(data, batch_size=None, sampler=SkipFirst(BatchSampler(sampler, recipe.batch_size, True)))
    steps_per_epoch = len(loader)
    optimizer = build_optimizer(raw_model, recipe, scaled_lr(recipe, recipe.batch_size))
    scheduler = build_scheduler(optimizer, recipe, steps_per_epoch)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=recipe.precision == "bf16")
    guard, batches, count = StepGuard(0, 1, device), iter(()), 0

    def step(sync: SyncCounter):
        nonlocal batches, count
        try:
            images, labels = sync("data", lambda: next(batches))
        except StopIteration:
            batches = iter(loader)
            images, labels = sync("data", lambda: next(batches))
        images, labels = sync(
            "data",
            lambda: (
                images.to(device, non_blocking=True, memory_format=memory_format),
                labels.to(device, non_blocking=True),
            ),
        )
        with torch.autocast(**autocast):
            loss = sync("forward", lambda: criterion(model(images), labels))
        sync("backward", lambda: (optimizer.zero_grad(set_to_none=True), loss.backward()))
        if recipe.grad_clip_norm:
            sync("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm))
        sync("optimizer", optimizer.step)
        sync("scheduler", scheduler.step)
        if eval_model is not raw_model:
            sync("ema", lambda: eval_model.update_parameters(raw_model))
        sync(
            "guard",
            lambda: guard.check(
                loss,
                0,
                count % steps_per_epoch,
                steps_per_epoch,
                lambda flags: dist.all_reduce(flags, op=dist.ReduceOp.MAX),
            ),
        )
        count += 1

    return step


def report(sync: SyncCounter, steps: int, device) -> str:
    lines = [
        f"# host synchronisations over {steps} steps ({device}; torch {torch.__version__})",
        "| phase | per step | where (file:line, count) |",
        "|---|---|---|",
    ]
    for phase in PHASES:
        where = ", ".join(f"{source} x{n}" for source, n in sync.sources[phase].most_common())
        lines.append(f"| {phase} | {sync.counts[phase] / steps:g} | {where or '–'} |")
    lines.append(f"| all | {sum(sync.counts.values()) / steps:g} | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="fast")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    p.add_argument("--steps", type=int, default=20, help="counted steps (default 20: two StepGuard agreements)")
    p.add_argument("--warmup", type=int, default=5, help="uncounted steps first (cuDNN autotuning, the EMA's copy)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-width", type=int, default=160, help="WideResNet width (160: the course model)")
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, parse_set(args.set))
        if args.steps < 1 or args.warmup < 0:
            raise UserError(f"--steps must be >= 1 and --warmup >= 0 (got {args.steps}, {args.warmup})")
        if recipe.data_pipeline != "device":
            raise UserError("sync_count.py feeds the on-device pipeline only (data_pipeline: device)")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        step = training_step(recipe, device, args.model_width)
        for _ in range(args.warmup):
            step(SyncCounter())
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        sync = SyncCounter()
        for _ in range(args.steps):
            step(sync)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        print(report(sync, args.steps, device))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
