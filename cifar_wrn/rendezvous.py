"""How the ranks meet (R1.3's env://): the group forms or one clear error says why; after an elastic restart, in
a store of its own; raw_ddp.py's parent holds the store and passes stop signals on."""

import contextlib
import multiprocessing
import os
import signal
import sys
import tempfile
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import UserError
from .launchers import free_port, launcher_world_size
from .resilience import STOP_SIGNALS


@contextlib.contextmanager
def forming_group(settings, rank: int | None = None, world_size: int | None = None):
    """Yields the store the ranks join (store_to_join), None for env://; a group that does not form within
    settings.dist_timeout is one UserError."""
    import torch._dynamo as _  # noqa: F401  imported now, before the group: imported later it can abort the exit

    timeout = settings.dist_timeout
    try:
        with c10d_lines_held():
            own_store_after_a_restart(timeout)
            yield store_to_join(settings, world_size)
    except dist.DistError as exc:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        who = "" if rank is None else f"rank {rank}: "
        raise UserError(
            f"{who}the process group did not form at {addr}:{port} with world size "
            f"{world_size or launcher_world_size()} within {timeout:g} s: not every process joined. Start "
            "every node with the same node count, processes per node, address and port. "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"
        ) from None


@contextlib.contextmanager
def c10d_lines_held():
    """What this process writes to stderr while the group forms, said after it (or after any other failure): the
    store's C++ retries (tens of lines, stack traces; TORCH_CPP_LOG_LEVEL would hide every later C++ error too) do
    not bury the one line of a group that did not form."""
    sys.stderr.flush()
    stderr = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        formed = True
        try:
            yield
        except dist.DistError:
            formed = False  # forming_group says why in one line
            raise
        finally:
            sys.stderr.flush()
            os.dup2(stderr, 2)
            os.close(stderr)
            held.seek(0)
            if formed and (text := held.read()):
                os.write(2, text)


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


def store_to_join(settings, world_size: int) -> dist.TCPStore | None:
    """The store Launcher holds, joined as a client (init_process_group's store=), where it holds one; else None:
    init_process_group's env:// forms the group (rank 0 serves the store at MASTER_PORT)."""
    if not settings.parent_store:
        return None
    timeout = timedelta(seconds=settings.dist_timeout)
    return dist.TCPStore(settings.master_addr, settings.master_port, world_size, is_master=False, timeout=timeout)


class Launcher:
    """raw_ddp.py's parent: holds the store as torchrun's agent does, passes stop signals on, exits as the ranks
    did."""

    def __init__(self, settings):
        """settings: cli.Settings; self.settings: the same, with the store's port where none was given."""
        self.settings, self.processes = settings, []
        if settings.master_port is None:  # one node: a port the system picks, held from now on (no race for it)
            self.store = dist.TCPStore(settings.master_addr, 0, is_master=True, wait_for_workers=False)
            self.settings = replace(settings, master_port=self.store.port, parent_store=True)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.pass_on)
        # held until wait() knows the ranks, which inherit the mask: held there too, until their handlers are in
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        self.held = None  # the stop to pass on

    def pass_on(self, signum, frame) -> None:
        """One that comes while mp.spawn starts the ranks (a thread of the store takes it then) goes to those started
        and, from wait(), to all."""
        self.held = signal.SIGINT if signal.SIGINT in (signum, self.held) else signal.SIGUSR1
        for process in self.processes or multiprocessing.active_children():
            if process.is_alive():
                os.kill(process.pid, self.held)

    def wait(self, context) -> None:
        self.processes.extend(context.processes)
        if self.held:
            self.pass_on(self.held, None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a stop held since __init__ is passed on now
        try:
            while not context.join(grace_period=10):
                pass
        except mp.ProcessExitedException as exc:
            if exc.signal_name:  # killed: it could not report itself
                failed = self.settings.first_rank + exc.error_index
                print(f"error: rank {failed} was killed by {exc.signal_name}", file=sys.stderr)
            sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)
