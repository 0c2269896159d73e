"""Which launcher started this process, and what it started: probes of the environment (torchrun, accelerate
launch, Slurm's srun set it), checked before and after the process group forms."""

import os
import socket
import sys

import torch

from .errors import UserError, said_by_one
from .recipe import slow_bf16_warning

# --device auto without CUDA, on a subset (the full data is refused: cli.refuse_full_run_without_gpu)
CPU_FALLBACK_WARNING = "warning: CUDA is not available: running on the CPU with the gloo backend"


def launched_by_torchrun() -> bool:
    return {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"} <= os.environ.keys()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def launcher_world_size() -> int | None:
    sizes = (os.environ.get(k, "") for k in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"))
    return next((int(size) for size in sizes if size.isdigit()), None)


def local_world_size(default: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def launcher_name() -> str:
    if "ACCELERATE_DYNAMO_BACKEND" in os.environ:  # asked first: accelerate launch runs torchrun inside
        return "accelerate launch"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "python"


def accelerate_launch_problem(seen: int, distributed_type: str, device_type: str, version: str) -> str | None:
    started = launcher_world_size()
    if started not in (None, seen):
        return (
            f"the launcher started {started} processes (WORLD_SIZE={started}) but Accelerate sees {seen} "
            f"(distributed_type {distributed_type}, device {device_type}): each would train alone. Without CUDA, "
            "add --cpu after accel_train.py or set ACCELERATE_USE_CPU=1 (docs/accelerate.md, CPU traps)."
        )
    # the single-process launcher sets MASTER_PORT only when asked for several
    if started is None and seen == 1 and launcher_name() == "accelerate launch" and os.environ.get("MASTER_PORT"):
        return (
            "accelerate launch was asked for several processes but started only this one (accelerate "
            f"{version} runs `--cpu --num_processes N` and MULTI_CPU configs as one). For N CPU processes use "
            "`accelerate launch --config_file accelerate_configs/two_cpus.yaml accel_train.py --cpu ...`; "
            "for one, unset MASTER_PORT."
        )
    return None


def check_accelerate_launch(accelerator, recipe, cpu_fallback: bool) -> None:
    """Every process joined, as Accelerate sees them; on the CPU, its threads shared and the warnings said once."""
    import accelerate
    from accelerate.utils import parse_flag_from_env

    world_size, device = accelerator.num_processes, accelerator.device
    if problem := accelerate_launch_problem(
        world_size, accelerator.distributed_type.value, device.type, accelerate.__version__
    ):
        with said_by_one():  # each process found it alone
            raise UserError(problem)
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size(world_size)))
        if cpu_fallback and not parse_flag_from_env("ACCELERATE_USE_CPU"):
            accelerator.print(CPU_FALLBACK_WARNING, file=sys.stderr)
        if warning := slow_bf16_warning(device.type, recipe.precision):
            accelerator.print(warning, file=sys.stderr)
