"""Collectives that are not course steps (those stay in raw_ddp.py): the ranks agree on errors, stops, training
counts and where a resume starts, so a fault on one stops all with one message (writing a checkpoint, in each
trainer's format: trainers.py)."""

import itertools
import sys

import torch
import torch.distributed as dist

from .checkpoint import attempt, resume_disagreement, resume_problem, what_was_seen
from .errors import AgreedError, UserError, agreed_problem
from .recipe import as_dict
from .resilience import preempted
from .stopping import Progress, final_line, rule_text


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather(obj) -> list:
    if not _grouped():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def together(run, action, *args, note: str | None = None):
    """action(*args); a UserError on any rank is the same AgreedError on all, said once a node."""
    result, problem = None, None
    try:
        result = action(*args)
    except UserError as exc:
        problem = str(exc)
    seen = all_gather((run.local_rank, problem))
    nodes = itertools.accumulate(local_rank == 0 for local_rank, _ in seen)  # each node's ranks start at local 0
    agreed = agreed_problem([problem and f"node {node - 1}: {problem}" for node, (_, problem) in zip(nodes, seen)])
    if agreed:
        raise AgreedError(agreed, run.local_rank == 0, note)
    return result


def agree_on_flags(flags: torch.Tensor) -> None:
    if _grouped():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)


def buffers_from_rank_0(module: torch.nn.Module) -> None:
    """BatchNorm statistics end an epoch a step apart: every rank evaluates rank 0's."""
    if _grouped():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def training_counts(run, progress: Progress, correct: torch.Tensor, step_end: int) -> dict:
    """All ranks' training images this epoch to `step_end` (a resumed part included), and those right."""
    images = (step_end - progress.step) * run.recipe.batch_size
    counts = torch.stack([correct, torch.tensor(images, device=correct.device)])
    if _grouped():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, images = counts.tolist()
    return {"train_correct": progress.train_correct + correct, "train_seen": progress.train_seen + images}


def resume(run, checkpoints) -> Progress | None:
    """Where this run starts: afresh, at the checkpoint all ranks agree on, or None (it had finished, and the rule
    in force leaves nothing to train: said, with the course's last line). A refusal: one line, one rank a node.
    `checkpoints`: cli.Checkpoints."""
    if checkpoints.resume is None:
        return Progress()
    recipe = run.recipe
    where, saved, problem = run.trainer.read(checkpoints.directory, checkpoints.resume == "required")
    if saved is not None:
        problem = resume_problem(saved, as_dict(recipe), run.world_size, run.model_width, run.data.sizes())
        problem = problem or attempt(run.trainer.restore, run, where, saved)
    problem = resume_disagreement(all_gather((what_was_seen(saved), problem)))
    if problem:  # the same on every rank: one line, from local rank 0 of each node, said before any rank exits
        # (a launcher ends the other ranks at the first exit: a line said after the teardown could be lost)
        refusal = f"cannot resume from {where}: {problem}"
        if run.local_rank == 0:
            print(f"error: {refusal}", file=sys.stderr, flush=True)
        all_gather(None)
        raise AgreedError(refusal, shown=False)
    if saved is None:
        return Progress()
    progress = Progress.of(saved)
    # the rule in force decides, also for a run that had stopped early under the one of its time
    nothing_left = saved["finished"] and not progress.epochs_left(recipe)
    if run.is_main:
        print(
            f"Resuming from {where}: epoch {progress.epoch + 1}, step {progress.step} of {run.data.steps_per_epoch}, "
            f"Cumulative Time = {progress.cumulative_time:.3f}",
            flush=True,
        )
        if nothing_left:
            print(f"Nothing to do: that run had already finished\n{final_line(progress, recipe)}", flush=True)
        elif saved["finished"]:
            print(
                f"That run had stopped early after epoch {progress.epoch} ({rule_text(saved['recipe'])}); under the "
                f"rule now in force ({rule_text(as_dict(recipe))}) it trains on",
                flush=True,
            )
    return None if nothing_left else progress


def save_checkpoint(run, progress: Progress, directory, finished: bool = False) -> str:
    """Everything needed to continue at `progress`, in the trainer's format; a failed write stops every rank, the
    previous checkpoint whole."""
    return run.trainer.save(run, progress, directory, finished)


def save_and_stop(run, progress: Progress, step: int, correct, seconds: float, directory):
    """A stop signal reached every rank at `step`: checkpoint (if `directory`), then stop (exit 75)."""
    at = progress.mid_epoch(step + 1, seconds, **training_counts(run, progress, correct, step + 1))
    raise preempted(progress.epoch, step, directory and save_checkpoint(run, at, directory))
