"""The collectives that are not course steps, in one place: every rank agrees on errors, stops and checkpoints.

The course's own collectives (R1.3-R1.9) stay in raw_ddp.py, by hand; this module is the plumbing around them, so
that a fault on one rank stops every rank with one message instead of leaving the others waiting. It uses
torch.distributed's default group, which raw_ddp.py forms and Accelerate forms for accel_train.py; without one
(a single process) each call is its one-process answer.
"""

import os

import torch
import torch.distributed as dist

from .checkpoint import (
    accel_state,
    checkpoint_path,
    raw_state,
    read_accel_for_resume,
    read_for_resume,
    restore_accel,
    restore_raw,
    resume_disagreement,
    resume_problem,
    resuming_line,
    what_was_seen,
    write_folder,
)
from .errors import AgreedError, UserError, agreed_problem
from .recipe import as_dict
from .resilience import preempted
from .runlog import Progress
from .safe_files import attempt, fresh_folder, latest_checkpoint, publish_checkpoint, save_atomic, stop_unless_written


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _grouped():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def together(shown: bool, action, *args, note: str | None = None):
    """action(*args) on every rank; if it raises a UserError on any rank, every rank raises the same AgreedError
    (said by the `shown` process of each node, with `note`): one rank alone would leave the others waiting."""
    result, problem = None, None
    try:
        result = action(*args)
    except UserError as exc:
        problem = str(exc)
    agreed = agreed_problem(all_gather(problem))
    if agreed:
        raise AgreedError(agreed, shown, note)
    return result


def agree_on_flags(flags: torch.Tensor) -> None:
    """The StepGuard's flags (stop signal, non-finite losses, step times), the maximum over the ranks, in place."""
    if _grouped():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)


def buffers_from_rank_0(module: torch.nn.Module) -> None:
    """BatchNorm statistics end an epoch a step apart on each rank: every rank evaluates rank 0's."""
    if _grouped():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def training_counts(run, progress: Progress, correct: torch.Tensor, step_end: int) -> dict:
    """This epoch's training images to `step_end`, every rank's (a resumed part included), and those right."""
    images = (step_end - progress.step) * run.recipe.batch_size
    counts = torch.stack([correct, torch.tensor(images, device=correct.device)])
    if _grouped():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    correct, images = counts.tolist()
    return {"train_correct": progress.train_correct + correct, "train_seen": progress.train_seen + images}


# ---- checkpoints: raw_ddp.py writes DIR/checkpoint.pt from rank 0; accel_train.py save_state folders


def resume(args, recipe, run) -> Progress | None:
    """Where this run starts: a fresh Progress, the checkpoint's, or None when that run had finished. Every rank
    reads the checkpoint and they agree on it; any rank's problem stops them all."""
    if not (args.resume or args.auto_resume):
        return Progress()
    if run.accelerator is None:
        where, (saved, problem) = (
            checkpoint_path(args.checkpoint_dir),
            read_for_resume(args.checkpoint_dir, args.resume),
        )
    else:
        where, saved, problem = read_accel_for_resume(args.checkpoint_dir, args.resume)
        where = where or args.checkpoint_dir
    if saved is not None:
        problem = resume_problem(saved, as_dict(recipe), run.world_size, run.model_width, run.data.sizes())
        if run.accelerator is None:
            problem = problem or attempt(restore_raw, saved, run)
        else:
            restore = (run.accelerator, where, saved, run.device.type, run.ema, run.data.generator)
            problem = problem or attempt(restore_accel, *restore)
    problem = resume_disagreement(all_gather((what_was_seen(saved), problem)))
    if problem:
        raise UserError(f"cannot resume from {where}: {problem}")
    if saved is None:
        return Progress()
    progress = Progress.of(saved)
    if run.is_main:
        print(resuming_line(where, progress, run.data.steps_per_epoch, saved["finished"]), flush=True)
    return None if saved["finished"] else progress


def save_checkpoint(args, recipe, run, progress: Progress, finished: bool = False) -> str:
    """Everything needed to continue at `progress`, written so that a crash leaves the previous checkpoint whole;
    every rank waits for it and stops if it failed. Returns where it is."""
    if run.accelerator is None:
        return _save_raw(args, recipe, run, progress, finished)
    return _save_accel(args, recipe, run, progress, finished)


def _rank_rng(run) -> dict:
    """This rank's random streams (torch, CUDA, the device pipeline's)."""
    generator = run.data.generator
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None,
        "pipeline": None if generator is None else generator.get_state(),
    }


def _save_raw(args, recipe, run, progress: Progress, finished: bool) -> str:
    """Rank 0 writes DIR/checkpoint.pt, with every rank's random streams gathered to it."""
    every_rng = [None] * run.world_size if run.is_main and _grouped() else None
    if _grouped():
        dist.gather_object(_rank_rng(run), every_rng, dst=0)
    else:
        every_rng = [_rank_rng(run)]
    path, outcome = checkpoint_path(args.checkpoint_dir), [None]
    if run.is_main:
        state = raw_state(run, progress, finished, every_rng, as_dict(recipe), run.model_width)
        outcome = [attempt(save_atomic, state, path)]
    if _grouped():
        dist.broadcast_object_list(outcome, src=0)  # also the barrier
    stop_unless_written(outcome, args.checkpoint_dir)
    return str(path)


def _save_accel(args, recipe, run, progress: Progress, finished: bool) -> str:
    """All ranks save_state into DIR/.incomplete, then the main process publishes it as DIR/state-<n>."""
    generator = run.data.generator
    pipeline = all_gather(None if generator is None else generator.get_state())
    state = accel_state(run, progress, finished, pipeline, as_dict(recipe), run.model_width)
    incomplete = os.path.join(args.checkpoint_dir, ".incomplete")
    leftover = incomplete if run.is_main else None
    # each step's outcome to all ranks (also the barrier)
    problem = attempt(fresh_folder, incomplete) if run.is_main else None
    stop_unless_written(all_gather(problem), args.checkpoint_dir)
    problem = attempt(_write_folder, run.accelerator, incomplete, state if run.is_main else None)
    stop_unless_written(all_gather(problem), args.checkpoint_dir, leftover)
    problem = attempt(publish_checkpoint, args.checkpoint_dir, incomplete) if run.is_main else None
    stop_unless_written(all_gather(problem), args.checkpoint_dir, leftover)
    return latest_checkpoint(args.checkpoint_dir)


def _write_folder(accelerator, folder, state: dict | None) -> None:
    write_folder(accelerator.save_state, folder, state)


def save_and_stop(args, recipe, run, progress: Progress, step: int, correct, seconds: float):
    """A stop signal reached every rank at `step`: checkpoint where the run stands, then stop (exit 75)."""
    at = progress.mid_epoch(step + 1, seconds, **training_counts(run, progress, correct, step + 1))
    raise preempted(progress.epoch, step, args.checkpoint_dir and save_checkpoint(args, recipe, run, at))
