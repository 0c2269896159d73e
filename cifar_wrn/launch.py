"""Launch plumbing a student need not learn."""

import contextlib
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cli import (
    CPU_FALLBACK_WARNING,
    accelerate_launch_problem,
    free_port,
    launched_by_torchrun,
    launcher_name,
    launcher_world_size,
    local_world_size,
)
from .errors import UserError, run_reporting_failures, said_by_one
from .recipe import slow_bf16_warning
from .resilience import STOP_SIGNALS, install_stop_handlers


@contextlib.contextmanager
def forming_group(rank, world_size: int | None, args):
    import torch._dynamo as _  # noqa: F401  imported now, before the group: imported later it can abort the exit

    try:
        own_store_after_a_restart(args.dist_timeout)
        yield
    except dist.DistError as exc:
        addr, port = (os.environ.get(k, getattr(args, k.lower(), None)) for k in ("MASTER_ADDR", "MASTER_PORT"))
        who = "" if rank is None else f"rank {rank}: "
        raise UserError(
            f"{who}the process group did not form at {addr}:{port} with world size "
            f"{world_size or launcher_world_size()} within {args.dist_timeout:g} s: not every process joined. Start "
            "every node with the same node count, processes per node, address and port. "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"
        ) from None


def own_store_after_a_restart(timeout: float) -> None:
    """torchrun's agent (accelerate launch's too) keeps one store for all its attempts, and a restarted group could
    read the dead attempt's addresses there and fail, or hang (pytorch/pytorch#135712, #167288). So each attempt
    after the first meets in a store of its own: rank 0 picks a port and says which through the agent's store."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout)
    )
    key = f"cifar_wrn/attempt-{attempt}/port"
    if os.environ.get("RANK") == "0":
        agent.set(key, str(free_port()))
    os.environ["MASTER_PORT"] = agent.get(key).decode()  # waits for rank 0, at most `timeout`
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # env://: rank 0 serves the new store


def report_failures(train, local_rank: int, args, recipe) -> None:
    install_stop_handlers()  # a stop from now on, start-up included, checkpoints and stops at the first step
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # Launcher's ranks start with them blocked: now due
    rank = os.environ.get("RANK") or getattr(args, "node_id", 0) * getattr(args, "num_gpus", 1) + local_rank
    run_reporting_failures(
        lambda: train(local_rank, args, recipe), rank, (dist.DistBackendError, dist.DistNetworkError)
    )


class Launcher:
    """raw_ddp.py's parent: holds the store as torchrun's agent does, passes SIGUSR1/SIGTERM on, exits as the
    ranks did."""

    def __init__(self, args):
        self.args, self.processes = args, []
        if args.master_port is None:  # one node: a port the system picks, held from now on (no race for it)
            self.store = dist.TCPStore(args.master_addr, 0, is_master=True, wait_for_workers=False)
            args.master_port = self.store.port
            # as torchrun's agent: the ranks' env:// (raw_ddp.py's R1.3) joins this store as a client
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.pass_on)
        # held until wait() knows the ranks, which inherit the mask: held there too, until their handlers are in
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def pass_on(self, signum, frame) -> None:
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)

    def wait(self, context) -> None:
        self.processes.extend(context.processes)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a stop held since __init__ is passed on now
        try:
            while not context.join(grace_period=10):
                pass
        except mp.ProcessExitedException as exc:
            if exc.signal_name:  # killed: it could not report itself
                failed = self.args.node_id * self.args.num_gpus + exc.error_index
                print(f"error: rank {failed} was killed by {exc.signal_name}", file=sys.stderr)
            sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)


def launch_fields(args, run) -> dict:
    if (acc := run.accelerator) is None:
        return dict(
            num_nodes=args.num_nodes,
            num_gpus=args.num_gpus,
            backend=dist.get_backend(),
            device=run.device.type,
            launcher="torchrun" if launched_by_torchrun() else "mp.spawn",
        )
    import accelerate

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


def check_accelerate_launch(accelerator, args, recipe) -> None:
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
        if args.cpu_fallback and not parse_flag_from_env("ACCELERATE_USE_CPU"):
            accelerator.print(CPU_FALLBACK_WARNING, file=sys.stderr)
        if warning := slow_bf16_warning(device.type, recipe.precision):
            accelerator.print(warning, file=sys.stderr)
