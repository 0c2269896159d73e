"""The course's WideResNet on CIFAR-10. course/cifar10.py trains it in one process on one GPU (or the CPU);
course/cifar10_ddp.py is the same file with the course's eleven DDP steps added, each tagged `# R1.<n>`:
`diff course/cifar10.py course/cifar10_ddp.py` is the lesson (docs/tutorial.md), raw_ddp.py the hardened trainer.

    python course/cifar10.py --data-dir data
    python course/cifar10_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --data-dir data

    # 2 nodes x 4 GPUs: the same command on each node, only --node-id differs; --master-addr is node 0's address.
    # On a disk both nodes share, put the data in data/ first: each node's local rank 0 would download into it.
    python course/cifar10_ddp.py --num-nodes 2 --node-id 0 --num-gpus 4 --master-addr node0 --data-dir data
    python course/cifar10_ddp.py --num-nodes 2 --node-id 1 --num-gpus 4 --master-addr node0 --data-dir data

Both stop once validation accuracy reaches --target-accuracy for --patience epochs in a row. Without a GPU,
cifar10_ddp.py's --num-gpus is the number of CPU processes (gloo, whose ReduceOp.AVG needs torch 2.8: before it,
the script sums and divides).
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from cifar_wrn.cifar_files import DataError, download_cifar10, load_split
from cifar_wrn.datasets import CIFAR10  # pip install -e . (README)
from cifar_wrn.model import WideResNet  # the course's model, class for class


def parse_args():
    parser = argparse.ArgumentParser(description="The course's WideResNet on CIFAR-10, on one GPU")
    parser.add_argument("--data-dir", default="data", help="folder holding cifar-10-batches-py/ (default ./data)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per step (default 32)")
    parser.add_argument("--epochs", type=int, default=40, help="at most this many epochs (default 40)")
    parser.add_argument("--base-lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    parser.add_argument("--target-accuracy", type=float, default=0.85, help="validation accuracy to reach")
    parser.add_argument("--patience", type=int, default=2, help="epochs in a row at the target, then stop")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    # for the tests only: a few images and a narrow model (help hidden)
    parser.add_argument("--train-subset", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--val-subset", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-width", type=int, default=160, help=argparse.SUPPRESS)
    return parser.parse_args()


def train(model, optimizer, train_loader, loss_fn, device):
    """One epoch; returns the training accuracy (predictions made before each step)."""
    model.train()
    correct, seen = torch.zeros((), dtype=torch.int64, device=device), 0  # summed on the device: no wait per step
    for images, labels in train_loader:
        images, labels = images.to(device), labels.to(device)
        outputs = model(images)  # forward pass
        loss = loss_fn(outputs, labels)
        optimizer.zero_grad()
        loss.backward()  # backward pass: the gradients
        optimizer.step()  # update the weights
        correct += (outputs.argmax(1) == labels).sum()
        seen += len(labels)
    return correct.item() / seen


def test(model, val_loader, loss_fn, device):
    """Validation loss and accuracy: a mean over the images (not over the batches, whose last may be smaller)."""
    model.eval()
    loss_sum, correct, seen = torch.zeros((), dtype=torch.float64, device=device), 0, 0
    with torch.no_grad():
        for images, labels in val_loader:
            images, labels = images.to(device), labels.to(device)
            outputs = model(images)
            loss_sum += loss_fn(outputs, labels).double() * len(labels)
            correct += (outputs.argmax(1) == labels).sum()
            seen += len(labels)
    return loss_sum.item() / seen, correct.item() / seen


def main(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # The data: CIFAR-10's python archive in <data-dir>/cifar-10-batches-py/, downloaded if it is not there.
    # The course's augmentation: flip, rotation, shear and scale, colour jitter (CIFAR10 with augmentation="course").
    download_cifar10(args.data_dir)
    try:
        train_set = CIFAR10(*load_split(args.data_dir, True, args.train_subset), True, "course", "course", args.seed)
        val_set = CIFAR10(*load_split(args.data_dir, False, args.val_subset), False, "course", "course")
    except DataError as exc:  # no data, or a damaged file: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
    workers = 4 if device.type == "cuda" else 0  # augmenting on the CPU while the GPU trains
    # The loaders draw their seeds (shuffle, workers) from a stream of their own, apart from dropout's.
    loader_rng = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,  # every step a full batch
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=loader_rng,
    )
    val_loader = DataLoader(val_set, batch_size=500, num_workers=workers, generator=loader_rng)

    # The model: the same seed gives the same initial weights.
    torch.manual_seed(args.seed)
    model = WideResNet(width=args.model_width).to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9)
    torch.manual_seed(args.seed)  # dropout draws from here on

    val_accuracies, total_time = [], 0.0
    for epoch in range(args.epochs):
        train_set.set_epoch(epoch)  # each image augmented from a seed of its own: (seed, epoch, image index)
        t0 = time.time()
        train_accuracy = train(model, optimizer, train_loader, loss_fn, device)
        epoch_time = time.time() - t0
        total_time += epoch_time
        images_per_sec = len(train_loader) * args.batch_size / epoch_time

        val_loss, val_accuracy = test(model, val_loader, loss_fn, device)
        val_accuracies.append(val_accuracy)

        print(
            f"Epoch = {epoch + 1:2d}: Cumulative Time = {total_time:.3f}, Epoch Time = {epoch_time:.3f}, "
            f"Images/sec = {images_per_sec:.1f}, Training Accuracy = {train_accuracy:.3f}, "
            f"Validation Loss = {val_loss:.3f}, Validation Accuracy = {val_accuracy:.3f}",
            flush=True,
        )

        # Early stopping: the target reached `patience` epochs in a row.
        recent = val_accuracies[-args.patience :]
        if len(recent) == args.patience and all(a >= args.target_accuracy for a in recent):
            print(f"Early stopping after epoch {epoch + 1}", flush=True)
            break


if __name__ == "__main__":
    args = parse_args()
    main(args)
