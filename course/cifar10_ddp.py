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
import os  # R1.3 MASTER_ADDR, MASTER_PORT
import time

import torch
import torch._dynamo  # noqa: F401  # beyond R1: now, not at the first step: imported after the group, it can abort the exit
import torch.distributed as dist  # R1.3 the process group; R1.4, R1.9 its collectives
import torch.multiprocessing as mp  # R1.11
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # R1.8
from torch.utils.data import DataLoader, DistributedSampler  # R1.5

from cifar_wrn.cifar_files import DataError, download_cifar10, load_split
from cifar_wrn.datasets import CIFAR10  # pip install -e . (README)
from cifar_wrn.model import WideResNet  # the course's model, class for class


def parse_args():
    parser = argparse.ArgumentParser(description="The course's WideResNet on CIFAR-10, one process per GPU")  # R1.1
    # R1.1 the command line: how many nodes, which one this is, how many GPUs (processes) on each
    parser.add_argument("--num-nodes", type=int, default=1, help="machines taking part (default 1)")  # R1.1
    parser.add_argument("--node-id", type=int, default=0, help="this machine's index, 0 .. num-nodes-1")  # R1.1
    parser.add_argument("--num-gpus", type=int, default=1, help="processes on this machine, one per GPU")  # R1.1
    parser.add_argument("--master-addr", default="localhost", help="node 0's address (R1.3)")  # R1.3
    port = "a free TCP port on node 0 (R1.3); two jobs on one node need two (the course_* jobs give each its own)"
    parser.add_argument("--master-port", type=int, default=29500, help=port)  # R1.3
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


def main(local_rank, args):  # R1.11 mp.spawn calls it in each process with its local_rank 0 .. num_gpus-1
    # R1.2 world size and global rank: node 0 holds ranks 0 .. num_gpus-1, node 1 the next ones, ...
    world_size = args.num_nodes * args.num_gpus  # R1.2
    rank = args.node_id * args.num_gpus + local_rank  # R1.2
    # R1.7 one GPU per process: cuda:<local_rank>, chosen before any CUDA work
    if torch.cuda.is_available():
        device, backend = torch.device(f"cuda:{local_rank}"), "nccl"  # R1.7; R1.3 nccl between GPUs
        torch.cuda.set_device(device)  # R1.7
    else:
        device, backend = torch.device("cpu"), "gloo"  # R1.3 gloo between CPU processes
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.num_gpus))  # beyond R1: cores shared
    # R1.3 init_process_group: every process meets the others at node 0's address and port (init_method env://)
    os.environ["MASTER_ADDR"] = args.master_addr  # R1.3
    os.environ["MASTER_PORT"] = str(args.master_port)  # R1.3
    dist.init_process_group(backend, rank=rank, world_size=world_size)  # R1.3

    # The data: CIFAR-10's python archive in <data-dir>/cifar-10-batches-py/, downloaded if it is not there.
    # The course's augmentation: flip, rotation, shear and scale, colour jitter (CIFAR10 with augmentation="course").
    # R1.4 one process per node downloads; the others wait at the barrier until the files are there
    if local_rank == 0:  # R1.4
        download_cifar10(args.data_dir)  # R1.4
    dist.barrier()  # R1.4
    try:
        train_set = CIFAR10(*load_split(args.data_dir, True, args.train_subset), True, "course", "course", args.seed)
        val_set = CIFAR10(*load_split(args.data_dir, False, args.val_subset), False, "course", "course")
    except DataError as exc:  # no data, or a damaged file: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
    workers = 4 if device.type == "cuda" else 0  # augmenting on the CPU while the GPU trains
    # The loaders draw their seeds (shuffle, workers) from a stream of their own, apart from dropout's.
    loader_rng = torch.Generator().manual_seed(args.seed + rank)  # beyond R1: each rank's workers their own seeds
    # R1.5 DistributedSampler: each rank a disjoint 1/world_size of the images (shuffled, or in order)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed),  # R1.5
        drop_last=True,  # every step a full batch
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=loader_rng,
    )
    val_sampler = DistributedSampler(val_set, shuffle=False)  # R1.5
    val_loader = DataLoader(val_set, batch_size=500, sampler=val_sampler, num_workers=workers, generator=loader_rng)

    # The model: the same seed gives the same initial weights.
    torch.manual_seed(args.seed)
    model = WideResNet(width=args.model_width).to(device)
    # R1.8 DistributedDataParallel: each backward all-reduces the gradients, so every rank takes the same step
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)  # R1.8
    loss_fn = nn.CrossEntropyLoss()
    lr = args.base_lr * world_size  # beyond R1: the linear scaling rule, world_size x the images per step
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    torch.manual_seed(args.seed + rank)  # beyond R1: each rank its own dropout

    val_accuracies, total_time = [], 0.0
    for epoch in range(args.epochs):
        train_set.set_epoch(epoch)  # each image augmented from a seed of its own: (seed, epoch, image index)
        train_loader.sampler.set_epoch(epoch)  # R1.6 set_epoch: a new shuffle every epoch, the same on every rank
        t0 = time.time()
        train_accuracy = train(model, optimizer, train_loader, loss_fn, device)
        epoch_time = time.time() - t0
        total_time += epoch_time
        # R1.9 images/sec: the ranks' rates add up (dist.reduce SUM, to rank 0)
        images_per_sec = torch.tensor(len(train_loader) * args.batch_size / epoch_time, device=device)  # R1.9
        dist.reduce(images_per_sec, dst=0, op=dist.ReduceOp.SUM)  # R1.9

        val_loss, val_accuracy = test(model, val_loader, loss_fn, device)
        # R1.9 all_reduce(AVG): every rank gets the mean of the ranks' numbers. Exact only when every rank holds as
        # many validation images: DistributedSampler pads a short shard with repeats (raw_ddp.py sums, exact always)
        metrics = torch.tensor([train_accuracy, val_loss, val_accuracy], dtype=torch.float64, device=device)  # R1.9
        if backend == "gloo" and torch.__version__ < "2.8":  # R1.9 gloo's AVG came with torch 2.8: SUM, then divide
            dist.all_reduce(metrics, op=dist.ReduceOp.SUM)  # R1.9
            metrics /= world_size  # R1.9
        else:
            dist.all_reduce(metrics, op=dist.ReduceOp.AVG)  # R1.9
        train_accuracy, val_loss, val_accuracy = metrics.tolist()  # R1.9
        val_accuracies.append(val_accuracy)

        if rank == 0:  # R1.10 only rank 0 prints: one line per epoch, not one per process
            print(
                f"Epoch = {epoch + 1:2d}: Cumulative Time = {total_time:.3f}, Epoch Time = {epoch_time:.3f}, "
                f"Images/sec = {images_per_sec:.1f}, Training Accuracy = {train_accuracy:.3f}, "
                f"Validation Loss = {val_loss:.3f}, Validation Accuracy = {val_accuracy:.3f}",
                flush=True,
            )

        # Early stopping: the target reached `patience` epochs in a row.
        recent = val_accuracies[-args.patience :]
        if len(recent) == args.patience and all(a >= args.target_accuracy for a in recent):
            if rank == 0:  # R1.10
                print(f"Early stopping after epoch {epoch + 1}", flush=True)  # R1.10
            break  # every rank: they all hold the same averaged accuracies

    dist.destroy_process_group()  # R1.3 leave the group


if __name__ == "__main__":  # R1.11 only the launching process runs this; the spawned ones import the file
    args = parse_args()
    # R1.11 torch.multiprocessing.spawn: one process per GPU on this node, each runs main(local_rank, args)
    try:
        mp.spawn(main, args=(args,), nprocs=args.num_gpus)  # R1.11
    except mp.ProcessExitedException as exc:  # R1.11 a rank stopped with an error line of its own: no traceback
        raise SystemExit(exc.exit_code) from None
