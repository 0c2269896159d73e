"""What the benchmark scripts share (a module, not a script): raw_ddp.py's command line and the timing flags."""

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def raw_ddp_command(num_gpus, *args) -> list[str]:
    """raw_ddp.py on one node with `num_gpus` processes, as a user starts it from the repository root."""
    return [sys.executable, "raw_ddp.py", "--num-nodes", "1", "--node-id", "0", "--num-gpus", str(num_gpus), *args]


def add_timing_flags(parser) -> None:
    """--device, --threads and --clock, for the scripts that time one process."""
    import torch

    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU seconds (time.process_time) instead of wall-clock seconds; with "
        "--threads 1 it is nearly immune to other load on a shared machine (CPU device only)",
    )


def apply_timing_flags(args):
    """Applies --threads and returns the clock --clock names."""
    import torch

    torch.set_num_threads(args.threads)
    return time.process_time if args.clock == "cpu" else time.perf_counter
