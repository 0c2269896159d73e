"""The one seam between the trainers: what raw_ddp.py and accel_train.py do differently below their entry points
(the checkpoint's format, writing and reading it, TensorBoard, the run log's launch fields). Each entry point
chooses its object (Run.trainer); no other module asks which trainer runs it."""

import os
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint
from .agreement import all_gather
from .checksums import sealed
from .launchers import launched_by_torchrun, launcher_name, local_world_size
from .safe_files import fresh_folder


class RawDDP:
    """raw_ddp.py: torch.distributed by hand; rank 0 writes DIR/checkpoint.pt, with every rank's random streams."""

    log_prefix = ""  # the run log's folder: <recipe>-<nodes>x<gpus>-<time>

    def __init__(self, num_nodes: int, num_gpus: int):
        self.num_nodes, self.num_gpus = num_nodes, num_gpus

    def launch_fields(self, run) -> dict:
        launcher = "torchrun" if launched_by_torchrun() else "mp.spawn"
        layout = dict(num_nodes=self.num_nodes, num_gpus=self.num_gpus)
        return dict(**layout, backend=dist.get_backend(), device=run.device.type, launcher=launcher)

    def tracker(self, run, name: str, folder: str):
        return TensorBoard(str(Path(folder, name)))

    def save(self, run, progress, directory, finished: bool) -> str:
        generator = run.data.generator
        cuda = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
        pipeline = None if generator is None else generator.get_state()
        every_rng = all_gather({"torch": torch.get_rng_state(), "cuda": cuda, "pipeline": pipeline})
        parts = {key: getattr(run, name).state_dict() for key, name in checkpoint.RAW_PARTS.items()}
        state = checkpoint.training_state(run, progress, finished, rng=every_rng, **parts)
        state = sealed(state) if run.is_main else None  # its checksum, checked on resume
        path = checkpoint.checkpoint_path(directory)
        written = checkpoint.attempt(checkpoint.save_atomic, state, path) if run.is_main else None
        checkpoint.stop_unless_written(all_gather(written), directory)
        return str(path)

    def read(self, directory, required: bool) -> tuple:
        """(where, the saved state or None, a problem or None)."""
        saved, problem = checkpoint.read_for_resume(directory, required)
        return checkpoint.checkpoint_path(directory), saved, problem

    def restore(self, run, where, saved: dict) -> None:
        checkpoint.restore_raw(saved, run, where)


class Accelerated:
    """accel_train.py: every rank save_state's its part into DIR/.incomplete; the main process adds
    training_state.pt, with the checksums of every file there, and publishes it as DIR/state-<n>."""

    log_prefix = "accel-"

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def launch_fields(self, run) -> dict:
        import accelerate

        acc = self.accelerator
        per_node = local_world_size(acc.num_processes)
        return dict(
            num_gpus=per_node,
            num_nodes=acc.num_processes // per_node,
            device=acc.device.type,
            backend=acc.state.backend or "none",
            launcher=launcher_name(),
            trainer="accelerate",
            accelerate_version=accelerate.__version__,
            mixed_precision=acc.mixed_precision,
            distributed_type=acc.distributed_type.value,
        )

    def tracker(self, run, name: str, folder: str):
        self.accelerator.init_trackers(name)  # Accelerator(log_with="tensorboard", project_dir=folder)
        return AcceleratorTracker(self.accelerator)

    def save(self, run, progress, directory, finished: bool) -> str:
        generator = run.data.generator
        pipeline = all_gather(None if generator is None else generator.get_state())
        state = checkpoint.training_state(run, progress, finished, pipeline=pipeline, device=run.device.type)
        main, incomplete = run.is_main, os.path.join(directory, ".incomplete")
        steps = (
            main and (fresh_folder, incomplete),
            (self.accelerator.save_state, incomplete),
            main and (checkpoint.write_training_state, incomplete, state),
            main and (checkpoint.publish_checkpoint, directory, incomplete),
        )
        for i, step in enumerate(steps):  # a failed first step leaves nothing to remove
            leftover = i and main and incomplete or None
            checkpoint.stop_unless_written(all_gather(step and checkpoint.attempt(*step)), directory, leftover)
        return checkpoint.latest_checkpoint(directory)

    @staticmethod
    def epoch_loader(data, epoch: int, skip: int):
        """This epoch's batches, reshuffled with seed + epoch, less the `skip` already trained: the prepared loader's
        set_epoch and skip_first_batches, or (the device pipeline, not prepared) raw_ddp.py's sampler and SkipFirst."""
        from accelerate import skip_first_batches

        data.train_set.set_epoch(epoch)  # each image's augmentation: (seed, epoch, index)
        if data.train_sampler is not None:
            data.train_sampler.set_epoch(epoch)
            data.train_batches.skip = skip
            return data.train_loader
        data.train_loader.set_epoch(epoch)
        return skip_first_batches(data.train_loader, skip) if skip else data.train_loader

    def read(self, directory, required: bool) -> tuple:
        where, saved, problem = checkpoint.read_accel_for_resume(directory, required)
        return where or directory, saved, problem

    def restore(self, run, where, saved: dict) -> None:
        checkpoint.restore_accel(self.accelerator, where, saved, run.device.type, run.ema, run.data.generator)


class TensorBoard:
    """raw_ddp.py's --with-tracking: a SummaryWriter, flushed each epoch as Accelerate's tracker is."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter  # the optional extra, checked before launch

        self.writer = SummaryWriter(folder)

    def log(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a crash loses nothing logged

    def close(self) -> None:
        self.writer.close()


class AcceleratorTracker:
    """accel_train.py's: accelerator.log writes; accelerator.end_training closes."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def log(self, values: dict, step: int) -> None:
        self.accelerator.log(values, step=step)

    def close(self) -> None:
        pass
