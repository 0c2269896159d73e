"""What the trainers' checkpoints hold, and what a resume checks."""

import hashlib
import os
import re
from pathlib import Path

import torch

from .errors import agreed_problem
from .model import ARCHITECTURE
from .recipe import Recipe, as_dict
from .safe_files import (
    LATEST,
    STATE_FOLDER,
    TRAINING_STATE,
    CheckpointError,
    _loading,
    _not_ours,
    latest_named,
    load_data_only,
)


def checkpoint_path(directory) -> Path:
    return Path(directory) / "checkpoint.pt"


# Recipe keys a resume may change: they do not alter what was trained (`epochs` only with a constant LR).
RESUMABLE_CHANGES = set(
    "epochs target_accuracy patience eval_batch_size num_workers extra_epochs startup_steps".split()
)


KEYS = (
    "epoch step epoch_time_so_far cumulative_time history streak finished recipe world_size model_width train_correct "
    "train_seen ema"
).split()
RAW_PARTS = {"model": "raw_model", "optimizer": "optimizer", "scheduler": "scheduler"}  # checkpoint key: run's
# digest: every other key's checksum (digest_of); files: each file save_state wrote -> its sha256
RAW_KEYS = KEYS + ["model", "optimizer", "scheduler", "rng", "digest"]
ACCEL_KEYS = KEYS + ["pipeline", "device", "files", "digest"]
RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")


NO_CHECKPOINT = (
    "start without --resume, or use --auto-resume to start fresh when there is none). Every node must see it."
)


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


def sealed(state: dict) -> dict:
    return {**state, "digest": digest_of(state)}


DAMAGED = (
    "(a changed byte: a damaged disk or copy, or an edit): refused, as a truncated file is. Resume from an intact "
    "copy, or start afresh in an empty --checkpoint-dir"
)


def check_digest(state: dict, path):
    if digest_of(state) != state["digest"]:
        raise CheckpointError(f"{path} does not match the checksum it was written with {DAMAGED}")


def file_digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def folder_digests(folder) -> dict:
    """name -> sha256, for every file save_state wrote in `folder`."""
    return {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != TRAINING_STATE}


def check_files(folder, state: dict, process_index: int):
    """Each file this process's load_state reads (of the random states, its own) is as written."""
    for name, digest in state["files"].items():
        if (own := RANDOM_STATES.fullmatch(name)) and int(own.group(1)) != process_index:
            continue
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing ({TRAINING_STATE} lists it)")
        if file_digest(path) != digest:
            raise CheckpointError(f"{path} does not match the checksum {TRAINING_STATE} holds for it {DAMAGED}")


def other_trainers_checkpoint(directory, accel: bool):
    """Never resumed as an empty folder, nor written into."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    if accel:
        theirs, ours = [str(checkpoint_path(directory))] if "checkpoint.pt" in names else [], f"{LATEST}, state-<n>"
    else:
        theirs, ours = sorted(n for n in names if n == LATEST or STATE_FOLDER.fullmatch(n)), "checkpoint.pt"
    if theirs:
        (other, this) = ("raw_ddp.py", "accel_train.py") if accel else ("accel_train.py", "raw_ddp.py")
        raise CheckpointError(
            f"{directory} holds {other}'s checkpoint ({', '.join(theirs)}), not {this}'s ({ours}): resume it with "
            f"{other}, or give {this} another --checkpoint-dir"
        )


def load_checkpoint(directory) -> dict:
    path = checkpoint_path(directory)
    if not path.is_file():
        raise CheckpointError(f"--resume: no checkpoint at {path} ({NO_CHECKPOINT}")
    return load_data_only(path, RAW_KEYS)


def write_training_state(folder, state: dict):
    """After every rank's save_state: training_state.pt, with the checksum of each file they wrote, and its own."""
    torch.save(sealed({**state, "files": folder_digests(folder)}), Path(folder) / TRAINING_STATE)


def read_training_state(folder) -> dict:
    folder = Path(folder)
    if not (folder / TRAINING_STATE).is_file() and (folder / "custom_checkpoint_0.pkl").is_file():
        raise CheckpointError(
            f"{folder} was written by an earlier accel_train.py (custom_checkpoint_0.pkl): start afresh in an empty "
            "--checkpoint-dir"
        )
    return load_data_only(folder / TRAINING_STATE, ACCEL_KEYS)


def _device_problem(saved_on: str, running_on: str):
    if saved_on != running_on:
        raise CheckpointError(
            f"it was written by a run on {saved_on}, this run is on {running_on}: its random states do not carry "
            f"over (resume on {saved_on}, or start afresh in another folder)"
        )


def training_state(run, progress, finished: bool, recipe: dict, **more) -> dict:
    # Accelerate's save_state writes these itself
    raw = {} if run.accelerator else {key: getattr(run, name).state_dict() for key, name in RAW_PARTS.items()}
    return dict(
        progress.as_dict(),
        finished=finished,
        recipe=recipe,
        world_size=run.world_size,
        model_width=run.model_width,
        architecture=ARCHITECTURE,
        **run.data.sizes(),
        ema=None if run.ema is None else run.ema.state_dict(),
        **raw,
        **more,
    )


def restore_raw(checkpoint: dict, run, path="the checkpoint"):
    with _loading("its part of the checkpoint"):
        rng, device = checkpoint["rng"][run.rank], run.device
        _device_problem("cpu" if rng["cuda"] is None else "cuda", device.type)
        check_digest(checkpoint, path)
        for key, name in RAW_PARTS.items():
            getattr(run, name).load_state_dict(checkpoint[key])
        if run.ema is not None:
            run.ema.load_state_dict(checkpoint["ema"])
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        if run.data.generator is not None:
            run.data.generator.set_state(rng["pipeline"])


def restore_accel(accelerator, folder, state: dict, device_type: str, ema, generator):
    """The random-state file is checked first: load_state would only log a bad one."""
    from accelerate.utils import load as accelerate_load  # allows numpy's RNG types

    folder = Path(folder)
    path = folder / f"random_states_{accelerator.process_index}.pkl"
    with _loading(folder):
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (each rank resumes its own random streams from its file)")
        rng = accelerate_load(path)
        if not isinstance(rng, dict) or not {"random_state", "numpy_random_seed", "torch_manual_seed"} <= rng.keys():
            raise CheckpointError(_not_ours(path, "it is not a random state"))
        _device_problem(state["device"], device_type)
        check_digest(state, folder / TRAINING_STATE)
        check_files(folder, state, accelerator.process_index)
        accelerator.load_state(folder, load_kwargs={"weights_only": True})
        if ema is not None:
            ema.load_state_dict(state["ema"])
        if generator is not None:
            generator.set_state(state["pipeline"][accelerator.process_index])


def read_for_resume(directory, required: bool) -> tuple[dict | None, str | None]:
    try:
        other_trainers_checkpoint(directory, accel=False)
        return (load_checkpoint(directory) if required or checkpoint_path(directory).is_file() else None), None
    except CheckpointError as exc:
        return None, str(exc)


def read_accel_for_resume(directory, required: bool) -> tuple[str | None, dict | None, str | None]:
    """A problem, not an error, so that every node stops together."""
    folder = None
    try:
        other_trainers_checkpoint(directory, accel=True)
        if (named := latest_named(directory)) and not os.path.isdir(named):
            raise CheckpointError(
                f"{os.path.join(directory, LATEST)} names {os.path.basename(named)}, which is missing (removed, or "
                f"not copied with {LATEST}): refused. Put that folder back, or remove {LATEST} to start afresh"
            )
        folder = named
        if folder is None and required:
            raise CheckpointError(
                f"--resume: no checkpoint in {directory} (no {LATEST} naming a state-<n> folder; {NO_CHECKPOINT}"
            )
        return folder, folder and read_training_state(folder), None
    except CheckpointError as exc:
        return folder, None, str(exc)


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
    data: dict | None = None,
    architecture: str | None = ARCHITECTURE,
) -> str | None:
    """Why this checkpoint cannot continue as this run; `architecture` None: the earlier network."""
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
    # keys newer than the checkpoint had their defaults; a key this version lacks is a difference
    defaults = as_dict(Recipe())
    old = {**{k: defaults[k] for k in recipe if k in defaults}, **checkpoint["recipe"]}
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed
        )
    return None
