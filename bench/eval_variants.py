"""What the evaluation-only changes do: raw weights vs the EMA, with and without flip TTA, on saved checkpoints.

    python bench/eval_variants.py --data-dir data runs/fast4/snap/end-epoch3.pt runs/fast4/snap/end-epoch4.pt
    python bench/eval_variants.py --data-dir data --recalibrate 5000 runs/fast7/snap/end-epoch3.pt

`ema_decay` and `tta_flip` change only what is evaluated, never the training steps, so one training run
measures them exactly: evaluate each of its checkpoints (raw_ddp.py --checkpoint-dir; copy checkpoint.pt at
the end of each epoch) four ways, and, for the network the run scores (its EMA, else its raw weights), with
--recalibrate 5000, with flip TTA after re-estimating its BatchNorm statistics on that many
training images (`bn_recalibration`, as the checkpoint's world size of processes does it).
One process, the whole validation set, the recipe's precision and memory layout (as the checkpoint's
recipe says), outside any clock. Prints a markdown row per checkpoint: validation loss / accuracy of the
raw weights and of the EMA, each without and with flip TTA, the numbers the run itself logged for that
epoch (the same as one of the columns when the checkpoint is an epoch's end: a check that this script
evaluates what the run did), then one column per recalibration. (Shifted views, `tta_translate`, were measured
with this script's --translate until 61300ae: docs/optimizations.md.)
"""

import argparse
from pathlib import Path

import torch

from cifar_wrn.data import load_split
from cifar_wrn.ema import recalibrated
from cifar_wrn.evaluation import tta_logits
from cifar_wrn.model import WideResNet
from cifar_wrn.pipeline import DeviceBatches
from cifar_wrn.recipe import Recipe


def network_from(state: dict, width: int, prefix: str = "") -> WideResNet:
    """A WideResNet holding `state` (an AveragedModel's state has 'module.' before each key)."""
    model = WideResNet(width=width)
    model.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    return model.eval()


@torch.no_grad()
def evaluate_variants(models: dict, val: DeviceBatches, batch_size: int, bf16: bool) -> dict:
    """{(name, flip): (mean loss, accuracy)} for each model without and with flip TTA, both through
    cifar_wrn.evaluation.tta_logits (the logits validation scores)."""
    sums = {(name, flip): torch.zeros(2, dtype=torch.float64) for name in models for flip in (False, True)}
    for start in range(0, len(val), batch_size):
        images, labels = val[torch.arange(start, min(start + batch_size, len(val)))]
        for (name, flip), total in sums.items():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = tta_logits(models[name], images, flip)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").double()
            total += torch.stack([loss, (logits.argmax(1) == labels).sum().double()])
    return {key: (s[0].item() / len(val), s[1].item() / len(val)) for key, s in sums.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--val-subset", type=int, help="only the first N validation images (tests)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--recalibrate",
        type=int,
        action="append",
        default=[],
        metavar="IMAGES",
        help="also the EMA (else raw) with flip TTA after bn_recalibration on this many training "
        "images, as the checkpoint's world size does it; repeatable",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    val_images, val_labels = load_split(args.data_dir, train=False, subset=args.val_subset)
    extra_names = [f"EMA (or raw), BN recalibrated on {n} + flip" for n in args.recalibrate]
    print(
        "| checkpoint | where | raw | raw + flip TTA | EMA | EMA + flip TTA | logged |"
        + "".join(f" {name} |" for name in extra_names)
    )
    print("|---|---|---|---|---|---|---|" + "---|" * len(extra_names))
    for path in args.checkpoints:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        recipe = ckpt["recipe"]
        models = {"raw": network_from(ckpt["model"], ckpt["model_width"])}
        if ckpt.get("ema") is not None:
            models["ema"] = network_from(ckpt["ema"], ckpt["model_width"], prefix="module.")
        if recipe["channels_last"]:
            models = {k: m.to(memory_format=torch.channels_last) for k, m in models.items()}
        val = DeviceBatches(val_images, val_labels, "cpu", augment=False, channels_last=recipe["channels_last"])
        scored = "ema" if "ema" in models else "raw"  # the network the run scores
        bf16 = recipe["precision"] == "bf16"
        result = {
            key: value
            for name, model in models.items()
            for key, value in evaluate_variants({name: model}, val, recipe["eval_batch_size"], bf16).items()
        }
        cells = [
            f"{result[name, tta][0]:.3f} / {result[name, tta][1]:.4f}" if name in models else "no EMA"
            for name in ("raw", "ema")
            for tta in (False, True)
        ]
        extra = []
        if args.recalibrate:
            train_set = DeviceBatches(
                *load_split(args.data_dir, train=True, subset=ckpt["train_images"]), "cpu", augment=False
            )
        for images in args.recalibrate:
            network = recalibrated(
                models[scored], train_set, Recipe(**{**recipe, "bn_recalibration": images}), ckpt["world_size"]
            )
            loss, accuracy = evaluate_variants({"r": network}, val, recipe["eval_batch_size"], bf16)["r", True]
            extra.append(f"{loss:.3f} / {accuracy:.4f}")
        # A checkpoint at step 0 of epoch e + 1 is the end of epoch e; its history ends with that epoch.
        logged = ckpt["history"][-1] if ckpt["history"] else None
        at_epoch_end = logged is not None and ckpt["step"] == 0 and logged["epoch"] == ckpt["epoch"]
        logged_cell = f"{logged['val_loss']:.3f} / {logged['val_accuracy']:.4f}" if at_epoch_end else "(mid-epoch)"
        where = (
            f"end of epoch {ckpt['epoch']}" if ckpt["step"] == 0 else f"epoch {ckpt['epoch'] + 1}, step {ckpt['step']}"
        )  # Progress.epoch: the next one, 0-based
        print(
            f"| {path.name} | {where} | "
            + " | ".join(cells)
            + f" | {logged_cell} |"
            + "".join(f" {cell} |" for cell in extra),
            flush=True,
        )


if __name__ == "__main__":
    main()
