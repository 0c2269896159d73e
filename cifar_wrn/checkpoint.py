"""The two trainers' checkpoint formats and what a resume checks: raw_ddp.py writes one DIR/checkpoint.pt,
accel_train.py a save_state folder DIR/state-<n>/ with training_state.pt, named by DIR/LATEST.

Files are read as data only (cifar_wrn.safe_files); the collectives that save and resume: cifar_wrn.agreement.
"""

from pathlib import Path

import torch

from .errors import agreed_problem
from .model import ARCHITECTURE
from .recipe import RETIRED, Recipe, as_dict
from .safe_files import LATEST, TRAINING_STATE, CheckpointError, _loading, _not_ours, latest_checkpoint, load_data_only

FILENAME = "checkpoint.pt"


def checkpoint_path(directory) -> Path:
    return Path(directory) / FILENAME


# Recipe keys a resume may change: they do not alter what was trained (`epochs` only with a constant LR).
RESUMABLE_CHANGES = {
    "epochs",
    "target_accuracy",
    "patience",
    "eval_batch_size",
    "num_workers",
    "extra_epochs",
    "startup_steps",
}


COMMON_KEYS = (
    "epoch",
    "step",
    "epoch_time_so_far",
    "cumulative_time",
    "history",
    "streak",
    "finished",
    "recipe",
    "world_size",
    "model_width",
    "train_correct",
    "train_seen",
)
RAW_KEYS = COMMON_KEYS + ("model", "optimizer", "scheduler", "ema", "rng")
ACCEL_KEYS = COMMON_KEYS + ("pipeline",)


def load_checkpoint(directory) -> dict:
    path = checkpoint_path(directory)
    if not path.is_file():
        raise CheckpointError(
            f"--resume: no checkpoint at {path} (start without --resume, or use --auto-resume "
            f"to start fresh when there is none). The folder must be visible from every node."
        )
    return load_data_only(path, RAW_KEYS)


def write_folder(save_state, folder, state: dict | None) -> None:
    """One rank's part of an accel_train.py checkpoint; TRAINING_STATE from the main process (`state` given)."""
    save_state(folder)
    if state is not None:
        torch.save(state, Path(folder) / TRAINING_STATE)


def read_training_state(folder) -> dict:
    """A folder's TRAINING_STATE, read as data only; a folder of an earlier accel_train.py is refused."""
    folder = Path(folder)
    if not (folder / TRAINING_STATE).is_file() and (folder / "custom_checkpoint_0.pkl").is_file():
        raise CheckpointError(
            f"{folder} was written by an earlier accel_train.py (custom_checkpoint_0.pkl, no {TRAINING_STATE}), "
            f"which this version does not read: start afresh in an empty --checkpoint-dir"
        )
    return load_data_only(folder / TRAINING_STATE, ACCEL_KEYS + ("ema",))


def device_problem(saved_on: str, running_on: str) -> str | None:
    """Why random states from one device type cannot resume on another, or None."""
    if saved_on == running_on:
        return None
    return (
        f"it was written by a run on {saved_on}, this run is on {running_on}: its random states, and with them "
        f"an exact resume, do not carry over (resume on {saved_on}, or start afresh in another folder)"
    )


def rank_rng(device, generator) -> dict:
    """raw_ddp.py: this rank's random streams (torch, CUDA, the device pipeline's), for rank 0's checkpoint."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "pipeline": None if generator is None else generator.get_state(),
    }


def raw_state(run, progress, finished: bool, every_rng: list, recipe: dict, model_width: int) -> dict:
    """raw_ddp.py: everything needed to continue at `progress` (run: cifar_wrn.run.Run)."""
    return {
        "model": run.raw_model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "ema": None if run.ema is None else run.ema.state_dict(),
        **progress.as_dict(),
        "finished": finished,
        "rng": every_rng,
        "recipe": recipe,
        "world_size": run.world_size,
        "model_width": model_width,
        "architecture": ARCHITECTURE,
        **run.data.sizes(),
    }


def accel_state(run, progress, finished: bool, pipeline: list, recipe: dict, model_width: int) -> dict:
    """accel_train.py: what save_state does not hold (run: cifar_wrn.run.Run)."""
    return {
        **progress.as_dict(),
        "finished": finished,
        "pipeline": pipeline,
        "recipe": recipe,
        "world_size": run.world_size,
        "model_width": model_width,
        "architecture": ARCHITECTURE,
        **run.data.sizes(),
        "device": run.device.type,
        "ema": None if run.ema is None else run.ema.state_dict(),
    }


def resuming_line(where, progress, steps_per_epoch: int, finished: bool) -> str:
    """What rank 0 prints on a resume."""
    line = (
        f"Resuming from {where}: epoch {progress.epoch + 1}, step {progress.step} of {steps_per_epoch}, "
        f"Cumulative Time = {progress.cumulative_time:.3f}"
    )
    return line + ("\nNothing to do: that run had already finished" if finished else "")


def restore_raw(checkpoint: dict, run) -> None:
    """raw_ddp.py: this rank's part of `checkpoint` into `run` (a cifar_wrn.run.Run): weights, states, streams."""
    rank, device, raw_model = run.rank, run.device, run.raw_model
    generator = getattr(run.data.train_set, "generator", None)  # the device pipeline's stream

    def load():
        rng = checkpoint["rng"][rank]  # this rank's own random streams, exactly where they were
        problem = device_problem("cpu" if rng["cuda"] is None else "cuda", device.type)
        if problem:
            raise CheckpointError(problem)
        raw_model.load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.scheduler.load_state_dict(checkpoint["scheduler"])
        if run.ema is not None:
            run.ema.load_state_dict(checkpoint["ema"])
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        if generator is not None:
            generator.set_state(rng["pipeline"])

    _loading("its part of the checkpoint", load)  # (the message gets "rank <rank>: " in front)


RANDOM_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def restore_accel(accelerator, folder, state: dict, device_type: str, ema, generator) -> None:
    """accel_train.py: load_state(folder), the EMA and the generator. The random-state file is checked first:
    load_state would only log a bad one and resume inexactly."""
    from accelerate.utils import load as accelerate_load  # allows numpy's RNG types

    folder = Path(folder)
    path = folder / f"random_states_{accelerator.process_index}.pkl"

    def load():
        rng = accelerate_load(path) if path.is_file() else None
        if rng is None:
            raise CheckpointError(f"{path} is missing (each rank resumes its own random streams from its file)")
        if not isinstance(rng, dict) or any(key not in rng for key in RANDOM_STATE_KEYS):
            raise CheckpointError(_not_ours(path, "it is not a random state"))
        # older folders lack "device": no CUDA state means written without CUDA
        problem = device_problem(
            state.get("device", device_type if "torch_cuda_manual_seed" in rng else "cpu"), device_type
        )
        if problem:
            raise CheckpointError(problem)
        accelerator.load_state(folder, load_kwargs={"weights_only": True})
        if ema is not None:
            ema.load_state_dict(state["ema"])
        if generator is not None:
            generator.set_state(state["pipeline"][accelerator.process_index])

    _loading(folder, load)


def read_for_resume(directory, required: bool) -> tuple[dict | None, str | None]:
    """(checkpoint or None, None) or (None, why it cannot be read)."""
    if not required and not checkpoint_path(directory).is_file():
        return None, None
    try:
        return load_checkpoint(directory), None
    except CheckpointError as exc:
        return None, str(exc)


def read_accel_for_resume(directory, required: bool) -> tuple[str | None, dict | None, str | None]:
    """(newest folder, its TRAINING_STATE, problem), each possibly None. A missing --resume checkpoint is a
    problem found after the group formed, so that every node stops together."""
    folder = None
    try:
        folder = latest_checkpoint(directory)
        if folder is None:
            return (
                None,
                None,
                required
                and (
                    f"--resume: no checkpoint in {directory} (no {LATEST} naming a state-<n> folder; start without "
                    f"--resume, or use --auto-resume to start fresh when there is none). The folder must be visible "
                    f"from every node."
                )
                or None,
            )
        return folder, read_training_state(folder), None
    except CheckpointError as exc:
        return folder, None, str(exc)


def what_was_seen(state: dict | None) -> str:
    if state is None:
        return "no checkpoint"
    return f"epoch {state['epoch']}, step {state['step']} (Cumulative Time {state['cumulative_time']!r} s)"


def resume_disagreement(seen: list[tuple[str, str | None]]) -> str | None:
    """Any rank's resume problem, else ranks seeing different checkpoints (a mixed run), else None."""
    problem = agreed_problem([problem for _, problem in seen])
    if problem:
        return problem
    views = [view for view, _ in seen]
    if any(view != views[0] for view in views):
        listed = "; ".join(f"rank {rank} sees {view}" for rank, view in enumerate(views))
        return (
            f"the ranks do not see the same checkpoint: {listed}. Every node must see the same "
            f"--checkpoint-dir (a shared folder); resume when they do, or start afresh in an empty folder"
        )
    return None


def resume_problem(
    checkpoint: dict,
    recipe: dict,
    world_size: int,
    model_width: int,
    data: dict | None = None,
    architecture: str | None = ARCHITECTURE,
) -> str | None:
    """Why this checkpoint cannot continue as this run, or None; `data` is checked where the checkpoint has it.
    `architecture`: this run's network (None: the earlier, non-course one, as in old logs)."""
    if checkpoint.get("architecture") != architecture:
        earlier = "an earlier, non-course WideResNet"
        return (
            f"the checkpoint holds {checkpoint.get('architecture') or earlier}; this run trains the "
            f"{architecture or earlier}: the model changed, so it cannot continue that run. Start a new run in an "
            f"empty --checkpoint-dir (the old checkpoint is left as it is)"
        )
    if checkpoint["world_size"] != world_size:
        return (
            f"the checkpoint was written by {checkpoint['world_size']} processes, this run has {world_size}: "
            f"resume with the same --num-nodes x --num-gpus (each rank's random state and data shard "
            f"depend on it)"
        )
    if checkpoint["model_width"] != model_width:
        return f"the checkpoint holds a model of width {checkpoint['model_width']}, this run builds {model_width}"
    for key, value in (data or {}).items():
        if key in checkpoint and checkpoint[key] != value:
            flag = {"train_images": "--train-subset", "val_images": "--val-subset"}.get(key, "--batch-size")
            return (
                f"the checkpoint's run had {key.replace('_', ' ')} = {checkpoint[key]}, this run has {value}: "
                f"resume with the same data ({flag}) and batch size"
            )
    # keys newer than the checkpoint: it had their defaults; keys that left the code: gone where they were off
    defaults = as_dict(Recipe())
    saved = {k: v for k, v in checkpoint["recipe"].items() if k not in RETIRED or RETIRED[k] != v}
    old = {**{k: defaults[k] for k in recipe if k in defaults}, **saved}
    allowed = RESUMABLE_CHANGES - ({"epochs"} if old["lr_schedule"] != "constant" else set())
    changed = sorted(k for k in old if k not in allowed and old[k] != recipe.get(k))
    if changed:
        return "the recipe differs from the checkpoint's in " + ", ".join(
            f"{k} ({old[k]!r} -> {recipe.get(k)!r})" for k in changed
        )
    return None
