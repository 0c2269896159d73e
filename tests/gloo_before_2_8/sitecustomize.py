"""Put on PYTHONPATH by the tests (test_course.py, gloo_before_2_8_env): every Python process started with it
stands in for Falcon's torch 2.7.1 where gloo's reductions differ: torch.__version__ reads 2.7.1, and all_reduce
with ReduceOp.AVG on a gloo group fails as 2.7.1's does ("Cannot use ReduceOp.AVG with Gloo"). Nothing in course/
knows of it."""

import runpy
from pathlib import Path

# Python imports one sitecustomize: this one shadows tests/lean_gc's, so run that one too.
runpy.run_path(str(Path(__file__).parents[1] / "lean_gc" / "sitecustomize.py"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.torch_version import TorchVersion  # noqa: E402

torch.__version__ = TorchVersion("2.7.1")
all_reduce = dist.all_reduce


def all_reduce_of_2_7(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo":
        raise ValueError("Cannot use ReduceOp.AVG with Gloo")
    return all_reduce(tensor, op, group, async_op)


dist.all_reduce = all_reduce_of_2_7
