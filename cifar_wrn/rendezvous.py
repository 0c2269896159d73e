"""How the ranks meet (R1.3's env://): the group forms or one clear error says why; after an elastic restart, in
a store of its own; raw_ddp.py's parent holds the store and passes stop signals on."""

import contextlib
import os
import signal
import sys
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import UserError
from .launchers import free_port, launcher_world_size
from .resilience import STOP_SIGNALS


@contextlib.contextmanager
def forming_group(rank: int | None, world_size: int | None, timeout: float):
    import torch._dynamo as _  # noqa: F401  imported now, before the group: imported later it can abort the exit

    try:
        own_store_after_a_restart(timeout)
        yield
    except dist.DistError as exc:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        who = "" if rank is None else f"rank {rank}: "
        raise UserError(
            f"{who}the process group did not form at {addr}:{port} with world size "
            f"{world_size or launcher_world_size()} within {timeout:g} s: not every process joined. Start "
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


class Launcher:
    """raw_ddp.py's parent: holds the store as torchrun's agent does, passes SIGUSR1/SIGTERM on, exits as the
    ranks did."""

    def __init__(self, settings):
        """settings: cli.Settings; self.settings: the same, with the store's port where none was given."""
        self.settings, self.processes = settings, []
        if settings.master_port is None:  # one node: a port the system picks, held from now on (no race for it)
            self.store = dist.TCPStore(settings.master_addr, 0, is_master=True, wait_for_workers=False)
            self.settings = replace(settings, master_port=self.store.port)
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
                failed = self.settings.first_rank + exc.error_index
                print(f"error: rank {failed} was killed by {exc.signal_name}", file=sys.stderr)
            sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)
