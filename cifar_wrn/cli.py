"""The command-line flags both entry points share (data, recipe, outputs, checkpoints, profiling).

Launch flags differ between the two and stay in each entry point: raw_ddp.py has --num-nodes,
--node-id, --num-gpus and the rendezvous (R1.1); accel_train.py leaves them to `accelerate launch`.
"""
import argparse

from .model import COURSE_WIDTH
from .recipe import Recipe, load_recipe, parse_set

# Flags that are recipe keys: given on the command line they override the recipe file.
RECIPE_FLAGS = ("epochs", "batch_size", "base_lr", "target_accuracy", "patience", "seed")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py/ (default ./data)")
    p.add_argument("--recipe", default="baseline", help="recipe name in recipes/ or a YAML path (default baseline)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one recipe key, e.g. --set momentum=0.9 (repeatable)")
    p.add_argument("--epochs", type=int, help="maximum epochs (recipe: 40)")
    p.add_argument("--batch-size", type=int, help="images per process per step (recipe: 32)")
    p.add_argument("--base-lr", type=float, help="learning rate at the reference batch size (recipe: 0.01)")
    p.add_argument("--target-accuracy", type=float, help="validation accuracy to reach (recipe: 0.85)")
    p.add_argument("--patience", type=int, help="consecutive epochs at the target before stopping (recipe: 2)")
    p.add_argument("--seed", type=int, help="random seed (recipe: 0)")
    p.add_argument("--save", metavar="PATH", help="write the final weights (plain WideResNet state_dict)")
    p.add_argument("--log-json", metavar="PATH", help="write a JSON-lines log: a header, then one object per epoch")
    p.add_argument("--train-subset", type=int, metavar="N", help="train on the first N images only")
    p.add_argument("--val-subset", type=int, metavar="N", help="validate on the first N images only")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write a checkpoint into DIR after every epoch and on SIGUSR1/SIGTERM (a folder every "
                        "node sees)")
    p.add_argument("--resume", action="store_true", help="continue from DIR's checkpoint; fail if there is none")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue from DIR's checkpoint if it exists, else start fresh (for requeued jobs)")
    p.add_argument("--profile", action="store_true",
                   help="per epoch: time in data, forward, backward, optimizer, and an all-reduce cost estimate")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler trace of steps 3-5 (TensorBoard/Perfetto)")
    p.add_argument("--model-width", type=int, default=COURSE_WIDTH,
                   help=f"tests only: first block width (default {COURSE_WIDTH}, the course model; never change it "
                        f"in a real run)")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe file, then --set KEY=VALUE, then the dedicated flags (--epochs, ...), validated."""
    overrides = parse_set(args.set)
    overrides.update({flag: getattr(args, flag) for flag in RECIPE_FLAGS if getattr(args, flag) is not None})
    return load_recipe(args.recipe, overrides)
