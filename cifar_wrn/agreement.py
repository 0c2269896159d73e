"""Collectives that are not course steps (those stay in raw_ddp.py): the ranks agree on errors, stops and training
counts, so a fault on one stops all with one message (and on a resume's checkpoint: checkpoints.Checkpointer)."""

import itertools

import torch
import torch.distributed as dist

from .errors import AgreedError, UserError, agreed_problem


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather(obj) -> list:
    if not _grouped():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_or_none(local_rank: int, action, *args, note: str | None = None):
    """action(*args); a UserError on any rank is the same AgreedError on all, said once a node."""
    result, problem = None, None
    try:
        result = action(*args)
    except UserError as exc:
        problem = str(exc)
    seen = all_gather((local_rank, problem))
    nodes = itertools.accumulate(local == 0 for local, _ in seen)  # each node's ranks start at local 0
    agreed = agreed_problem([problem and f"node {node - 1}: {problem}" for node, (_, problem) in zip(nodes, seen)])
    if agreed:
        raise AgreedError(agreed, local_rank == 0, note)
    return result


def agree_on_flags(flags: torch.Tensor) -> None:
    if _grouped():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)


def buffers_from_rank_0(module: torch.nn.Module) -> None:
    """BatchNorm statistics end an epoch a step apart: every rank evaluates rank 0's."""
    if _grouped():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def training_counts(progress, correct: torch.Tensor, step_end: int, batch_size: int) -> dict:
    """All ranks' training images this epoch to `step_end` (a resumed part included), and those right.
    `progress`: stopping.Progress."""
    images = (step_end - progress.step) * batch_size
    counts = torch.stack([correct, torch.tensor(images, device=correct.device)])
    if _grouped():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, images = counts.tolist()
    return {"train_correct": progress.train_correct + correct, "train_seen": progress.train_seen + images}
