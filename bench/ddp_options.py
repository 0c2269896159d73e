"""Each optional optimisation of the fast recipe against the fast recipe without it, through raw_ddp.py.

    python bench/ddp_options.py --data-dir data [--num-gpus 2] [--device cpu] [--train-subset 1024] \\
        [--batch-size 64] [--epochs 2] [--rounds 2] [--model-width 160]

Runs raw_ddp.py as a user would (N processes, the real model unless --model-width says otherwise),
once per variant per round, variants interleaved so that machine noise hits all alike. Reports the
images/sec of the last epoch (the first includes warm-up) as the best over rounds, and the ratio to
the reference run (`--recipe fast` as it is) from the same invocation. Validation accuracy is not
compared here: these runs are far too short for that.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from cifar_wrn.runlog import read_log

VARIANTS = {
    "fast (reference)": [],
    "fp32 instead of bf16": ["--set", "precision=fp32"],
    "no channels_last": ["--set", "channels_last=false"],
    "DataLoader pipeline": ["--set", "data_pipeline=dataloader"],
    "EMA (decay 0.999)": ["--set", "ema_decay=0.999"],
    "DDP gradient_as_bucket_view": ["--set", "ddp_bucket_view=true"],
    "DDP static_graph": ["--set", "ddp_static_graph=true"],
    "bf16 gradient compression": ["--set", "grad_compression=bf16"],
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--train-subset", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-width", type=int, default=160)
    p.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    args = p.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if not args.only or k in args.only or k == "fast (reference)"}
    best = {name: 0.0 for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, extra in variants.items():
                log = Path(tmp) / "log.jsonl"
                cmd = [
                    sys.executable,
                    str(REPO / "raw_ddp.py"),
                    "--num-gpus",
                    str(args.num_gpus),
                    "--device",
                    args.device,
                    "--data-dir",
                    args.data_dir,
                    "--recipe",
                    "fast",
                    "--train-subset",
                    str(args.train_subset),
                    "--val-subset",
                    "100",
                    "--batch-size",
                    str(args.batch_size),
                    "--epochs",
                    str(args.epochs),
                    "--target-accuracy",
                    "1.0",
                    "--model-width",
                    str(args.model_width),
                    "--log-json",
                    str(log),
                    *extra,
                ]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                _, epochs = read_log(log)
                best[name] = max(best[name], epochs[-1]["images_per_sec"])
                print(f"  {name:30s} {epochs[-1]['images_per_sec']:10.1f} images/sec", flush=True)
    ref = best["fast (reference)"]
    print(
        f"\n# {args.num_gpus} processes, device {args.device}, width {args.model_width}, batch {args.batch_size}"
        f"/process, {args.train_subset} images, best of {args.rounds} rounds (last epoch)"
    )
    print("| variant | images/sec | vs fast |\n|---|---|---|")
    for name, rate in best.items():
        print(f"| {name} | {rate:.1f} | {rate / ref:.2f}x |")


if __name__ == "__main__":
    main()
