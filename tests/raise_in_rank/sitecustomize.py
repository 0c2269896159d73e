"""Put on PYTHONPATH by the tests (helpers.raise_in_rank_env): in every Python process started with it, rank
$RAISE_IN_RANK raises in its first loss computation, a rank that crashes (a bug, a driver error) while the others
wait for it in a collective. Nothing in the trainers knows of it."""

import os
import runpy
from pathlib import Path

# Python imports one sitecustomize: this one shadows tests/lean_gc's, so run that one too.
runpy.run_path(str(Path(__file__).parents[1] / "lean_gc" / "sitecustomize.py"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RANK = int(os.environ["RAISE_IN_RANK"])
loss_forward = torch.nn.CrossEntropyLoss.forward


def crashing_forward(self, *args, **kwargs):
    if dist.is_initialized() and dist.get_rank() == RANK:
        raise RuntimeError(f"injected test fault in rank {RANK}")
    return loss_forward(self, *args, **kwargs)


torch.nn.CrossEntropyLoss.forward = crashing_forward
