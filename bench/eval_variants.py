"""What the evaluation-only changes do: raw weights vs the EMA, with and without flip TTA, on saved checkpoints.

    python bench/eval_variants.py --data-dir data runs/fast4/snap/end-epoch3.pt runs/fast4/snap/end-epoch4.pt

`ema_decay` and `tta_flip` change only what is evaluated, never the training steps, so one training run
measures them exactly: evaluate each of its checkpoints (raw_ddp.py --checkpoint-dir; copy
checkpoint.pt at the end of each epoch) four ways. One process, the whole validation set, the
recipe's precision and memory layout (as the checkpoint's recipe says), outside any clock. Prints a
markdown row per checkpoint: validation loss / accuracy of the raw weights and of the EMA, each without
and with TTA, and the accuracy the run itself logged for that epoch (the same number as one of the
four when the checkpoint is an epoch's end: a check that this script evaluates what the run did).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cifar_wrn.data import DeviceBatches, load_split  # noqa: E402
from cifar_wrn.model import WideResNet  # noqa: E402


def network_from(state: dict, width: int, prefix: str = "") -> WideResNet:
    """A WideResNet holding `state` (an AveragedModel's state has 'module.' before each key)."""
    model = WideResNet(width=width)
    model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return model.eval()


@torch.no_grad()
def four_ways(models: dict, val: DeviceBatches, batch_size: int, bf16: bool) -> dict:
    """{(name, tta): (mean loss, accuracy)} for each model, without and with flip TTA."""
    sums = {(name, tta): torch.zeros(2, dtype=torch.float64) for name in models for tta in (False, True)}
    for start in range(0, len(val), batch_size):
        images, labels = val[torch.arange(start, min(start + batch_size, len(val)))]
        for name, model in models.items():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                plain, mirrored = model(images), model(images.flip(3))
            for tta, logits in ((False, plain), (True, (plain + mirrored) / 2)):  # as cifar_wrn/data.evaluate
                loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").double()
                sums[name, tta] += torch.stack([loss, (logits.argmax(1) == labels).sum().double()])
    return {key: (s[0].item() / len(val), s[1].item() / len(val)) for key, s in sums.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--val-subset", type=int, help="only the first N validation images (tests)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    val_images, val_labels = load_split(args.data_dir, train=False, subset=args.val_subset)
    print("| checkpoint | where | raw | raw + flip TTA | EMA | EMA + flip TTA | logged |")
    print("|---|---|---|---|---|---|---|")
    for path in args.checkpoints:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        recipe = ckpt["recipe"]
        models = {"raw": network_from(ckpt["model"], ckpt["model_width"])}
        if ckpt.get("ema") is not None:
            models["ema"] = network_from(ckpt["ema"], ckpt["model_width"], prefix="module.")
        if recipe["channels_last"]:
            models = {k: m.to(memory_format=torch.channels_last) for k, m in models.items()}
        val = DeviceBatches(val_images, val_labels, "cpu", augment=False, channels_last=recipe["channels_last"])
        result = four_ways(models, val, recipe["eval_batch_size"], recipe["precision"] == "bf16")
        cells = [f"{result[name, tta][0]:.3f} / {result[name, tta][1]:.4f}" if name in models else "no EMA"
                 for name in ("raw", "ema") for tta in (False, True)]
        # A checkpoint at step 0 of epoch e + 1 is the end of epoch e; its history ends with that epoch.
        logged = ckpt["history"][-1] if ckpt["history"] else None
        at_epoch_end = logged is not None and ckpt["step"] == 0 and logged["epoch"] == ckpt["epoch"]
        logged_cell = (f"{logged['val_loss']:.3f} / {logged['val_accuracy']:.4f}" if at_epoch_end
                       else "(mid-epoch)")
        where = (f"end of epoch {ckpt['epoch']}" if ckpt["step"] == 0
                 else f"epoch {ckpt['epoch'] + 1}, step {ckpt['step']}")  # Progress.epoch: the next one, 0-based
        print(f"| {path.name} | {where} | " + " | ".join(cells) + f" | {logged_cell} |",
              flush=True)


if __name__ == "__main__":
    main()
