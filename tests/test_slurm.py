"""The Slurm job scripts in slurm/, proved under a real Slurm on this machine (tests/slurm_cluster.py).

Static checks first (bash -n, shellcheck, every referenced file exists, the #SBATCH headers), then,
under a real slurmctld and two slurmd daemons (node1, node2) started for the session: the cluster
itself (what a job sees, srun's signals), each job script run end to end on the CPU (tiny model,
synthetic data, gloo), and preemption: `scancel --batch --signal=USR1` (what `--signal=B:USR1@120`
sends before the time limit) must checkpoint, requeue and resume; `scancel` (SIGTERM to every
process of the job) must checkpoint and not requeue. See docs/slurm.md, "Testing".

The cluster needs root and Debian's slurmctld, slurmd and munge packages (.ci/run installs them). Its tests run
only with `pytest --slurm` (tests/conftest.py; skipped otherwise, saying so); asked for, a cluster that cannot
start fails them, saying why.

Every job runs under a hard timeout: past it the job is cancelled, its processes killed (they carry
the test's tag in their environment) and the test fails, so a hang cannot block the suite.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import EPOCH_LINE, raise_in_rank_env, run
from slurm_cluster import FINISHED, NODES, SlurmCluster, Unavailable, first_job_id, private_hosts, processes_with

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
SHELL_FILES = SCRIPTS + sorted(SLURM.glob("*.sh")) + sorted((REPO / "bench").glob("*.sh"))
# Seconds for one job, requeued runs included: a guard against a hang, not a speed test, so it holds on a
# loaded 2-core machine (a preempted accelerate job took 240 s there, with pytest-xdist and other work beside it).
HARD_TIMEOUT = 480
# The jobs' EXTRA_ARGS (a string, as a user passes it): one epoch of the tiny model.
SLURM_TINY = "--model-width 4 --train-subset 200 --val-subset 101 --epochs 1 --set num_workers=0"

# Variables the scripts read: a developer's own values must not leak into the tests.
SCRIPT_KNOBS = {
    "DEVICE",
    "GPUS_PER_NODE",
    "RECIPE",
    "EXTRA_ARGS",
    "SAVE_MODEL",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DATA_DIR",
    "DATA_SRC",
    "REPO_DIR",
    "RUNS_DIR",
    "MODULES",
    "MODULE_RESET",
    "VENV",
    "PYTHON",
    "ACCELERATE",
    "ACCEL_CONFIG",
    "ACCEL_ARGS",
    "ACCELERATE_USE_CPU",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "RAISE_IN_RANK",
    "CHECKPOINT_DIR",
    "MAX_REQUEUES",
    "TMPDIR",
    "SCRIPT",
}


def test_scripts_are_there():
    names = {p.name for p in SCRIPTS}
    assert {
        "raw_1gpu.sbatch",
        "raw_2gpu.sbatch",
        "raw_multinode.sbatch",
        "accel_2gpu.sbatch",
        "accel_multinode.sbatch",
    } <= names
    for path in SCRIPTS:
        assert os.access(path, os.X_OK), f"{path} is not executable"


# ============================================================================ static checks


@pytest.mark.slow
@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(path):
    result = run(["bash", "-n", path], timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shellcheck(path):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is not installed, and CI=true: install Debian's shellcheck package")
        pytest.skip("shellcheck is not installed (Debian's shellcheck package)")
    # -x follows `source` (the `# shellcheck source=` paths are relative to the repository root)
    result = run(["shellcheck", "-x", path.relative_to(REPO)], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_shared_steps_stay_one_job_a_file():
    """slurm/common.sh sources one file per job (Python environment, job and banner, data, requeue), each short
    enough to read in one sitting."""
    common = (SLURM / "common.sh").read_text()
    for name in ("python_env.sh", "job.sh", "data.sh", "requeue.sh"):
        assert f'source "$JOB_LIB/{name}"' in common, name
    for path in SLURM.glob("*.sh"):
        assert len(path.read_text().splitlines()) <= 250, f"{path.name}: split it by job"


def code_lines(path: Path) -> list[str]:
    """The script without its comment lines (#SBATCH lines and shellcheck directives included)."""
    return [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]


def referenced_files(path: Path) -> set[str]:
    """Files a script needs from the repository: sourced files, python entry points, accelerate configs."""
    text = path.read_text()
    found = set(re.findall(r'source\s+"\$REPO_DIR/([^"]+)"', text))
    found |= set(re.findall(r"#\s*shellcheck\s+source=(\S+)", text)) - {"/dev/null"}
    if path.suffix == ".sbatch":
        for line in code_lines(path):
            found |= set(re.findall(r"(?<![\w/.$])([\w][\w/-]*\.(?:py|yaml|yml|sh))\b", line))
    return found


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_referenced_files_exist(path):
    refs = referenced_files(path)
    if path.name.startswith("raw_"):
        assert {"raw_ddp.py", "slurm/common.sh"} <= refs, refs
    if path.name.startswith("accel_"):
        assert "accel_train.py" in refs and any(r.startswith("accelerate_configs/") for r in refs), refs
    missing = sorted(r for r in refs if not (REPO / r).is_file())
    assert not missing, f"{path.name} needs {missing}, which are not in the repository"


def sbatch_directives(path: Path) -> dict:
    """The #SBATCH options of a script, read as sbatch reads them: up to the first command. Also
    checks what sbatch would accept silently but not do: a directive after the first command (not
    read), a misspelt `# SBATCH` (not a directive), a comment after the value (sbatch reads the
    line as it is; the docs ask for comments on lines of their own)."""
    opts, seen_command = {}, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        where = f"{path.name}:{number}: {line!r}"
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            seen_command = True
            continue
        if not line.startswith("#SBATCH "):
            assert not re.match(r"#\s*SBATCH", stripped), f"{where}: not read by sbatch (write '#SBATCH ' first)"
            continue
        assert not seen_command, f"{where}: after the first command, so sbatch ignores it"
        words = stripped.split()[1:]
        assert len(words) == 1 and "#" not in words[0], f"{where}: one option per line, comments on their own line"
        name, _, value = words[0].lstrip("-").partition("=")
        opts[name] = value or True
    return opts


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_header(path):
    """The #SBATCH block: Falcon's partition, account placeholder, time, one launcher per node,
    the GPUs of the script's shape, and the preemption lines (`sbatch --test-only` below checks that
    the real sbatch accepts them)."""
    opts = sbatch_directives(path)
    assert opts["partition"].startswith("a30_"), opts
    assert opts["account"] and opts["time"] and opts["job-name"] == path.stem
    assert re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", opts["time"]), opts["time"]
    assert opts.get("ntasks-per-node") == "1"  # one launcher per node; it starts the GPU processes
    gpus = int(opts["gres"].removeprefix("gpu:"))
    assert gpus == {"1gpu": 1, "2gpu": 2, "multinode": 4}[path.stem.split("_")[1]]
    # preemption (every script): SIGUSR1 to the batch shell 120 s ahead, then requeue
    assert opts["signal"] == "B:USR1@120" and opts.get("requeue") is True and opts.get("open-mode") == "append", opts


def test_docs_mention_every_script():
    docs = (REPO / "docs" / "slurm.md").read_text()
    for path in SCRIPTS:
        assert f"slurm/{path.name}" in docs, path.name


def test_docs_name_the_requeue_cap_and_its_default():
    """MAX_REQUEUES, as slurm/requeue.sh defaults it, in docs/slurm.md's table of variables and its requeue rule."""
    default = re.search(r"^MAX_REQUEUES=\$\{MAX_REQUEUES:-(\d+)\}", (SLURM / "requeue.sh").read_text(), re.M)
    assert default, "slurm/requeue.sh sets no default MAX_REQUEUES"
    docs = (REPO / "docs" / "slurm.md").read_text()
    assert f"| `MAX_REQUEUES` | {default[1]} |" in docs and f"`MAX_REQUEUES` times (default {default[1]};" in docs


def constraints(path: Path) -> dict[str, str]:
    """The requirements of a pip constraints file, {name: specifier}, as pip reads them (comments dropped)."""
    from packaging.requirements import Requirement

    found = {}
    for line in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).strip()
        if line:
            req = Requirement(line)
            assert req.name not in found, f"{path.name}: {req.name} constrained twice"
            found[req.name] = str(req.specifier)
    return found


def test_falcon_constraints_pin_the_modules_torch_and_the_setup_uses_them():
    """slurm/constraints-falcon.txt pins the torch of Falcon's module (2.7.1) and its torchvision (0.22.1), and
    accelerate at the version docs/development.md tested with them; docs/slurm.md's one-time setup installs the
    project with it, so pip never pulls another torch into the venv over the module's."""
    path = SLURM / "constraints-falcon.txt"
    pins = constraints(path)
    assert pins["torch"] == "==2.7.1" and pins["torchvision"] == "==0.22.1", pins
    tested = re.search(
        r"torch 2\.7\.1\S* / torchvision 0\.22\.1\S* / accelerate (\S+?),",
        (REPO / "docs" / "development.md").read_text(),
    )
    assert tested and pins.get("accelerate") == f"=={tested.group(1)}", pins
    assert set(pins) == {"torch", "torchvision", "accelerate"}, f"{path.name} pins what was not tested: {pins}"
    assert "PyTorch/2.7.1-" in (SLURM / "site.sh").read_text()  # the module these pins are for
    docs = (REPO / "docs" / "slurm.md").read_text()
    setup = docs[docs.index("## One-time setup") :].split("\n## ", 1)[0]
    assert re.search(r"^ *\.venv/bin/pip install -c slurm/constraints-falcon\.txt -e \.(\s|$)", setup, re.M), setup


@pytest.mark.slow
def test_missing_data_says_how_to_prepare_it(tmp_path):
    cmd = 'source slurm/common.sh && stage_data && echo "DATA_DIR=$DATA_DIR"'
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS and not k.startswith("SLURM")}
    env.update(DATA_SRC=str(tmp_path / "nothing"), TMPDIR=str(tmp_path / "scratch"))
    result = run(["bash", "-c", cmd], timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    assert "cifar-10-python.tar.gz" in result.stderr and "CIFAR10_URL" in result.stderr, result.stderr
    assert "shared/" not in result.stderr and "prepare_cifar10" not in result.stderr  # nothing a user lacks
    assert f"DATA_DIR={tmp_path / 'scratch' / 'cifar10'}" in result.stdout


@pytest.mark.slow
def test_a_course_job_passes_the_recipe_to_a_script_that_takes_one_and_names_it_in_its_requeue_hint(tmp_path):
    """script_setup gives SCRIPT --recipe "$RECIPE" where its --help lists --recipe (RECIPE=fast is not dropped),
    and a requeue refused tells the course job's command with its SCRIPT."""
    script = tmp_path / "mine.py"
    script.write_text("print('usage: --num-nodes --node-id --num-gpus --recipe --checkpoint-dir --auto-resume')\n")
    cmd = (
        'source slurm/common.sh && job_setup 1 2 >/dev/null && script_setup && echo "ARGS ${SCRIPT_ARGS[*]}" && '
        "REQUEUE_WANTED=1 SLURM_JOB_ID=7 SLURM_JOB_NAME=course_1gpu.sbatch SLURM_RESTART_COUNT=9 requeue_or_exit 75"
    )
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS and not k.startswith("SLURM")}
    env.update(SCRIPT=str(script), RECIPE="fast", RUNS_DIR=str(tmp_path / "runs"), MAX_REQUEUES="1", MODULES="")
    env.update(REPO_DIR=str(REPO), PYTHON=sys.executable)
    result = run(["bash", "-c", cmd], timeout=30, env=env)
    assert "--recipe fast" in next(line for line in result.stdout.splitlines() if line.startswith("ARGS")), result
    assert f"SCRIPT={script} CHECKPOINT_DIR=" in result.stdout + result.stderr, result


# ============================================================================ the cluster, and jobs on it


def test_no_cluster_says_why(monkeypatch):
    """Where Slurm is not installed the cluster says what is missing and installs nothing (no cluster needed)."""
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "missing_commands", lambda: ["slurmctld", "sbatch"])
    monkeypatch.setattr(slurm_cluster.sys, "platform", "linux")
    with pytest.raises(
        Unavailable,
        match=r"^slurmctld, sbatch not installed: install Debian's slurm-client slurmctld "
        r"packages \(as .ci/run does\)$",
    ):
        slurm_cluster.check_installed()
    monkeypatch.setattr(slurm_cluster, "missing_commands", lambda: [])
    slurm_cluster.check_installed()


def test_the_nodes_resolve_alike_whatever_the_machine_hosts_file_says():
    """The nodes' private /etc/hosts drops the machine's own entries for node1 and node2 (a line `127.0.0.1 node1
    node2` would make `getent hosts node2` print both names) and keeps everything else."""
    machine = "127.0.0.1 localhost\n127.0.0.1 node1 node2\n10.0.0.5 node2 gateway # lab\n::1 ip6-localhost\n"
    hosts = private_hosts(machine)
    assert hosts.splitlines()[:3] == ["127.0.0.1 localhost", "10.0.0.5 gateway # lab", "::1 ip6-localhost"]
    entries = [line.split() for line in hosts.splitlines() if line and not line.startswith("#")]
    assert [e for e in entries if "node2" in e] == [["127.0.0.1", "node2"]]
    assert [e for e in entries if "node1" in e] == [["127.0.0.1", "node1"]]


def test_clusters_side_by_side_get_their_own_job_ports(monkeypatch):
    """One cluster per pytest-xdist worker: each slot's jobs use ports (10000 + job id % 20000) of their own."""
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "port_is_free", lambda port: True)
    for slot in (0, 1, 3, 19):
        for _ in range(20):
            ports = {10000 + (first_job_id(slot=slot) + i) % 20000 for i in range(100)}
            assert all(10000 + slot * 1000 <= port < 11000 + slot * 1000 for port in ports), (slot, sorted(ports))


@pytest.fixture(scope="session")
def cluster():
    """A real slurmctld and two slurmd daemons (node1, node2) for the session; see tests/slurm_cluster.py.
    Under pytest-xdist each worker starts its own (own folder, ports, munge socket and share of job ids)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    c = SlurmCluster(log=lambda message: print(f"test cluster: {message}", file=sys.stderr), slot=worker)
    try:
        c.start()
    except Unavailable as exc:
        c.remove()
        # reached only under --slurm (conftest skips these tests otherwise): asked for, so a failure, not a skip
        pytest.fail(f"--slurm, but the test Slurm cluster cannot start: {exc}", pytrace=False)
    yield c
    leftovers = c.stop()
    if os.environ.get("SLURM_TEST_KEEP") == "1":
        print(f"test cluster kept in {c.root}", file=sys.stderr)
    else:
        c.remove()
    assert not leftovers, f"processes of the test cluster's jobs outlived it (killed): {leftovers}"


@dataclass
class Job:
    cluster: SlurmCluster
    job_id: str
    out_file: Path
    runs: Path
    seconds: float = 0.0
    record: dict = field(default_factory=dict)  # `scontrol show job` once it ended
    leftovers: list = field(default_factory=list)

    @property
    def state(self) -> str:
        return self.record.get("JobState", "?")

    @property
    def exit_status(self) -> int:
        """The batch script's exit status (ExitCode=status:signal)."""
        return int(self.record.get("ExitCode", "-1:0").split(":")[0])

    @property
    def restarts(self) -> int:
        return int(self.record.get("Restarts", "0"))

    @property
    def run_dir(self) -> Path:
        return self.runs / self.job_id

    @property
    def output(self) -> str:
        return self.out_file.read_text() if self.out_file.exists() else "(no job output file)"

    @property
    def log(self) -> str:
        path = self.run_dir / "train.log"
        return path.read_text() if path.exists() else "(no train.log)"

    def describe(self) -> str:
        return (
            f"job {self.job_id}: {self.state}, exit code {self.record.get('ExitCode')}, restarts "
            f"{self.restarts}, after {self.seconds:.0f} s\n--- job output {self.out_file}:\n{self.output}\n"
            f"--- the cluster's logs:\n{self.cluster.logs()}"
        )


def job_env(cluster: SlurmCluster, tmp_path: Path, tag: str, **extra) -> dict:
    """The submitting environment (sbatch passes it to the job): this Python, the CPU, the test's folders."""
    env = cluster.client_env({k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS})
    env.update(
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]),
        PYTHON=sys.executable,
        VENV="",
        MODULES="",
        DEVICE="cpu",
        RUNS_DIR=str(tmp_path / "runs"),
        PROBE_DIR=str(tmp_path),
        PYTHONWARNINGS="ignore::UserWarning",
        SLURM_TEST_TAG=tag,
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def tagged(tag: str) -> list[int]:
    return processes_with(f"SLURM_TEST_TAG={tag}".encode())


def kill_job(job: Job, tag: str) -> None:
    """Cancel the job at once and kill whatever of it still runs."""
    job.cluster.command("scancel", "--signal=KILL", "--full", job.job_id, check=False)
    job.cluster.command("scancel", job.job_id, check=False)
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def job_ended(job: Job) -> bool:
    job.record = job.cluster.job(job.job_id)
    return job.state in FINISHED


def sbatch(
    cluster: SlurmCluster,
    tmp_path: Path,
    script,
    *options,
    timeout=HARD_TIMEOUT,
    cwd=REPO,
    account="test",
    during=None,
    **env_extra,
) -> Job:
    """Submit `sbatch [options] script` to the test cluster and wait until the job has ended (requeued
    runs included); its output goes to tmp_path. `during(job)`, if given, is called once the job is
    submitted (to signal it, say). Fails the test if the job is still there after `timeout` s."""
    tag = uuid.uuid4().hex
    env = job_env(cluster, tmp_path, tag, **env_extra)
    cmd = [
        "sbatch",
        "--parsable",
        *([f"--account={account}"] if account else []),
        f"--output={tmp_path / 'job-%j.out'}",
        *options,
        str(script),
    ]
    t0 = time.monotonic()
    submitted = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, f"{cmd}: {submitted.stdout}{submitted.stderr}"
    job_id = submitted.stdout.strip().split(";")[0]
    job = Job(cluster, job_id, tmp_path / f"job-{job_id}.out", tmp_path / "runs")
    try:
        if during is not None:
            during(job)
        while not job_ended(job):
            if time.monotonic() - t0 > timeout:
                job.seconds = time.monotonic() - t0
                pytest.fail(f"the job did not end within {timeout} s (cancelled, processes killed)\n{job.describe()}")
            time.sleep(0.5)
    except BaseException:
        kill_job(job, tag)
        raise
    job.seconds = time.monotonic() - t0
    # Nothing may outlive the job: wait a moment for exiting processes, then kill and report the rest.
    deadline = time.monotonic() + 10
    while (leftovers := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    job.leftovers = leftovers
    if leftovers:
        kill_job(job, tag)
    return job


def wait_for(path: Path, what: str, job: Job, text=None, timeout=300) -> None:
    """Until `path` exists (and holds `text`); fail if the job ends first."""
    deadline = time.monotonic() + timeout
    checked = 0.0
    while time.monotonic() < deadline:
        if path.exists() and (text is None or text in path.read_text()):
            return
        if time.monotonic() - checked > 1:
            checked = time.monotonic()
            if job_ended(job):
                break
        time.sleep(0.05)
    pytest.fail(
        f"{what} never happened ({'the job ended' if job.state in FINISHED else 'timed out'})\n{job.describe()}"
    )


def write_script(tmp_path: Path, body: str, name="probe.sbatch") -> Path:
    path = tmp_path / name
    path.write_text(body)
    path.chmod(0o755)
    return path


# ============================================================================ the cluster


@pytest.mark.slow
def test_sbatch_accepts_the_headers(cluster):
    """The real sbatch parses every script's #SBATCH block, and the request (partition, nodes, GPUs,
    cores) fits two Falcon-shaped nodes: `sbatch --test-only` schedules it without running it."""
    for path in SCRIPTS:
        result = cluster.command("sbatch", "--test-only", path, check=False)
        nodes = r"node\[1-2\]" if "multinode" in path.name else r"node[12]"
        assert result.returncode == 0 and re.search(f"on nodes {nodes} in partition a30_normal_q", result.stderr), (
            f"{path.name}: {result.stderr}"
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "line, message",
    [
        ("#SBATCH --acount=x", "unrecognized option '--acount=x'"),
        ("#SBATCH --time=1h", "Invalid --time specification"),
        ("#SBATCH --gres=gpu:5", "Requested node configuration is not available"),
    ],
)
def test_sbatch_rejects_bad_directives(cluster, tmp_path, line, message):
    """What test_sbatch_accepts_the_headers catches: a misspelt option, a bad time, more GPUs than a node has."""
    script = write_script(tmp_path, f"#!/bin/bash\n#SBATCH --nodes=1\n{line}\necho ran\n")
    result = cluster.command("sbatch", "--test-only", script, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


PROBE = """#!/bin/bash
#SBATCH --nodes=3
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=4
#SBATCH --job-name=probe
#SBATCH --time=0:10:00
echo "batch: $SLURM_JOB_ID $SLURM_JOB_NAME nodes=$SLURM_JOB_NUM_NODES/$SLURM_NNODES list=$SLURM_JOB_NODELIST \
gpus=$SLURM_GPUS_ON_NODE cpus=$SLURM_CPUS_PER_TASK account=$SLURM_JOB_ACCOUNT submit=$SLURM_SUBMIT_DIR \
partition=$SLURM_JOB_PARTITION restart=${SLURM_RESTART_COUNT:-none}"
echo "first: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
echo "resolves: $(getent hosts node2)"
echo "batch tmp: $TMPDIR on $(hostname)"
srun --ntasks-per-node=1 bash -c 'echo "$SLURMD_NODENAME" > "$TMPDIR/mine"
    echo "task $SLURM_PROCID node $SLURM_NODEID of $SLURM_NNODES on $SLURMD_NODENAME host $(hostname) \
gpus $CUDA_VISIBLE_DEVICES tmp $TMPDIR holds $(cat "$TMPDIR"/mine) cores $(taskset -cp $$ | cut -d: -f2)"'
"""


@pytest.mark.slow
def test_what_a_job_sees(cluster, tmp_path):
    """Two nodes, each with its host name, its GPUs (placeholders), its own cores and its own $TMPDIR
    (same path, different disk, gone after the job); the command line overrides #SBATCH --nodes=3."""
    script = write_script(tmp_path, PROBE)
    job = sbatch(cluster, tmp_path, script, "--nodes=2", timeout=60)
    assert job.state == "COMPLETED" and job.exit_status == 0, job.describe()
    out = job.output
    assert (
        f"batch: {job.job_id} probe nodes=2/2 list=node[1-2] gpus=2 cpus=4 account=test submit={REPO} "
        f"partition=a30_normal_q restart=none"
    ) in out, job.describe()
    assert "first: node1" in out and re.search(r"resolves: 127\.0\.0\.1\s+node2", out), job.describe()
    tasks = sorted(line.split() for line in out.splitlines() if line.startswith("task "))
    assert [t[1:12] for t in tasks] == [
        ["0", "node", "0", "of", "2", "on", "node1", "host", "node1", "gpus", "0,1"],
        ["1", "node", "1", "of", "2", "on", "node2", "host", "node2", "gpus", "0,1"],
    ], job.describe()
    batch_tmp = re.search(r"batch tmp: (\S+) on node1", out).group(1)
    assert [t[13] for t in tasks] == [batch_tmp, batch_tmp] and [t[15] for t in tasks] == ["node1", "node2"]
    if len(os.sched_getaffinity(0)) > 1:
        assert tasks[0][17] != tasks[1][17], job.describe()  # each node on its own cores
    for node in NODES:  # the Epilog removed each node's $TMPDIR
        assert not (cluster.scratch(node) / f"job{job.job_id}").exists()
    assert not job.leftovers


@pytest.mark.slow
def test_srun_kill_on_bad_exit(cluster, tmp_path):
    """Node 2 fails at once: --kill-on-bad-exit=1 ends node 1 (which would sleep 120 s) and srun fails."""
    script = write_script(
        tmp_path,
        """#!/bin/bash
#SBATCH --nodes=2
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'if [[ $SLURM_NODEID == 1 ]]; then exit 3; fi; exec sleep 120'
echo "srun status $?"
""",
    )
    job = sbatch(cluster, tmp_path, script, timeout=100)
    assert job.state == "COMPLETED", job.describe()
    assert re.search(r"srun status [1-9]", job.output) and "task 1: Exited with exit code 3" in job.output, (
        job.describe()
    )
    # < 90 s: node 1 left running would sleep 120 s; a job on a loaded machine took 31.6 s (the bound was 30 s)
    assert job.seconds < 90 and not job.leftovers, job.describe()


@pytest.mark.slow
def test_srun_without_kill_waits_for_all(cluster, tmp_path):
    script = write_script(
        tmp_path,
        """#!/bin/bash
#SBATCH --nodes=2
srun bash -c 'if [[ $SLURM_NODEID == 1 ]]; then exit 3; fi; sleep 2; echo "node 0 done"'
echo "srun status $?"
""",
    )
    job = sbatch(cluster, tmp_path, script, timeout=60)
    assert "node 0 done" in job.output and "srun status 3" in job.output, job.describe()


@pytest.mark.slow
def test_srun_passes_sigusr1_on_and_ends_the_step_on_sigterm(cluster, tmp_path):
    """What slurm/common.sh relies on: SIGUSR1 to srun reaches every task (each traps it and ends);
    SIGTERM to srun ends the step ("forcing job termination"), with no time for a checkpoint."""
    script = write_script(
        tmp_path,
        """#!/bin/bash
#SBATCH --nodes=2
task='trap "echo \\"task $SLURM_NODEID got USR1\\"; exit 0" USR1; touch "$PROBE_DIR/up-$SLURM_NODEID"
      while true; do sleep 0.1; done'
srun bash -c "$task" &
pid=$!
until [[ -e $PROBE_DIR/up-0 && -e $PROBE_DIR/up-1 ]]; do sleep 0.1; done
kill -USR1 "$pid"
wait "$pid"
echo "srun status after USR1: $?"
srun bash -c 'trap "echo \\"task $SLURM_NODEID got TERM\\"" TERM; touch "$PROBE_DIR/up2-$SLURM_NODEID"
      sleep 120 & wait' &
pid=$!
until [[ -e $PROBE_DIR/up2-0 && -e $PROBE_DIR/up2-1 ]]; do sleep 0.1; done
kill -TERM "$pid"
wait "$pid"
echo "srun status after TERM: $?"
""",
    )
    job = sbatch(cluster, tmp_path, script, timeout=100)
    out = job.output
    assert "task 0 got USR1" in out and "task 1 got USR1" in out and "srun status after USR1: 0" in out, job.describe()
    assert "forcing job termination" in out and re.search(r"srun status after TERM: [1-9]", out), job.describe()
    # SIGKILL, not SIGTERM. srun reports each node's "Killed" as it hears of it and may exit before the second
    # report; that both tasks ended is what the bound and the leftovers check below establish.
    assert "got TERM" not in out and 1 <= out.count(": Killed") <= 2, job.describe()
    assert job.seconds < 90 and not job.leftovers, job.describe()  # a task left running would sleep 120 s


# ============================================================================ the job scripts, on the CPU


def check_run(job: Job, world_size: int, num_nodes: int, launcher: str) -> dict:
    assert job.state == "COMPLETED" and job.exit_status == 0, job.describe()
    run_dir = job.run_dir
    log = job.log
    epoch_lines = list(EPOCH_LINE.finditer(log))
    assert [int(m[1]) for m in epoch_lines] == [1], log  # --epochs 1, printed by rank 0 only
    assert epoch_lines[0][0] in job.output  # the job's Slurm output file has it too
    assert f"world size: {world_size} = {num_nodes} node(s)" in log
    assert "slurm: partition a30_normal_q, account test" in log
    # the banner's topology is that of the node the job ran on
    topology = (run_dir / "topology.txt").read_text()
    assert re.match(r"--- GPU topology of (node1|node2) ", topology), topology
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    header, epochs = records[0], records[1:]
    assert header["kind"] == "header" and header["world_size"] == world_size, header
    assert header["launcher"] == launcher and header["device"] == "cpu" and header["backend"] == "gloo"
    assert [e["epoch"] for e in epochs] == [1]
    # the printed line is the logged epoch's: the same loss and accuracy, to the printed digits
    printed = re.search(r"Validation Loss = ([\d.]+), Validation Accuracy = ([\d.]+)$", epoch_lines[0][0])
    assert printed.groups() == (f"{epochs[0]['val_loss']:.3f}", f"{epochs[0]['val_accuracy']:.3f}"), (
        epoch_lines[0][0],
        epochs[0],
    )
    # exact metrics over the ranks: a count out of the validation images (an odd number, padded for 2 ranks)
    correct = epochs[0]["val_accuracy"] * header["val_images"]
    assert correct == pytest.approx(round(correct), abs=1e-6), (epochs[0], header["val_images"])
    # every script checkpoints, for a requeue: raw_ddp.py one file, accel_train.py state-<n>/ named by LATEST
    assert f"checkpoints: {run_dir / 'checkpoints'}" in log
    if launcher == "mp.spawn":
        assert (run_dir / "checkpoints" / "checkpoint.pt").is_file()
    else:
        latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
        assert (run_dir / "checkpoints" / latest).is_dir(), latest
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"
    return header


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options, world_size, num_nodes, launcher",
    [
        ("raw_1gpu", [], 1, 1, "mp.spawn"),
        ("raw_2gpu", [], 2, 1, "mp.spawn"),
        ("raw_multinode", ["--gres=gpu:1"], 2, 2, "mp.spawn"),
        ("accel_2gpu", [], 2, 1, "accelerate launch"),
        ("accel_multinode", ["--gres=gpu:1"], 2, 2, "accelerate launch"),
    ],
)
def test_job_script_trains_on_cpu(cluster, tmp_path, cifar_dir, name, options, world_size, num_nodes, launcher):
    """Each script as users submit it (its own #SBATCH lines; the multi-node ones with one GPU per
    node, so one process each), trained one epoch on the CPU."""
    job = sbatch(cluster, tmp_path, SLURM / f"{name}.sbatch", *options, DATA_SRC=cifar_dir, EXTRA_ARGS=SLURM_TINY)
    check_run(job, world_size, num_nodes, launcher)
    log = job.log
    assert f"GPUs on node {world_size // num_nodes}" in log, log  # SLURM_GPUS_ON_NODE from --gres
    if num_nodes > 1:
        # each node staged its own copy into its own $TMPDIR, and they met at the first host, by name
        staged = dict(re.findall(r"node (\d) \((node\d)\): copied \S+ to \S+", log))
        assert staged == {"0": "node1", "1": "node2"}, log
        assert f"rendezvous: node1:{10000 + int(job.job_id) % 20000}" in log, log
    else:
        assert re.search(r"node 0 \(node[12]\): copied \S+ to \S+/cifar10", log), log


@pytest.mark.slow
def test_multinode_failure_ends_the_job(cluster, tmp_path, cifar_dir):
    """Rank 1 (node 2) fails after start-up: the job must fail soon, leaving nothing behind. Soon: srun's
    --kill-on-bad-exit ends node 1 at once, long before rank 0 would give up waiting for rank 1 (--dist-timeout
    600); the bound leaves room for a slow start-up on a loaded machine."""
    job = sbatch(
        cluster,
        tmp_path,
        SLURM / "raw_multinode.sbatch",
        "--gres=gpu:1",
        DATA_SRC=cifar_dir,
        EXTRA_ARGS=SLURM_TINY + " --dist-timeout 600",
        **raise_in_rank_env(1, {}),
    )
    assert job.state == "FAILED" and job.exit_status != 0, job.describe()
    assert "injected test fault in rank 1" in job.output and "FAILED (exit status" in job.output, job.describe()
    assert job.seconds < 300, job.describe()
    assert not job.leftovers


@pytest.mark.slow
def test_submitting_from_elsewhere_says_how(cluster, tmp_path):
    job = sbatch(cluster, tmp_path, SLURM / "raw_2gpu.sbatch", cwd=tmp_path, timeout=60)
    assert job.state == "FAILED" and job.exit_status == 2, job.describe()
    assert "submit from the repository root" in job.output, job.describe()


# The course jobs: a student's own script (SCRIPT), course/cifar10_ddp.py here. 3 epochs the tiny model cannot stop
# early (patience 4), 4 steps each on 2 ranks.
COURSE_TINY = "--model-width 4 --train-subset 256 --val-subset 100 --epochs 3 --patience 4"


def course_job(cluster, tmp_path, cifar_dir, name, script, extra_args=COURSE_TINY, **options) -> Job:
    """slurm/<name>.sbatch submitted with SCRIPT=script; the ranks import this checkout's cifar_wrn."""
    return sbatch(
        cluster, tmp_path, SLURM / f"{name}.sbatch", DATA_SRC=cifar_dir, EXTRA_ARGS=extra_args, SCRIPT=script,
        PYTHONPATH=REPO, **options,
    )  # fmt: skip


@pytest.mark.slow
def test_a_course_job_runs_the_students_script_and_a_sigusr1_does_not_end_it(cluster, tmp_path, cifar_dir):
    """SCRIPT=course/cifar10_ddp.py sbatch slurm/course_2gpu.sbatch: the script gets the job's shape, its own port
    (the job's, not the script's default 29500) and the node's copy of the data; what it prints lands in
    runs/<job id>/train.log. It cannot checkpoint, so a SIGUSR1 after its first epoch is noted, not passed on (it
    would end the training), and the job is not requeued: it trains its 3 epochs and completes."""

    def signal_it(job):
        wait_for(job.run_dir / "train.log", "the first epoch line", job, text="Epoch =  1:")
        preempt(job)

    job = course_job(cluster, tmp_path, cifar_dir, "course_2gpu", "course/cifar10_ddp.py", during=signal_it)
    assert job.state == "COMPLETED" and job.exit_status == 0 and job.restarts == 0, job.describe()
    log, port = job.log, 10000 + int(job.job_id) % 20000
    assert "world size: 2 = 1 node(s) x 2 process(es)" in log and f"rendezvous: node1:{port}" in log, log
    command = f"+ {sys.executable} course/cifar10_ddp.py --num-nodes 1 --node-id 0 --num-gpus 2 --master-addr node1 "
    assert re.search(re.escape(command) + rf"--master-port {port} --data-dir \S+/cifar10 {COURSE_TINY}$", log, re.M)
    assert [int(m[1]) for m in EPOCH_LINE.finditer(log)] == [1, 2, 3], log  # rank 0's lines, once each
    assert all(m[0] in job.output for m in EPOCH_LINE.finditer(log))
    assert "SIGUSR1 received; not passed on, no requeue: course/cifar10_ddp.py cannot checkpoint" in log, log
    assert log.index("Epoch =  1:") < log.index("SIGUSR1 received") and f"job {job.job_id} finished" in log
    assert re.match(r"--- GPU topology of node[12] ", (job.run_dir / "topology.txt").read_text())
    assert not job.leftovers


@pytest.mark.slow
def test_a_course_job_requeues_a_script_that_checkpoints(cluster, tmp_path, cifar_dir):
    """A script whose --help lists --checkpoint-dir and --auto-resume (raw_ddp.py here) gets them, --device and
    --log-json too: a SIGUSR1 checkpoints it, the job requeues, and the requeued run resumes and finishes."""

    def stop(job):
        wait_for(job.run_dir / "log.jsonl", "the first epoch", job, text='"kind": "epoch"')
        preempt(job)

    job = course_job(cluster, tmp_path, cifar_dir, "course_1gpu", "raw_ddp.py", PREEMPT_TINY, during=stop)
    check_requeued_and_resumed(job, steps_per_epoch=80)
    assert "--device cpu --data-dir " in job.log and f"--checkpoint-dir {job.run_dir / 'checkpoints'}" in job.log


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, message",
    [
        ("", r"SCRIPT is not set: name your training script, e\.g\. SCRIPT=my_cifar10\.py sbatch slurm/course_2gpu"),
        (
            "my_cifar10.py",
            r"SCRIPT=my_cifar10\.py: no such file \(a path from the repository root, \S+, or an absolute",
        ),
        ("course/cifar10.py", r"SCRIPT=course/cifar10\.py takes no --num-nodes \(its --help does not list it\)"),
    ],
    ids=["unset", "missing", "single-GPU script"],
)
def test_a_course_job_without_a_script_it_can_run_says_so_in_one_line(cluster, tmp_path, script, message):
    job = sbatch(cluster, tmp_path, SLURM / "course_2gpu.sbatch", timeout=90, SCRIPT=script, PYTHONPATH=REPO)
    assert job.state == "FAILED" and job.exit_status == 2, job.describe()
    errors = [line for line in job.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match("error: " + message, errors[0]), job.describe()
    assert "Traceback" not in job.output, job.describe()
    if script != "course/cifar10.py":  # refused before the run folder is made
        assert not job.run_dir.exists(), job.describe()


# ============================================================================ preemption and requeue


def preempt(job: Job) -> None:
    """What Slurm does 120 s before the time limit (--signal=B:USR1@120): SIGUSR1 to the batch shell only."""
    job.cluster.command("scancel", "--batch", "--signal=USR1", job.job_id)


def cancel(job: Job) -> None:
    """scancel: SIGTERM to every process of the job (KillWait = 30 s later, SIGKILL)."""
    job.cluster.command("scancel", job.job_id)


# The trainers' line after a stop (cifar_wrn/resilience.py): for the tests to read, never the job scripts.
STOPPED = r"stopped by a signal at epoch (\d), step (\d+): checkpoint written to (\S+?);?\s"
# The same in reworded_repo's copy: the job scripts must requeue and resume alike.
REWORDED = r"halted on request in epoch (\d) after step (\d+), saved in (\S+?) \(test wording\)\s"


def stopped_line(log: str, wording: str = STOPPED):
    return re.search(wording, log)


def reworded_repo(tmp_path: Path) -> Path:
    """A copy of the repository (its tracked and unignored files) whose trainers word their stop line otherwise
    (REWORDED): a job submitted from it shows that the scripts' requeue does not read the trainers' wording."""
    copy = tmp_path / "repo"
    listed = run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], timeout=60)
    for name in filter(None, listed.stdout.split("\0")):
        source, target = REPO / name, copy / name
        if source.is_file() or source.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
    path = copy / "cifar_wrn" / "resilience.py"
    text = path.read_text()
    reworded = text.replace(
        'f"stopped by a signal at epoch {epoch + 1}, step {step + 1}"',
        'f"halted on request in epoch {epoch + 1} after step {step + 1}"',
    ).replace(
        'f"{where}: checkpoint written to {checkpoint_written}; rerun with --resume to continue"',
        'f"{where}, saved in {checkpoint_written} (test wording)"',
    )
    assert reworded.count("halted on request") == 1 and "(test wording)" in reworded, (
        "cifar_wrn/resilience.py words its stop line otherwise now: update reworded_repo and STOPPED"
    )
    path.write_text(reworded)
    return copy


# A stand-in for the training, for the batch-shell side: it waits for SIGUSR1 (or SIGTERM) and then
# exits 75 (as raw_ddp.py does after writing its checkpoint); run again after a requeue, it finishes.
# The first lines of the stand-in job scripts below: a requeueable job that sets up its preemption.
PROBE_HEADER = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
REPO_DIR=$SLURM_SUBMIT_DIR
source "$REPO_DIR/slurm/common.sh"
JOB_ID=$SLURM_JOB_ID
export RUN_DIR=$RUNS_DIR/$JOB_ID
LOG=$RUN_DIR/train.log
mkdir -p "$RUN_DIR"
preemption_setup
"""

PREEMPT_PROBE = (
    PROBE_HEADER
    + """echo "run ${SLURM_RESTART_COUNT:-0}, checkpoint args: ${RESUME_ARGS[*]}"
echo $$ > "$RUN_DIR/shell.pid"
run_preemptable "$PYTHON" -c '
import os, pathlib, signal, sys, time
if os.environ.get("SLURM_RESTART_COUNT"):
    print("stand-in " + "resumed", flush=True)  # split: the echoed command line must not match
    sys.exit(0)
def stop(*_):  # scancel sends SIGTERM, and the shell passes a SIGUSR1 on: the first one counts
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(75)
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(os.environ["RUN_DIR"], "ready").write_text(str(os.getpid()))
time.sleep(100)
'
"""
)


@pytest.mark.slow
def test_sigusr1_requeues_and_the_requeued_run_continues(cluster, tmp_path):
    """SIGUSR1 to the batch shell: it passes it to the training, which exits 75; the script runs
    `scontrol requeue` and exits 0; Slurm runs the job again with SLURM_RESTART_COUNT=1, appending
    to the same output file."""
    script = write_script(tmp_path, PREEMPT_PROBE)

    def stop(job):
        wait_for(job.run_dir / "ready", "the stand-in training's start", job)
        preempt(job)

    job = sbatch(cluster, tmp_path, script, timeout=90, during=stop)
    out = job.output
    assert job.state == "COMPLETED" and job.exit_status == 0 and job.restarts == 1, job.describe()
    checkpoints = job.run_dir / "checkpoints"
    assert f"run 0, checkpoint args: --checkpoint-dir {checkpoints} --auto-resume" in out, job.describe()
    assert "SIGUSR1 received; passed on to the training as SIGUSR1" in out, job.describe()
    assert "stopped after" in out and f"job {job.job_id} requeued (scontrol requeue)" in out, job.describe()
    assert "run 1," in out and "stand-in resumed" in out and f"job {job.job_id} finished" in out, job.describe()
    requeued = out.index(f"job {job.job_id} requeued")
    assert out.index("run 0") < requeued < out.index("run 1") < out.index("stand-in resumed")  # appended
    assert "requeued" in job.log and "stand-in resumed" in job.log  # train.log holds both runs too
    assert not job.leftovers


def process_state(pid: int) -> str:
    """The state letter in /proc/<pid>/stat (R, S, T: stopped, Z: exited, not yet reaped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1]
    except FileNotFoundError:
        return "gone"


@pytest.mark.slow
@pytest.mark.parametrize("first", ["training", "shell"])
def test_scancel_is_passed_on_but_not_requeued_whichever_hears_it_first(cluster, tmp_path, first):
    """scancel sends SIGTERM to every process of the job: here the test sends it to the stand-in training and to
    the batch shell, one after the other, in a chosen order. The job must end alike either way: the training
    exits 75, the shell says so and does not requeue (that would undo the scancel), saying how to continue.
    "training": the shell is stopped (SIGSTOP) while the training takes its SIGTERM and exits, and gets its own
    SIGTERM before it goes on (SIGCONT), so its trap runs after the training has ended. "shell": the training is
    stopped while the shell's trap runs (it passes SIGUSR1 on), then gets its own SIGTERM and goes on."""
    script = write_script(tmp_path, PREEMPT_PROBE)

    def stop(job):
        ready = job.run_dir / "ready"
        wait_for(ready, "the stand-in training's start", job)
        while not ready.read_text():  # its process id, being written
            time.sleep(0.05)
        training, shell = int(ready.read_text()), int((job.run_dir / "shell.pid").read_text())
        if first == "training":
            os.kill(shell, signal.SIGSTOP)
            os.kill(training, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while process_state(training) not in ("Z", "gone") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert process_state(training) in ("Z", "gone"), "the stand-in did not exit on SIGTERM"
            os.kill(shell, signal.SIGTERM)
            os.kill(shell, signal.SIGCONT)
        else:
            os.kill(training, signal.SIGSTOP)
            os.kill(shell, signal.SIGTERM)
            wait_for(job.run_dir / "train.log", "the shell's trap", job, text="SIGTERM received; passed on")
            os.kill(training, signal.SIGTERM)
            os.kill(training, signal.SIGCONT)

    job = sbatch(cluster, tmp_path, script, timeout=90, during=stop)
    out = job.output
    assert job.state == "FAILED" and job.exit_status == 75 and job.restarts == 0, job.describe()
    assert "SIGTERM received;" in out and f"job {job.job_id} stopped after" in out, job.describe()
    assert "not requeued after SIGTERM" in out and f"CHECKPOINT_DIR={job.run_dir / 'checkpoints'}" in out
    assert "run 1" not in out and "FAILED" not in out and not job.leftovers, job.describe()


@pytest.mark.slow
def test_requeue_refused_keeps_status_75_and_says_how_to_continue(cluster, tmp_path):
    """Submitted with --no-requeue (it overrides the script's --requeue): scontrol refuses, the job
    ends with status 75 and says how to continue from the checkpoint in a new job."""
    script = write_script(tmp_path, PREEMPT_PROBE)

    def stop(job):
        wait_for(job.run_dir / "ready", "the stand-in training's start", job)
        preempt(job)

    job = sbatch(cluster, tmp_path, script, "--no-requeue", timeout=60, during=stop)
    out = job.output
    assert job.state == "FAILED" and job.exit_status == 75 and job.restarts == 0, job.describe()
    assert f"scontrol requeue {job.job_id} failed" in out and "presently disabled" in out, job.describe()
    assert f"CHECKPOINT_DIR={job.run_dir / 'checkpoints'} sbatch" in out, job.describe()
    assert "run 1" not in out and not job.leftovers


# A stand-in that every run waits for a stop signal: on SIGUSR1 or SIGTERM it exits STAND_IN_STATUS (75 by
# default), first writing a new checkpoints/checkpoint.pt if STAND_IN_CHECKPOINT=1; unsignalled, it finishes
# after STAND_IN_SECONDS. Each run writes its process id to ready-<run>, and the shell's to shell-<run>.pid.
STOP_PROBE = (
    PROBE_HEADER
    + """echo "run ${SLURM_RESTART_COUNT:-0} starts"
echo $$ > "$RUN_DIR/shell-${SLURM_RESTART_COUNT:-0}.pid"
run_preemptable "$PYTHON" -c '
import os, pathlib, signal, sys, time
run_dir = pathlib.Path(os.environ["RUN_DIR"])
def stop(*_):  # the first signal counts
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("STAND_IN_CHECKPOINT") == "1":
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "new.tmp").write_bytes(os.urandom(64))
        os.replace(run_dir / "checkpoints" / "new.tmp", run_dir / "checkpoints" / "checkpoint.pt")
    print("stand-in " + "stops, status " + os.environ.get("STAND_IN_STATUS", "75"), flush=True)
    sys.exit(int(os.environ.get("STAND_IN_STATUS", "75")))
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGTERM, stop)
(run_dir / ("ready-" + os.environ.get("SLURM_RESTART_COUNT", "0"))).write_text(str(os.getpid()))
time.sleep(float(os.environ.get("STAND_IN_SECONDS", "20")))
print("stand-in finished " + "unsignalled", flush=True)
'
"""
)


def preempt_runs(runs: int):
    """during(job): SIGUSR1 to the batch shell of each of the job's first `runs` runs once its stand-in waits."""

    def during(job):
        for n in range(runs):
            wait_for(job.run_dir / f"ready-{n}", f"the stand-in's start in run {n}", job)
            preempt(job)

    return during


@pytest.mark.slow
@pytest.mark.parametrize(
    "status, checkpoint, requeued",
    [(2, False, False), (1, False, False), (1, True, True)],
    ids=["exit-2", "exit-1", "exit-1-new-checkpoint"],
)
def test_after_sigusr1_only_a_stop_with_a_checkpoint_requeues(cluster, tmp_path, status, checkpoint, requeued):
    """SIGUSR1, and the training fails: with no new checkpoint (exit 2: "checkpoint not writable", say) the job
    is not requeued, it ends with the training's status and says why; had it been requeued it would fail the
    same way at every time-limit signal. With a new checkpoint the failure is taken as status 75 and requeued."""
    script = write_script(tmp_path, STOP_PROBE)
    job = sbatch(
        cluster,
        tmp_path,
        script,
        timeout=120,
        during=preempt_runs(1),
        STAND_IN_STATUS=status,
        STAND_IN_CHECKPOINT=int(checkpoint),
        STAND_IN_SECONDS=5,
    )
    out = job.output
    assert f"stand-in stops, status {status}" in out and "SIGUSR1 received; passed on" in out, job.describe()
    if requeued:
        assert job.state == "COMPLETED" and job.exit_status == 0 and job.restarts == 1, job.describe()
        assert "taken as status 75" in out and f"job {job.job_id} requeued" in out, job.describe()
        assert "stand-in finished unsignalled" in out, job.describe()
    else:
        assert job.state == "FAILED" and job.exit_status == status and job.restarts == 0, job.describe()
        assert f"job {job.job_id} FAILED (exit status {status})" in out, job.describe()
        assert f"=== not requeued: the training failed (exit status {status}) after SIGUSR1" in out, job.describe()
        assert "requeued (scontrol" not in out and "run 1" not in out, job.describe()
    assert not job.leftovers, job.describe()


@pytest.mark.slow
def test_requeues_stop_at_max_requeues(cluster, tmp_path):
    """MAX_REQUEUES=1: the training stops with status 75 at each SIGUSR1; the first run requeues, the second (its
    SLURM_RESTART_COUNT=1) does not: it ends with status 75 and says how to continue."""
    script = write_script(tmp_path, STOP_PROBE)
    job = sbatch(cluster, tmp_path, script, timeout=150, during=preempt_runs(2), MAX_REQUEUES=1, STAND_IN_SECONDS=15)
    out = job.output
    assert job.state == "FAILED" and job.exit_status == 75 and job.restarts == 1, job.describe()
    assert out.count(f"job {job.job_id} requeued (scontrol") == 1 and "run 1 starts" in out, job.describe()
    assert out.count(f"job {job.job_id} stopped after") == 2, job.describe()
    assert f"=== not requeued: job {job.job_id} was requeued 1 time(s) already, MAX_REQUEUES=1" in out, job.describe()
    assert f"CHECKPOINT_DIR={job.run_dir / 'checkpoints'} sbatch" in out, job.describe()
    assert "run 2" not in out and "stand-in finished unsignalled" not in out and not job.leftovers, job.describe()


@pytest.mark.slow
def test_a_bad_max_requeues_stops_the_job_at_once(cluster, tmp_path):
    """MAX_REQUEUES that is no whole number: the job stops before the training, saying so (exit status 2)."""
    script = write_script(tmp_path, STOP_PROBE)
    job = sbatch(cluster, tmp_path, script, timeout=60, MAX_REQUEUES="ten", STAND_IN_SECONDS=1)
    assert job.state == "FAILED" and job.exit_status == 2, job.describe()
    assert "error: MAX_REQUEUES=ten: a whole number (0 or more) of requeues, please" in job.output, job.describe()
    assert "run 0 starts" not in job.output, job.describe()


@pytest.mark.slow
def test_a_crash_after_sigterm_is_a_failure(cluster, tmp_path):
    """SIGTERM to the batch shell (the end of the job), and the training fails without a checkpoint (exit 1): the
    job ends with status 1, reported as a failure; nothing says it stopped with a checkpoint to continue from."""
    script = write_script(tmp_path, STOP_PROBE)

    def stop(job):
        wait_for(job.run_dir / "ready-0", "the stand-in's start", job)
        os.kill(int((job.run_dir / "shell-0.pid").read_text()), signal.SIGTERM)

    job = sbatch(cluster, tmp_path, script, timeout=60, during=stop, STAND_IN_STATUS=1, STAND_IN_SECONDS=5)
    out = job.output
    assert job.state == "FAILED" and job.exit_status == 1 and job.restarts == 0, job.describe()
    assert "SIGTERM received; passed on" in out and "stand-in stops, status 1" in out, job.describe()
    assert f"job {job.job_id} FAILED (exit status 1)" in out, job.describe()
    assert "stopped after" not in out and "not requeued" not in out, job.describe()
    assert "To continue from the checkpoint" not in out and "taken as status 75" not in out, job.describe()
    assert not job.leftovers, job.describe()


# Long enough to be stopped in the middle: 320 images / 2 ranks / batch 4 = 40 steps an epoch (about
# 2 s here). 3 epochs: a stop sent after the first epoch lands in the second, or at worst in the third.
PREEMPT_TINY = "--model-width 4 --train-subset 320 --val-subset 101 --batch-size 4 --epochs 3 --set num_workers=0"
# As PREEMPT_TINY, but 80 steps an epoch: the stop reaches accelerate launch up to a second after the
# signal (launch_stoppable reads the stop file every second), and must still land before the last epoch ends.
ACCEL_PREEMPT_TINY = PREEMPT_TINY.replace("--batch-size 4", "--batch-size 2")


def signalled_job(cluster, tmp_path, cifar_dir, name, *options, action, extra_args, repo=REPO) -> Job:
    """<repo>/slurm/<name>.sbatch submitted from `repo` with `options`, training as `extra_args` say; action(job)
    once its first epoch is logged."""

    def during(job):
        wait_for(job.run_dir / "log.jsonl", "the first epoch", job, text='"kind": "epoch"')
        action(job)

    return sbatch(
        cluster,
        tmp_path,
        repo / "slurm" / f"{name}.sbatch",
        *options,
        cwd=repo,
        during=during,
        DATA_SRC=cifar_dir,
        EXTRA_ARGS=extra_args,
    )


def check_requeued_and_resumed(job: Job, steps_per_epoch: int, wording: str = STOPPED) -> re.Match:
    """The job stopped for the signal with a checkpoint (in epoch 2, or 3), requeued itself once, and
    its second run resumed at that step and finished the 3 epochs, appending to the same logs."""
    assert job.state == "COMPLETED" and job.exit_status == 0 and job.restarts == 1, job.describe()
    log = job.log
    stopped = stopped_line(log, wording)
    assert stopped, job.describe()
    assert f"job {job.job_id} stopped after" in log, log  # status 75, or taken as 75 from the training's line
    assert log.count(f"job {job.job_id} requeued") == 1 and "restart 1: this job was requeued" in log, log
    epoch, step, where = stopped.groups()
    assert epoch in ("2", "3"), log
    assert f"Resuming from {where}: epoch {epoch}, step {step} of {steps_per_epoch}" in log, log
    assert stopped.start() < log.index(f"job {job.job_id} requeued") < log.index("Resuming from")
    assert f"job {job.job_id} finished" in log
    records = [json.loads(line) for line in (job.run_dir / "log.jsonl").read_text().splitlines()]
    headers = [r for r in records if r["kind"] == "header"]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2, 3], records  # appended, none twice
    assert len(headers) == 2 and headers[1]["resumed_at"] == {"epoch": int(epoch), "step": int(step)}, headers
    out = job.output  # --open-mode=append: the requeued run's output follows the first run's
    assert out.index("Epoch =  1:") < out.index("restart 1: this job was requeued") < out.index("Epoch =  3:"), out
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"
    return stopped


@pytest.mark.slow
def test_preempted_multinode_job_checkpoints_requeues_and_resumes(cluster, tmp_path, cifar_dir):
    """raw_multinode.sbatch on 2 nodes: SIGUSR1 to the batch shell after the first epoch. The shell
    passes it to srun, srun to both nodes' launchers and ranks; rank 0 writes the checkpoint, the
    training exits 75 (srun may report another status: the new checkpoint makes it 75), the script requeues
    the job; the second run resumes from the checkpoint in the middle of epoch 2 and finishes. Submitted
    from reworded_repo's copy: the script reads no message of the trainer's."""
    repo = reworded_repo(tmp_path)
    job = signalled_job(
        cluster,
        tmp_path,
        cifar_dir,
        "raw_multinode",
        "--gres=gpu:1",
        action=preempt,
        extra_args=PREEMPT_TINY,
        repo=repo,
    )
    stopped = check_requeued_and_resumed(job, steps_per_epoch=40, wording=REWORDED)
    assert stopped.group(3) == str(job.run_dir / "checkpoints" / "checkpoint.pt"), job.log
    assert "SIGUSR1 received; passed on to the training as SIGUSR1" in job.log
    assert (job.run_dir / "checkpoints" / "checkpoint.pt").is_file()
    assert not stopped_line(job.log) and f"repo: {repo}," in job.log, job.log  # the copy's trainer, reworded


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options, reworded",
    [
        ("accel_multinode", ["--gres=gpu:1"], False),
        ("accel_2gpu", [], True),
    ],
)
def test_preempted_accelerate_job_checkpoints_requeues_and_resumes(
    cluster, tmp_path, cifar_dir, name, options, reworded
):
    """An accel_* script: SIGUSR1 to the batch shell after the first epoch. The shell must not pass
    SIGUSR1 on (it would kill `accelerate launch`): it writes "stop" into runs/<job id>/stop-request,
    launch_stoppable on each node sends its accelerate launch SIGTERM, the launcher passes it to its
    ranks, which write a checkpoint (DIR/LATEST) and exit 75; accelerate launch fails (1 or 143), the script
    sees the new LATEST, takes the status as 75, requeues the job, and the second run resumes at that step and
    finishes. accel_2gpu is submitted from reworded_repo's copy: the script reads no message of the trainer's."""
    repo = reworded_repo(tmp_path) if reworded else REPO
    wording = REWORDED if reworded else STOPPED
    job = signalled_job(
        cluster, tmp_path, cifar_dir, name, *options, action=preempt, extra_args=ACCEL_PREEMPT_TINY, repo=repo
    )
    stopped = check_requeued_and_resumed(job, steps_per_epoch=80, wording=wording)
    checkpoints = job.run_dir / "checkpoints"
    log = job.log
    assert f"checkpoints: {checkpoints} (a requeued run resumes from there)" in log, log
    assert "SIGUSR1 received; passed on to the training through" in log, log
    nodes = 2 if "multinode" in name else 1
    assert log.count("stop requested: SIGTERM to accelerate launch") == nodes, log
    assert Path(stopped.group(3)).parent == checkpoints, log
    assert "taken as status 75" in log and "stopped after" in log, log  # accelerate launch itself fails
    assert (checkpoints / "LATEST").is_file()
    if reworded:
        assert not stopped_line(log) and f"repo: {repo}," in log, log  # the copy's trainer, reworded


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, options, checkpoint",
    [
        ("raw_multinode", ["--gres=gpu:1"], "checkpoint.pt"),
        ("accel_multinode", ["--gres=gpu:1"], "state-"),
    ],
)
def test_cancelled_multinode_job_checkpoints_and_is_not_requeued(
    cluster, tmp_path, cifar_dir, name, options, checkpoint
):
    """scancel after the first epoch: SIGTERM to every process of the job, ranks included (SIGKILL
    30 s later). The training must still write its checkpoint in the middle of epoch 2, and the job
    must end cancelled, not requeued, saying how to continue from the checkpoint."""
    job = signalled_job(cluster, tmp_path, cifar_dir, name, *options, action=cancel, extra_args=ACCEL_PREEMPT_TINY)
    assert job.state == "CANCELLED" and job.restarts == 0, job.describe()
    log = job.log
    assert "SIGTERM received;" in log, job.describe()
    stopped = stopped_line(log)
    assert stopped and stopped.group(1) in ("2", "3"), job.describe()
    assert Path(stopped.group(3)).name.startswith(checkpoint) and Path(stopped.group(3)).exists(), job.describe()
    assert f"job {job.job_id} stopped after" in log, job.describe()  # status 75, or taken as 75
    assert "not requeued after SIGTERM" in log and "restart 1" not in log, job.describe()
    records = [json.loads(line) for line in (job.run_dir / "log.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "header"]) == 1, records
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"


# The accel_* side, with a stand-in for `accelerate launch` on 2 nodes, run through launch_stoppable
# as accel_multinode.sbatch does: SIGUSR1 would kill it (as it kills accelerate launch); on SIGTERM
# node 0's writes a new checkpoints/LATEST, and both exit 1.
ACCEL_PREEMPT_PROBE = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
export REPO_DIR=$SLURM_SUBMIT_DIR
source "$REPO_DIR/slurm/common.sh"
JOB_ID=$SLURM_JOB_ID
export RUN_DIR=$RUNS_DIR/$JOB_ID PYTHON
LOG=$RUN_DIR/train.log
mkdir -p "$RUN_DIR"
accel_preemption_setup
echo "run ${SLURM_RESTART_COUNT:-0}, stop file: $(cat "$STOP_FILE")"
run_preemptable srun --kill-on-bad-exit=1 \\
    bash -c 'source "$REPO_DIR/slurm/common.sh" && launch_stoppable "$1" "$PYTHON" -c "$2"' bash "$STOP_FILE" '
import os, pathlib, signal, sys, time
node = os.environ["SLURM_NODEID"]
def term(*_):
    if node == "0":  # a new checkpoint, as accel_train.py publishes one once every rank has saved
        folder = pathlib.Path(os.environ["RUN_DIR"], "checkpoints")
        folder.mkdir(exist_ok=True)
        (folder / "LATEST.tmp").write_text("state-1\\n")
        os.replace(folder / "LATEST.tmp", folder / "LATEST")
    print(f"stand-in {node} got " + "SIGTERM", flush=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, term)
if os.environ.get("SLURM_RESTART_COUNT"):
    print("stand-in " + "resumed", flush=True)
    sys.exit(0)
pathlib.Path(os.environ["RUN_DIR"], "ready-" + node).touch()
time.sleep(100)
'
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["preempt", "scancel"])
def test_accel_stop_goes_through_the_stop_file(cluster, tmp_path, how):
    """accel_*-style script on 2 nodes. Preemption (SIGUSR1 to the batch shell): never passed on as a
    signal (SIGUSR1 would kill accelerate launch), but written into the stop file; launch_stoppable
    on each node sends its launcher SIGTERM; the launchers exit 1, the new checkpoints/LATEST makes
    that status 75, and the job requeues (the second run finishes). scancel
    (SIGTERM to every process): the launchers get it from Slurm directly; status 75 again; no requeue."""
    script = write_script(tmp_path, ACCEL_PREEMPT_PROBE)

    def stop(job):
        for node in (0, 1):
            wait_for(job.run_dir / f"ready-{node}", "the stand-in's start", job)
        (preempt if how == "preempt" else cancel)(job)

    job = sbatch(cluster, tmp_path, script, timeout=90, during=stop)
    out = job.output
    stop_file = job.run_dir / "stop-request"
    assert "run 0, stop file: run" in out, job.describe()
    assert "stand-in 0 got SIGTERM" in out and "stand-in 1 got SIGTERM" in out, job.describe()
    assert "taken as status 75" in out and "stopped after" in out, job.describe()
    if how == "preempt":
        assert f"SIGUSR1 received; passed on to the training through {stop_file}" in out, job.describe()
        assert out.count("stop requested: SIGTERM to accelerate launch") == 2, job.describe()
        assert job.state == "COMPLETED" and job.exit_status == 0 and job.restarts == 1, job.describe()
        assert f"job {job.job_id} requeued" in out and "run 1, stop file: run" in out, job.describe()
        assert "stand-in resumed" in out and f"job {job.job_id} finished" in out, job.describe()
    else:
        assert "SIGTERM received;" in out, job.describe()
        assert job.state == "CANCELLED" and job.restarts == 0, job.describe()
        assert "not requeued after SIGTERM" in out and "run 1" not in out, job.describe()
    assert not job.leftovers, job.describe()
