"""A real Slurm on this machine, for the tests of the job scripts in slurm/ (see docs/slurm.md, "Testing").

Debian's own packages (slurmctld, slurmd, slurm-client, munge; .ci/run installs them, the tests never do):
one munged with its own key and socket, one slurmctld and two slurmd daemons, `node1` and `node2`,
all on 127.0.0.1 with ports of their own, under a private configuration (SLURM_CONF) and state in
a temporary folder. Nothing here reads or writes /etc/slurm, /etc/munge or a Slurm already running
on the machine, and `stop()` ends exactly the processes `start()` started (by process id), then
any process its slurmd daemons left behind (slurmstepd, a job's processes: found by the mount
namespace each slurmd runs in, see below). Should the test run itself be killed, the daemons get
SIGTERM as their parent dies (PR_SET_PDEATHSIG). Needs root.

The cluster looks like two of Falcon's A30 nodes to sbatch: partitions a30_normal_q (default) and
a30_preemptable_q, 64 cores and `Gres=gpu:4` per node (gres.conf names placeholder device files,
character devices like /dev/null, so Slurm sets CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE as on
Falcon; there is no GPU behind them). So the scripts' #SBATCH lines are accepted as they are.

What makes two slurmd on one machine look like two machines:
- each slurmd runs in its own mount and UTS namespace (`unshare`): its host name is its node
  name (`hostname` in a job says node1 or node2) and its /etc/hosts is a private copy that maps
  node1 and node2 to 127.0.0.1, so a job reaches "the first host of the job" by name, as on a
  cluster; the network is the machine's own (loopback), nothing goes off the machine;
- each node's jobs run on their own share of this machine's cores (slurmd is started under
  `taskset`, and its jobs inherit that): half each, as two real machines would have;
- node-local scratch: each node has its own disk behind the same path, <root>/scratch (in its
  namespace, <root>/nodes/<node>/scratch is mounted there); a TaskProlog gives every job a
  `$TMPDIR` there (<root>/scratch/job<id>, the same path on both nodes, different folders), and
  the Epilog deletes it when the job's run ends, as ARC does with its node-local $TMPDIR. A
  script that staged the data on one node only would fail on the other, as on Falcon.
Processes are tracked by proctrack/linuxproc (the process tree; Falcon uses cgroups): stopping a
step signals every process that descends from it.

Times are shortened for tests: a requeued job may start again after `cred_expire` (10 s, Slurm's
default is 120 s), the scheduler looks at pending jobs every 2 s.

Run by hand: `python tests/slurm_cluster.py` starts one and prints the SLURM_CONF to export, and
stops it on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]  # Debian's package names
COMMANDS = {
    "munged": "munge",
    "munge": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "srun": "slurm-client",
    "scontrol": "slurm-client",
    "scancel": "slurm-client",
    "sinfo": "slurm-client",
    "squeue": "slurm-client",
}
NODES = ("node1", "node2")
PARTITIONS = ("a30_normal_q", "a30_preemptable_q")  # Falcon's A30 partitions; the first is the default
GPUS_PER_NODE = 4
CRED_EXPIRE = 10  # seconds; also how long a requeued job waits before it may start again
KILL_WAIT = 30  # seconds between SIGTERM and SIGKILL when a job is cancelled (Slurm's default)
SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
# unshare's flags for a slurmd (and the probe that it can have them): a mount and UTS namespace of its own, its
# mounts private to it.
OWN_NAMESPACES = ["--mount", "--uts", "--propagation", "private"]
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}


class Unavailable(RuntimeError):
    """The cluster cannot run here; the message says why."""


def which(command: str) -> str | None:
    return shutil.which(command, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if which(c) is None]


def check_installed() -> None:
    """The tests install nothing: say which commands are missing and from which Debian packages (.ci/run
    installs them)."""
    if sys.platform != "linux":
        raise Unavailable(f"a real Slurm needs Linux (this is {sys.platform})")
    missing = missing_commands()
    if missing:
        packages = sorted({COMMANDS[c] for c in missing})
        raise Unavailable(
            f"{', '.join(missing)} not installed: install Debian's {' '.join(packages)} packages (as .ci/run does)"
        )


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (held open together, so that they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def first_job_id(count: int = 100, slot: int = 0) -> int:
    """A first job id such that the job scripts' MASTER_PORT (10000 + job id % 20000, slurm/job.sh)
    is free for this many jobs in a row. Clusters started side by side (one per pytest-xdist worker) pass
    their own slot (0-19): each gets its own 1000 of the 20000 ports, so their jobs' ports never meet."""
    window = (slot % 20) * 1000
    for _ in range(200):
        first = 100000 + secrets.randbelow(40) * 20000 + window + secrets.randbelow(1000 - count)
        if all(port_is_free(10000 + (first + i) % 20000) for i in range(count)):
            return first
    raise Unavailable("no run of free ports for the jobs' rendezvous")


def private_hosts(machine_hosts: str) -> str:
    """The nodes' /etc/hosts: the machine's, without any name of the test nodes (a machine that already
    maps node1 or node2 must not change what they resolve to), then the nodes on 127.0.0.1."""
    lines = []
    for line in machine_hosts.splitlines():
        entry, hash_, comment = line.partition("#")
        words = entry.split()
        if len(words) > 1 and set(words[1:]) & set(NODES):
            names = [w for w in words[1:] if w not in NODES]
            if not names:
                continue
            line = " ".join([words[0], *names]) + (f" {hash_}{comment}" if hash_ else "")
        lines.append(line)
    return "\n".join(lines) + "\n# the test cluster's nodes\n" + "".join(f"127.0.0.1 {n}\n" for n in NODES)


def node_cpus(index: int) -> str:
    """The cores node `index` runs on: its half of the cores this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // len(NODES))
    mine = cpus[index * share : (index + 1) * share] or cpus[-share:]
    return ",".join(map(str, mine))


def mount_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def processes_in(namespaces: set) -> list[int]:
    """Processes in any of these mount namespaces (from /proc)."""
    return [
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and int(e.name) != os.getpid() and mount_namespace(int(e.name)) in namespaces
    ]


def processes_with(needle: bytes, exclude=()) -> list[int]:
    """Processes whose environment holds `needle` (NAME=value), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _die_with_parent() -> None:
    """In a daemon, before exec: SIGTERM when the process that started it dies (a killed test run
    leaves no daemon behind). Linux prctl(PR_SET_PDEATHSIG); kept across exec."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def parse_record(text: str) -> dict:
    """`scontrol show job -o` / `show node -o`: one line of KEY=VALUE words."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


class SlurmCluster:
    def __init__(self, root: Path | None = None, log=print, slot: int = 0):
        self.root = Path(root or tempfile.mkdtemp(prefix="slurm-test-"))
        self.log = log
        self.slot = slot  # which share of the jobs' ports (first_job_id): one per cluster on this machine
        self.conf = self.root / "etc" / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.namespaces: set[str] = set()  # the slurmd daemons' mount namespaces (their jobs run in them)
        self.first_job_id = 0

    # ------------------------------------------------------------------ environment for clients

    @property
    def env(self) -> dict:
        """What a client (sbatch, scontrol, ...) needs in its environment to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self, base=None) -> dict:
        env = {
            k: v
            for k, v in (os.environ if base is None else base).items()
            if not k.startswith(("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SCANCEL_"))
        }
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        env.update(self.env)
        return env

    def command(self, *args, timeout=30, check=True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(a) for a in args], env=self.client_env(), capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(map(str, args))}: exit status {result.returncode}\n{result.stdout}{result.stderr}"
            )
        return result

    # ------------------------------------------------------------------ configuration

    def write_config(self) -> None:
        root = self.root
        for sub in (
            "etc",
            "state",
            "log",
            "run",
            "dev",
            "scratch",
            *(f"spool/{n}" for n in NODES),
            *(f"nodes/{n}/scratch" for n in NODES),
        ):
            (root / sub).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)  # munged wants its socket's folders searchable by all
        # MUNGE: a key of our own (a private key file) and a socket of our own.
        key_dir = root / "munge"
        key_dir.mkdir(mode=0o700, exist_ok=True)
        (key_dir / "munge.key").write_bytes(secrets.token_bytes(1024))
        (key_dir / "munge.key").chmod(0o400)
        sock_dir = root / "sock"
        sock_dir.mkdir(exist_ok=True)
        sock_dir.chmod(0o755)
        self.munge_socket = sock_dir / "munge"

        # Placeholder GPUs: character devices with /dev/null's numbers (Slurm refuses plain files).
        for i in range(GPUS_PER_NODE):
            dev = root / "dev" / f"gpu{i}"
            if not dev.exists():
                try:
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
                except OSError:  # cannot make devices here: Slurm then logs an error, still counts the GPUs
                    dev.touch()

        # Each node's /etc/hosts (bound over /etc/hosts in its namespace): the machine's, with the nodes.
        original = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        (root / "etc" / "hosts").write_text(private_hosts(original))

        # Node-local scratch (<root>/scratch, each node's own in its namespace): TaskProlog (each
        # task, as the job's user) prints the job's $TMPDIR; Epilog (root, on each node, when a run
        # of the job ends) deletes it.
        scratch = root / "scratch"
        task_prolog = root / "etc" / "task_prolog.sh"
        task_prolog.write_text(f"""#!/bin/sh
# $TMPDIR: node-local scratch for this job, as on Falcon
dir="{scratch}/job$SLURM_JOB_ID"
mkdir -p "$dir" && echo "export TMPDIR=$dir"
""")
        epilog = root / "etc" / "epilog.sh"
        epilog.write_text(f"""#!/bin/sh
[ -n "$SLURM_JOB_ID" ] || exit 0
rm -rf "{scratch}/job$SLURM_JOB_ID"
exit 0
""")
        task_prolog.chmod(0o755)
        epilog.chmod(0o755)

        ctld_port, *node_ports = free_ports(1 + len(NODES))
        self.first_job_id = first_job_id(slot=self.slot)
        host = socket.gethostname().split(".")[0]
        nodes = "".join(
            f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} CPUs=64 Boards=1 "
            f"SocketsPerBoard=2 CoresPerSocket=32 ThreadsPerCore=1 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN\n"
            for name, port in zip(NODES, node_ports)
        )
        node_list = f"node[1-{len(NODES)}]"
        partitions = "".join(
            f"PartitionName={p} Nodes={node_list} Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP\n"
            for i, p in enumerate(PARTITIONS)
        )
        self.conf.write_text(f"""# A test cluster: written by tests/slurm_cluster.py, removed with it.
ClusterName=testcluster
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={node_ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
FirstJobId={self.first_job_id}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={task_prolog}
Epilog={epilog}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=5
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
KillWait={KILL_WAIT}
# A loaded 2-core machine answers slowly: at the default 10 s a signal request timed out and was sent
# again, reaching the requeued run of the job it was meant for (it stopped a second time).
MessageTimeout=60
MinJobAge=3600
InactiveLimit=0
{nodes}{partitions}""")
        (root / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={node_list} Name=gpu File={root}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, cmd: list) -> subprocess.Popen:
        out = open(self.root / "log" / f"{name}.out", "wb")
        env = dict(self.client_env(), SLURM_TEST_CLUSTER=str(self.root))
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        out.close()
        self.procs[name] = proc
        return proc

    def _wait(self, what: str, ready, timeout: float, procs=()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            for name in procs:
                if self.procs[name].poll() is not None:
                    raise Unavailable(
                        f"{name} exited with status {self.procs[name].returncode} while starting:\n"
                        + self.log_tail(name)
                    )
            time.sleep(0.2)
        raise Unavailable(
            f"{what} did not happen within {timeout} s:\n" + "\n".join(self.log_tail(n) for n in self.procs)
        )

    def check_namespaces(self) -> None:
        """Each slurmd gets a host name, /etc/hosts and scratch disk of its own: mount and UTS namespaces."""
        unshare = which("unshare")
        if unshare is None:
            raise Unavailable("no `unshare` (util-linux) to give each slurmd its own host name and /etc/hosts")
        probe = subprocess.run(
            [
                unshare,
                *OWN_NAMESPACES,
                "sh",
                "-c",
                f'mount --bind "$1" /etc/hosts && hostname probe-node && getent hosts {NODES[0]}',
                "sh",
                str(self.root / "etc" / "hosts"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if probe.returncode != 0:
            raise Unavailable(
                "cannot make mount and UTS namespaces here (unshare --mount --uts, then mount "
                f"--bind and hostname): {probe.stderr.strip()[-500:]}"
            )

    def start(self, timeout: float = 60) -> SlurmCluster:
        check_installed()
        if os.geteuid() != 0:
            raise Unavailable(
                "slurmd must run as root (it starts jobs as their users, and the test cluster "
                "gives each node its own host name): run the tests as root, as CI does"
            )
        try:
            self.write_config()
            self.check_namespaces()
            self._spawn(
                "munged",
                [
                    which("munged"),
                    "--foreground",
                    f"--socket={self.munge_socket}",
                    f"--key-file={self.root}/munge/munge.key",
                    f"--pid-file={self.root}/run/munged.pid",
                    f"--seed-file={self.root}/munge/seed",
                    f"--log-file={self.root}/log/munged.log",
                ],
            )

            def munge_works():
                encoded = subprocess.run([which("munge"), "-n", "-S", str(self.munge_socket)], capture_output=True)
                return (
                    encoded.returncode == 0
                    and subprocess.run(
                        [which("unmunge"), "-S", str(self.munge_socket)], input=encoded.stdout, capture_output=True
                    ).returncode
                    == 0
                )

            self._wait("munged answering on its socket", munge_works, timeout, ["munged"])

            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", self.conf])
            for index, node in enumerate(NODES):
                slurmd = [which("slurmd"), "-D", "-N", node, "-f", self.conf]
                if which("taskset") is not None:
                    slurmd = [which("taskset"), "-c", node_cpus(index), *slurmd]
                # its own host name, /etc/hosts and scratch disk; exec all the way, so that the
                # process id recorded is slurmd's
                self._spawn(
                    f"slurmd-{node}",
                    [
                        which("unshare"),
                        *OWN_NAMESPACES,
                        "sh",
                        "-c",
                        'mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" && hostname "$4"'
                        ' && shift 4 && exec "$@"',
                        "sh",
                        self.root / "etc" / "hosts",
                        self.scratch(node),
                        self.root / "scratch",
                        node,
                        *slurmd,
                    ],
                )

            def nodes_idle():
                result = self.command("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
                states = dict(line.split()[:2] for line in result.stdout.splitlines() if line.strip())
                return result.returncode == 0 and all(states.get(n, "").startswith("idle") for n in NODES)

            self._wait(f"{', '.join(NODES)} idle", nodes_idle, timeout, list(self.procs))
            host = mount_namespace(os.getpid())
            self.namespaces = {mount_namespace(self.procs[f"slurmd-{n}"].pid) for n in NODES} - {None, host}
        except BaseException:
            self.stop()
            raise
        return self

    def scratch(self, node: str) -> Path:
        """Node `node`'s scratch disk as seen from outside the cluster (its jobs see it as <root>/scratch)."""
        return self.root / "nodes" / node / "scratch"

    def log_tail(self, name: str, lines: int = 15) -> str:
        texts = []
        for path in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if path.exists():
                texts.append(f"--- {path}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts)

    def logs(self, lines: int = 15) -> str:
        names = ["slurmctld", *(f"slurmd-{n}" for n in NODES)]
        return "\n".join(self.log_tail(n, lines) for n in names)

    def stop(self) -> list[int]:
        """Cancel what still runs, stop the daemons started here (by process id), then kill any process
        left in the slurmd daemons' namespaces (slurmstepd, job processes). Returns their process ids."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                jobs = self.command("squeue", "-h", "-o", "%A", check=False, timeout=15).stdout.split()
                if jobs:
                    self.command("scancel", *jobs, check=False, timeout=15)
                    deadline = time.monotonic() + KILL_WAIT + 15
                    while (
                        time.monotonic() < deadline
                        and self.command("squeue", "-h", "-o", "%A", check=False, timeout=15).stdout.strip()
                    ):
                        time.sleep(0.5)
            except subprocess.TimeoutExpired:  # a controller that does not answer: stop it all the same
                pass
        for name in reversed(list(self.procs)):  # slurmd, then slurmctld, then munged
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # slurmstepd and the jobs' processes, started by the slurmd daemons, live in their namespaces.
        leftovers = processes_in(self.namespaces)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.procs.clear()
        return leftovers

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ jobs

    def job(self, job_id) -> dict:
        result = self.command("scontrol", "show", "job", "-o", job_id, check=False, timeout=15)
        return parse_record(result.stdout) if result.returncode == 0 else {}


if __name__ == "__main__":
    cluster = SlurmCluster()
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}    # then sinfo, sbatch, ...; Ctrl-C stops the cluster", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        left = cluster.stop()
        if left:
            print(f"killed leftover job processes: {left}")
        cluster.remove()
