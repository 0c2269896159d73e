"""See one DDP step at work: 2 processes on this machine's CPU (gloo), each printing what it sees. docs/tutorial.md.

    python course/steps.py sampler              # R1.5 with the step: every rank its own images
    python course/steps.py sampler --without    # the same program without it: what repeats or breaks

The steps: spawn (R1.11, R1.2, R1.7), group (R1.3), barrier (R1.4), sampler (R1.5), set-epoch (R1.6), ddp (R1.8),
reduce (R1.9), print (R1.10).
"""

import argparse
import gc
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, RandomSampler


def say(rank, text):
    os.write(1, f"[rank {rank}] {text}\n".encode())  # one write: the two processes' lines never mix


def spawn(rank, world_size, without):
    say(rank, f"process {os.getpid()}: local_rank {rank}, rank {rank} of world_size {world_size}, device cpu")


def group(rank, world_size, without):
    if without:  # rank 1 is told another port: it waits there for a group that never forms
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + rank)
    say(rank, f"joining at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=5))
    except dist.DistError as exc:
        say(rank, f"no group after 5 s: {type(exc).__name__}")
        return
    say(rank, f"in the group: rank {dist.get_rank()} of {dist.get_world_size()}")


def barrier(rank, world_size, without):
    data = Path(os.environ["STEPS_DIR"], "data.txt")
    if rank == 0:
        time.sleep(2)  # rank 0 "downloads" for 2 s
        data.write_text("CIFAR-10")
        say(rank, f"downloaded {data.name}")
    if not without:
        dist.barrier()  # R1.4 every rank waits here until rank 0 arrives, the file written
    say(rank, f"reads {data.name}: {data.read_text() if data.exists() else 'MISSING, not there yet'}")


def sampler(rank, world_size, without):
    images = range(16)
    if without:  # a plain shuffle with the same seed on every rank: each trains on the same images
        order = RandomSampler(images, generator=torch.Generator().manual_seed(0))
    else:
        order = DistributedSampler(images, num_replicas=world_size, rank=rank, shuffle=True, seed=0)  # R1.5
    say(rank, f"trains on images {sorted(order)}")


def set_epoch(rank, world_size, without):
    order = DistributedSampler(range(16), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    for epoch in range(3):
        if not without:
            order.set_epoch(epoch)  # R1.6
        say(rank, f"epoch {epoch}: images in the order {list(order)}")


def ddp(rank, world_size, without):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(4, 1)
    if not without:
        model = DDP(model)  # R1.8 the backward all-reduces (averages) the gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)  # each rank its own batch
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    weights = sum(p.sum() for p in model.parameters()).item()
    say(rank, f"loss {loss.item():.4f}; after the step, the sum of the weights {weights:.6f}")


def reduce(rank, world_size, without):
    images_per_sec, accuracy = torch.tensor(100.0 + rank), torch.tensor(0.80 + 0.02 * rank)
    say(rank, f"its own: images/sec {images_per_sec.item():.1f}, accuracy {accuracy.item():.3f}")
    if without:
        return
    dist.reduce(images_per_sec, dst=0, op=dist.ReduceOp.SUM)  # R1.9 the sum, on rank 0 only
    if torch.__version__ < "2.8":  # gloo's AVG came with torch 2.8: before it, the sum divided by the ranks
        dist.all_reduce(accuracy, op=dist.ReduceOp.SUM)  # R1.9
        accuracy /= world_size  # R1.9
    else:
        dist.all_reduce(accuracy, op=dist.ReduceOp.AVG)  # R1.9 the mean, on every rank
    dist.barrier()  # (only so that the lines below come after every rank's line above)
    rate = f"{images_per_sec.item():.1f} " + ("(the sum)" if rank == 0 else "(its own: reduce gives the sum to rank 0)")
    say(rank, f"after: images/sec {rate}, accuracy {accuracy.item():.3f} (the mean)")


def print_once(rank, world_size, without):
    if without or rank == 0:  # R1.10
        say(rank, "Epoch =  1: Validation Accuracy = 0.412")


STEPS = {"spawn": spawn, "group": group, "barrier": barrier, "sampler": sampler, "set-epoch": set_epoch}
STEPS.update(ddp=ddp, reduce=reduce, print=print_once)


def process(rank, step, world_size, without):
    torch.set_num_threads(1)
    if step != "group":  # group shows init_process_group itself
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    STEPS[step](rank, world_size, without)
    gc.collect()  # a DDP model is freed (its reference cycle) before the group it uses
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--without", action="store_true", help="leave the step out")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for this demo's group
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    os.environ["STEPS_DIR"] = tempfile.mkdtemp()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # group --without: c10d's own retries, not shown
    if args.step == "spawn" and args.without:  # no spawn: this one process is the whole run, rank 0 of 1
        process(0, args.step, 1, args.without)
    else:
        mp.spawn(process, args=(args.step, 2, args.without), nprocs=2)  # R1.11
