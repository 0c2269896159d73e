"""raw_ddp.py's side, all of what it does differently from accel_train.py below the entry point: its launch checks,
its checkpoint (DIR/checkpoint.pt, written by rank 0 with every rank's random streams), its TensorBoard writer and
its run log's launch fields."""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .agreement import all_gather
from .checkpoints import (
    NO_CHECKPOINT,
    Checkpointer,
    CheckpointError,
    check_digest,
    device_problem,
    loading,
    problem_of,
    save_atomic,
    stop_unless_written,
    with_digest,
)
from .cli import (
    NO_CUDA,
    NO_SYNC_BN,
    Settings,
    at_least_one,
    check_learning_rates,
    check_training_flags,
    claim_checkpoint_dir,
    recipe_from_args,
    refuse_full_run_without_gpu,
    settings_from,
)
from .errors import UserError, said_by_one
from .launchers import CPU_FALLBACK_WARNING, launched_by_torchrun, port_is_free
from .recipe import Recipe, slow_bf16_warning


class RawCheckpointer(Checkpointer):
    """DIR/checkpoint.pt: the model, optimizer and schedule, every rank's random streams, and what both formats
    hold (checkpoints.KEYS), sealed by a checksum."""

    TRAINER = "raw_ddp.py"
    PARTS = {"model": "raw_model", "optimizer": "optimizer", "scheduler": "scheduler"}  # checkpoint key: run's
    OWN_KEYS = (*PARTS, "rng")

    @property
    def path(self) -> Path:
        return Path(self.directory) / "checkpoint.pt"

    def write(self, run, state: dict) -> str:
        generator = run.data.generator
        cuda = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
        pipeline = None if generator is None else generator.get_state()
        every_rng = all_gather({"torch": torch.get_rng_state(), "cuda": cuda, "pipeline": pipeline})
        parts = {key: getattr(run, name).state_dict() for key, name in self.PARTS.items()}
        state = with_digest({**state, **parts, "rng": every_rng}) if run.is_main else None  # checked on resume
        written = problem_of(save_atomic, state, self.path) if run.is_main else None
        stop_unless_written(all_gather(written), self.directory)
        return str(self.path)

    def read(self, required: bool) -> tuple:
        try:
            self.refuse_others()
            if not self.path.is_file():
                if required:
                    raise CheckpointError(f"--resume: no checkpoint at {self.path} ({NO_CHECKPOINT}")
                return self.path, None, None
            return self.path, self.load(self.path), None
        except CheckpointError as exc:
            return self.path, None, str(exc)

    def restore(self, run, where, saved: dict) -> None:
        with loading("its part of the checkpoint"):
            rng, device = saved["rng"][run.rank], run.device
            device_problem("cpu" if rng["cuda"] is None else "cuda", device.type)
            check_digest(saved, where)
            for key, name in self.PARTS.items():
                getattr(run, name).load_state_dict(saved[key])
            if run.ema is not None:
                run.ema.load_state_dict(saved["ema"])
            torch.set_rng_state(rng["torch"])
            if device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], device)
            if run.data.generator is not None:
                run.data.generator.set_state(rng["pipeline"])


class TensorBoard:
    """--with-tracking: a SummaryWriter in FOLDER/NAME, flushed each epoch as Accelerate's tracker is."""

    def __init__(self, name: str, folder: str):
        from torch.utils.tensorboard import SummaryWriter  # the optional extra, checked before launch

        self.writer = SummaryWriter(str(Path(folder, name)))

    def log(self, values: dict, step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a crash loses nothing logged

    def close(self) -> None:
        self.writer.close()


def log_fields(settings: Settings, device: torch.device) -> dict:
    """The run log header's launch fields."""
    launcher = "torchrun" if launched_by_torchrun() else "mp.spawn"
    layout = dict(num_nodes=settings.num_nodes, num_gpus=settings.num_gpus)
    return dict(**layout, backend=dist.get_backend(), device=device.type, launcher=launcher)


def check_launch(args, cuda_device_count: int):
    at_least_one(args, "num_nodes", "num_gpus")
    if not 0 <= args.node_id < args.num_nodes:
        raise UserError(
            f"--node-id must be in [0, {args.num_nodes - 1}] for --num-nodes {args.num_nodes} (got {args.node_id})"
        )
    if args.device == "cuda" and args.num_gpus > cuda_device_count:
        only = f"--num-gpus {args.num_gpus}, but this node has only {cuda_device_count} CUDA device(s)"
        raise UserError(only if cuda_device_count else NO_CUDA)
    # gloo ranks beyond a few a core only take turns (each step waits for the slowest), each with its own memory
    if args.device == "cpu" and args.num_gpus > (most := 4 * len(os.sched_getaffinity(0))):
        raise UserError(f"--num-gpus {args.num_gpus} CPU processes: at most {most} here, 4 a core this process may use")
    check_training_flags(args, writes_outputs=args.node_id == 0)
    port = args.master_port
    for flag, missing, why in (
        ("addr", args.master_addr is None, "node 0's address, which every node can reach"),
        ("port", port is None and args.num_nodes > 1, "where every node meets"),
    ):
        if missing:
            raise UserError(f"--master-{flag} (or $MASTER_{flag.upper()}) is required with more than one node: {why}")
    if port is not None and not 1 <= port <= 65535:
        raise UserError(f"--master-port must be in 1-65535 (got {port})")
    if port and args.node_id == 0 and not launched_by_torchrun() and not port_is_free(port):
        raise UserError(f"--master-port {port} is already in use on this machine (another run?); pick another port")


@said_by_one()  # under torchrun
def resolve_raw_launch(args: argparse.Namespace) -> tuple[Settings, Recipe]:
    """raw_ddp.py's device and ranks, the flags checked (R1.1)."""
    recipe = recipe_from_args(args)
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    node_main = os.environ.get("LOCAL_RANK", "0") == "0"
    refuse_full_run_without_gpu(args, cuda_count > 0)
    if args.device == "auto":
        args.device = "cuda" if cuda_count else "cpu"
        if not cuda_count and node_main:
            print(CPU_FALLBACK_WARNING, file=sys.stderr)
    torchrun_local_rank, env_port = None, os.environ.get("MASTER_PORT", "")
    if launched_by_torchrun():
        local, n, world, rank = (int(os.environ[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK"))
        torchrun_local_rank, args.num_gpus, args.num_nodes, args.node_id = local, n, world // n, rank // n
        args.master_port = int(env_port or 0) or None
    else:
        if args.master_port is None and env_port.isdigit():
            args.master_port = int(env_port)
        if args.num_nodes == 1:
            args.master_addr = args.master_addr or "127.0.0.1"
    check_launch(args, cuda_count)
    check_learning_rates(recipe, args.num_nodes * args.num_gpus)
    if (warning := slow_bf16_warning(args.device, recipe.precision)) and node_main:
        print(warning, file=sys.stderr)
    if recipe.sync_bn and args.device == "cpu":
        raise UserError(NO_SYNC_BN)
    checkpointer = RawCheckpointer(args.checkpoint_dir)
    claim_checkpoint_dir(args, checkpointer, holder=args.node_id == 0 and not torchrun_local_rank)
    launch = dict(num_nodes=args.num_nodes, node_id=args.node_id, num_gpus=args.num_gpus)
    launch.update(master_addr=args.master_addr, master_port=args.master_port, torchrun_local_rank=torchrun_local_rank)
    return settings_from(args, **launch), recipe
