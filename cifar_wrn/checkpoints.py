"""What both trainers' checkpoints share: the Checkpointer (resume, save, save and stop, given its folder once), what
every checkpoint holds and a resume checks, its checksum, and reading it as data only (others may write to the
folder). Each format, written and read: raw_side.py (DIR/checkpoint.pt), accel_side.py (DIR/state-<n>, LATEST)."""

import contextlib
import hashlib
import os
import pickle
import re
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import torch

from .agreement import all_gather, training_counts
from .errors import AgreedError, RunStopped, UserError, agreed_problem
from .model import ARCHITECTURE
from .recipe import as_dict
from .resilience import preempted
from .safe_files import os_reason, remove, replace_atomically
from .stopping import Progress, final_line, rule_text


class CheckpointError(UserError):
    pass


# What each trainer's folder holds, so that neither resumes the other's as an empty folder, nor writes into it.
FOLDERS = {"raw_ddp.py": re.compile(r"checkpoint\.pt"), "accel_train.py": re.compile(r"LATEST|state-\d+")}
# Recipe keys a resume may change: they do not alter what was trained (`epochs` only with a constant LR).
RESUMABLE_CHANGES = set(
    "epochs target_accuracy patience eval_batch_size num_workers extra_epochs startup_steps".split()
)
# Every checkpoint's keys, each format's own (Checkpointer.OWN_KEYS) after them; digest: every other key's checksum.
KEYS = (
    *(f.name for f in fields(Progress)),
    *"finished recipe world_size model_width architecture train_images val_images steps_per_epoch ema digest".split(),
)
NO_CHECKPOINT = (
    "start without --resume, or use --auto-resume to start fresh when there is none). Every node must see it."
)
DAMAGED = (
    "(a changed byte: a damaged disk or copy, or an edit): refused, as a truncated file is. Resume from an intact "
    "copy, or start afresh in an empty --checkpoint-dir"
)


class Checkpointer:
    """One run's checkpoints in `directory` (None: none written), in a trainer's format; `resume`:
    cli.Checkpoints.resume, None to start afresh. Every rank calls each method. A format (a subclass) defines
        write(run, state) -> where it wrote `state` (and its own parts), on every rank;
        read(required) -> (where, the saved state or None, a problem or None): a problem, not an error, so every
            node stops together;
        restore(run, where, saved): the run as `saved` holds it."""

    TRAINER = ""  # the entry point whose format this is
    OWN_KEYS = ()  # the format's keys beyond KEYS

    def __init__(self, directory, resume=None):
        self.directory, self.resume_mode = directory, resume

    def resume(self, run) -> Progress | None:
        """Where this run starts: afresh, at the checkpoint all ranks agree on, or None (it had finished, and the
        rule in force leaves nothing to train: said, with the course's last line). A refusal: one line, one rank a
        node."""
        if self.resume_mode is None:
            return Progress()
        recipe = run.recipe
        where, saved, problem = self.read(self.resume_mode == "required")
        if saved is not None:
            problem = resume_problem(saved, as_dict(recipe), run.world_size, run.model_width, run.data.sizes())
            problem = problem or problem_of(self.restore, run, where, saved)
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
                f"Resuming from {where}: epoch {progress.epoch + 1}, step {progress.step} of "
                f"{run.data.steps_per_epoch}, Cumulative Time = {progress.cumulative_time:.3f}",
                flush=True,
            )
            if nothing_left:
                print(f"Nothing to do: that run had already finished\n{final_line(progress, recipe)}", flush=True)
            elif saved["finished"]:
                print(
                    f"That run had stopped early after epoch {progress.epoch} ({rule_text(saved['recipe'])}); under "
                    f"the rule now in force ({rule_text(as_dict(recipe))}) it trains on",
                    flush=True,
                )
        return None if nothing_left else progress

    def save(self, run, progress: Progress, finished: bool = False) -> str | None:
        """Everything needed to continue at `progress`; a failed write stops every rank, the previous checkpoint
        whole. Where it was written, or None without a folder."""
        if not self.directory:
            return None
        state = dict(
            progress.as_dict(),
            finished=finished,
            recipe=as_dict(run.recipe),
            world_size=run.world_size,
            model_width=run.model_width,
            architecture=ARCHITECTURE,
            **run.data.sizes(),
            ema=None if run.ema is None else run.ema.state_dict(),
        )
        return self.write(run, state)

    def save_and_stop(self, run, progress: Progress, step: int, correct, seconds: float):
        """A stop signal reached every rank at `step`: checkpoint (with a folder), then stop (exit 75)."""
        at = progress.mid_epoch(
            step + 1, seconds, **training_counts(progress, correct, step + 1, run.recipe.batch_size)
        )
        raise preempted(progress.epoch, step, self.save(run, at))

    def refuse_others(self):
        """Another trainer's checkpoint is never resumed as an empty folder, nor written into."""
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        for other, pattern in FOLDERS.items():
            if other != self.TRAINER and (theirs := sorted(n for n in names if pattern.fullmatch(n))):
                raise CheckpointError(
                    f"{self.directory} holds {other}'s checkpoint ({', '.join(theirs)}), not {self.TRAINER}'s: "
                    f"resume it with {other}, or give {self.TRAINER} another --checkpoint-dir"
                )

    def refuse_overwrite(self):
        """A run without a resume flag never writes over a checkpoint (as the Hugging Face Trainer guards its
        folder)."""
        self.refuse_others()
        names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        if found := sorted(n for n in names if FOLDERS[self.TRAINER].fullmatch(n)):
            raise CheckpointError(
                f"--checkpoint-dir {self.directory} holds a checkpoint ({', '.join(found)}) that a fresh run would "
                "overwrite: continue it with --auto-resume, or give another --checkpoint-dir"
            )

    def load(self, path) -> dict:
        """A checkpoint file read as data only, with every key this format holds."""
        with loading(path, "cannot be read"):
            state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise CheckpointError(not_ours(path, f"it holds a {type(state).__name__}, not a dict"))
        # A missing architecture is the earlier model's checkpoint, which resume_problem names.
        if missing := [key for key in (*KEYS, *self.OWN_KEYS) if key not in state and key != "architecture"]:
            raise CheckpointError(
                f"{path} lacks {', '.join(missing)}: an earlier version wrote it, or another project; start afresh "
                "in an empty --checkpoint-dir"
            )
        return state


def check_writable(directory):
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as exc:
        raise CheckpointError(f"--checkpoint-dir {directory} is not writable: {exc.strerror or exc}") from None


def problem_of(action, *args) -> str | None:
    """action(*args)'s problem in a line, or None."""
    try:
        action(*args)
    except Exception as exc:
        return str(exc) if isinstance(exc, CheckpointError) else os_reason(exc)
    return None


def stop_unless_written(problems: list, directory, leftover=None):
    if problem := agreed_problem(problems):
        if leftover:
            with contextlib.suppress(OSError):
                remove(leftover)
        raise RunStopped(
            f"no checkpoint could be written in {directory} ({problem}); the previous checkpoint there is intact",
            2,
        )


def save_atomic(state: dict, path):
    try:
        replace_atomically(path, lambda f: torch.save(state, f))
    except Exception as exc:
        raise CheckpointError(f"could not write {path}: {os_reason(exc)}") from None


def not_ours(path, why: str) -> str:
    return f"{path} is not a checkpoint this project wrote ({why}); nothing in it ran; resume from one you trust"


@contextlib.contextmanager
def loading(where, failed: str = "was found but cannot be loaded into this run"):
    try:
        yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:  # torch's refusal, minus its advice to load with weights_only=False
        text = (str(exc).partition("WeightsUnpickler error:")[2].strip() or str(exc)).splitlines()[0]
        raise CheckpointError(
            not_ours(where, "refused by weights-only loading: " + text.split(" was not an allowed global")[0])
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{where} {failed} ({os_reason(exc)})") from None


def device_problem(saved_on: str, running_on: str):
    if saved_on != running_on:
        raise CheckpointError(
            f"it was written by a run on {saved_on}, this run is on {running_on}: its random states do not carry "
            f"over (resume on {saved_on}, or start afresh in another folder)"
        )


# ---- checksums: SHA-256 of what a checkpoint holds, value by value, and of the files Accelerate's save_state wrote


def digest_of(state: dict) -> str:
    """sha256 of what a checkpoint holds, every key but `digest`, value by value (a tensor: its dtype, shape and
    bytes): the same after torch.save and torch.load, whatever the file's layout."""
    h = hashlib.sha256()
    _hash(h, {key: value for key, value in state.items() if key != "digest"})
    return h.hexdigest()


def _hash(h, value):
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(f"dict {len(value)}\n".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _hash(h, key)
            _hash(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)}\n".encode())
        for item in value:
            _hash(h, item)
    else:  # numbers, strings, None: what weights-only loading gives back besides tensors
        text = repr(value)
        h.update(f"{type(value).__name__} {len(text)} {text}\n".encode())


def with_digest(state: dict) -> dict:
    return {**state, "digest": digest_of(state)}


def check_digest(state: dict, path):
    if digest_of(state) != state["digest"]:
        raise CheckpointError(f"{path} does not match the checksum it was written with {DAMAGED}")


def file_digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---- what a resume checks


def what_was_seen(state: dict | None) -> str:
    if state is None:
        return "no checkpoint"
    return f"epoch {state['epoch']}, step {state['step']} (Cumulative Time {state['cumulative_time']!r} s)"


def resume_disagreement(seen: list[tuple[str, str | None]]) -> str | None:
    problem, views = agreed_problem([p for _, p in seen]), [view for view, _ in seen]
    if problem or len(set(views)) <= 1:
        return problem
    listed = "; ".join(f"rank {rank} sees {view}" for rank, view in enumerate(views))
    return (
        f"the ranks do not see the same checkpoint: {listed}. Every node must see the same --checkpoint-dir "
        "(a shared folder)"
    )


def resume_problem(
    checkpoint: dict,
    recipe: dict,
    world_size: int,
    model_width: int,
    data=None,
    architecture: str | None = ARCHITECTURE,
) -> str | None:
    """Why this checkpoint (or a log's header: the report's) cannot continue as this run."""
    if checkpoint.get("architecture") != architecture:
        held = checkpoint.get("architecture") or "an earlier, non-course WideResNet"
        return f"the model changed (the checkpoint holds {held}): start a new run in an empty --checkpoint-dir"
    if checkpoint["world_size"] != world_size:
        return (
            f"the checkpoint was written by {checkpoint['world_size']} processes, this run has {world_size}: "
            "resume with the same --num-nodes x --num-gpus"
        )
    if checkpoint["model_width"] != model_width:
        return f"the checkpoint holds a model of width {checkpoint['model_width']}, this run builds {model_width}"
    for key, value in (data or {}).items():
        if key in checkpoint and checkpoint[key] != value:
            flag = {"train_images": "--train-subset", "val_images": "--val-subset"}.get(key, "--batch-size")
            return (
                f"the checkpoint's run had {key.replace('_', ' ')} = {checkpoint[key]}, this run has {value}: "
                f"resume with the same {flag}"
            )
    old = checkpoint["recipe"]
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old.get("lr_schedule") != "constant" else set())
    changed = sorted(k for k in old.keys() | recipe.keys() if k not in allowed and old.get(k) != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old.get(k)!r} -> {recipe.get(k)!r})" for k in changed
        )
    return None
