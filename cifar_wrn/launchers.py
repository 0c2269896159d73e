"""Which launcher started this process, and what it started: probes of the environment (torchrun, accelerate
launch, Slurm's srun set it), checked before and after the process group forms."""

import os
import socket

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
