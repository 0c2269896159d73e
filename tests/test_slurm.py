"""The Slurm job scripts in slurm/, proved on one machine with the fake Slurm in tests/fake_slurm/.

Static checks (bash -n, shellcheck, every referenced file exists), the fakes themselves, then each
job script run end to end on the CPU: tiny model, synthetic data, gloo. See docs/slurm.md.

Every test that starts processes runs them in a new session and, on a hard timeout, kills that
session's process group and every process carrying the test's tag in its environment (torchrun
starts its workers in sessions of their own), so a hang fails instead of lingering.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from raw_ddp import port_is_free

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "fake_slurm"
SLURM = REPO / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
SHELL_FILES = SCRIPTS + sorted(SLURM.glob("*.sh")) + sorted((REPO / "bench").glob("*.sh"))
HARD_TIMEOUT = 240  # seconds for one fake job
TINY = "--model-width 4 --train-subset 200 --val-subset 101 --epochs 1 --set num_workers=0"

sys.path.insert(0, str(FAKE))
import fakeslurm  # noqa: E402

# Variables the scripts read: a developer's own values must not leak into the tests.
SCRIPT_KNOBS = {"DEVICE", "GPUS_PER_NODE", "RECIPE", "EXTRA_ARGS", "SAVE_MODEL", "MASTER_ADDR", "MASTER_PORT",
                "DATA_DIR", "DATA_SRC", "REPO_DIR", "RUNS_DIR", "MODULES", "MODULE_RESET", "VENV", "PYTHON",
                "ACCELERATE", "ACCEL_CONFIG", "ACCEL_ARGS", "ACCELERATE_USE_CPU", "RANK", "LOCAL_RANK",
                "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CIFAR_WRN_TEST_RAISE_IN_RANK"}


def test_scripts_are_there():
    names = {p.name for p in SCRIPTS}
    assert {"raw_1gpu.sbatch", "raw_2gpu.sbatch", "raw_multinode.sbatch", "accel_2gpu.sbatch",
            "accel_multinode.sbatch"} <= names
    for path in SCRIPTS + [FAKE / "sbatch", FAKE / "srun", FAKE / "scontrol"]:
        assert os.access(path, os.X_OK), f"{path} is not executable"


# ============================================================================ static checks

@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(path):
    result = run_isolated(["bash", "-n", path], timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shellcheck(path):
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck is not installed, and CI=true: install it (apt-get install shellcheck)")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    # -x follows `source` (the `# shellcheck source=` paths are relative to the repository root)
    result = run_isolated(["shellcheck", "-x", path.relative_to(REPO)], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


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


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_header(path):
    """sbatch reads the #SBATCH block (the fake rejects any option it does not know, as sbatch does)."""
    opts = {}
    for number, words in fakeslurm.read_directives(path):
        found, rest = fakeslurm.parse_options(words, fakeslurm.SBATCH_OPTIONS, "sbatch", f" in {path}:{number}")
        assert not rest
        opts.update(found)
    assert opts["partition"].startswith("a30_"), opts
    assert opts["account"] and opts["time"] and opts["job-name"] == path.stem
    fakeslurm.check_time(opts["time"], "sbatch")
    assert opts.get("ntasks-per-node") == "1"  # one launcher per node; it starts the GPU processes
    gpus = fakeslurm.gpus_per_node(opts, "sbatch")
    assert gpus == {"1gpu": 1, "2gpu": 2, "multinode": 4}[path.stem.split("_")[1]]
    # preemption (every script): SIGUSR1 to the batch shell 120 s ahead, then requeue
    assert opts["signal"] == "B:USR1@120" and opts.get("requeue") and opts.get("open-mode") == "append", opts
    fakeslurm.check_signal(opts["signal"], "sbatch")
    # every #SBATCH line comes before the first command, or sbatch ignores it
    text = path.read_text()
    first_command = next(i for i, line in enumerate(text.splitlines()) if line.strip() and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))


def test_docs_mention_every_script():
    docs = (REPO / "docs" / "slurm.md").read_text()
    for path in SCRIPTS:
        assert f"slurm/{path.name}" in docs, path.name


# ============================================================================ running things

def session_processes(sid: int, tag: str) -> list[int]:
    """Processes of session `sid`, or with FAKE_SLURM_TEST_TAG=tag in their environment (Linux /proc)."""
    found = []
    if not Path("/proc/self/stat").exists():
        return found
    needle = f"FAKE_SLURM_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            session = int(stat.rsplit(")", 1)[1].split()[4])
            environ = (entry / "environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if session == sid or needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_all(sid: int, tag: str) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_processes(sid, tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def job_id_with_free_port() -> str:
    """A fake job id whose derived MASTER_PORT (10000 + id % 20000, as in slurm/common.sh) is free."""
    for _ in range(200):
        job_id = random.randint(100000, 999999)
        if port_is_free(10000 + job_id % 20000):
            return str(job_id)
    raise RuntimeError("no free port found")


class Job:
    def __init__(self, returncode, stdout, stderr, seconds, job_id, out_file, runs, leftovers):
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds
        self.job_id, self.out_file, self.runs, self.leftovers = job_id, out_file, runs, leftovers

    @property
    def output(self) -> str:
        return self.out_file.read_text() if self.out_file.exists() else "(no job output file)"

    def describe(self) -> str:
        return (f"exit status {self.returncode} after {self.seconds:.0f} s\n--- sbatch stdout:\n{self.stdout}\n"
                f"--- sbatch stderr:\n{self.stderr}\n--- job output {self.out_file}:\n{self.output}")


def fake_env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SLURMD_", "SBATCH_", "FAKE_SLURM_")) and k not in SCRIPT_KNOBS}
    env.update(PATH=os.pathsep.join([str(FAKE), str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHON=sys.executable, VENV="", MODULES="", DEVICE="cpu", CUDA_VISIBLE_DEVICES="",
               RUNS_DIR=str(tmp_path / "runs"), FAKE_SLURM_ROOT=str(tmp_path / "fake-slurm"),
               FAKE_SLURM_KILL_WAIT="3", PYTHONWARNINGS="ignore::UserWarning")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_isolated(cmd, timeout: float, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    """subprocess.run in a new session; a timeout kills the whole session and fails the test."""
    tag = uuid.uuid4().hex
    env = dict(env or os.environ, FAKE_SLURM_TEST_TAG=tag)
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc.pid, tag)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{cmd} hung: killed after {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}")
    kill_all(proc.pid, tag)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def sbatch(tmp_path: Path, script, *options, timeout=HARD_TIMEOUT, cwd=REPO, account="test", during=None,
           **env_extra) -> Job:
    """Run `sbatch [options] script` with the fake Slurm; the job output goes to tmp_path.
    `during(proc, job_id)`, if given, is called while the job runs (to signal it, say)."""
    job_id = job_id_with_free_port()
    tag = uuid.uuid4().hex
    env = fake_env(tmp_path, FAKE_SLURM_JOB_ID=job_id, FAKE_SLURM_TEST_TAG=tag, **env_extra)
    out_file = tmp_path / f"job-{job_id}.out"
    cmd = [str(FAKE / "sbatch"), *([f"--account={account}"] if account else []), f"--output={out_file}",
           *options, str(script)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        if during is not None:
            during(proc, job_id)
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        exited = proc.poll() is not None
        kill_all(proc.pid, tag)
        stdout, stderr = proc.communicate()
        job = Job(proc.returncode, stdout, stderr, time.monotonic() - t0, job_id, out_file, tmp_path / "runs", [])
        pytest.fail(f"the fake job {'left processes holding its output' if exited else 'hung'}: killed after "
                    f"{timeout} s\n{job.describe()}")
    except BaseException:  # `during` failed: nothing may outlive the test
        kill_all(proc.pid, tag)
        proc.communicate()
        raise
    seconds = time.monotonic() - t0
    # Nothing may outlive the job: wait a moment for exiting processes, then kill and report the rest.
    deadline = time.monotonic() + 10
    while (leftovers := session_processes(proc.pid, tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_all(proc.pid, tag)
    return Job(proc.returncode, stdout, stderr, seconds, job_id, out_file, tmp_path / "runs", leftovers)


def write_script(tmp_path: Path, body: str, name="probe.sbatch") -> Path:
    path = tmp_path / name
    path.write_text(body)
    path.chmod(0o755)
    return path


# ============================================================================ the fakes

@pytest.mark.parametrize("spec, names", [
    ("fal040", ["fal040"]),
    ("fal[040-042,7]", ["fal040", "fal041", "fal042", "fal7"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("127.0.0.[1-3]", ["127.0.0.1", "127.0.0.2", "127.0.0.3"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
])
def test_hostlist_expansion(spec, names):
    assert fakeslurm.expand_hostlist(spec) == names
    result = run_isolated([FAKE / "scontrol", "show", "hostnames", spec], timeout=30)
    assert result.returncode == 0 and result.stdout.split() == names, result.stderr


@pytest.mark.parametrize("spec", ["a[1-", "a]1", "a[3-1]", "a[x]"])
def test_hostlist_errors(spec):
    with pytest.raises(fakeslurm.FakeSlurmError):
        fakeslurm.expand_hostlist(spec)


PROBE = """#!/bin/bash
#SBATCH --account=probe
#SBATCH --nodes=3
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=4
#SBATCH --job-name=probe
#SBATCH --time=0:10:00
echo "batch: $SLURM_JOB_ID $SLURM_JOB_NAME nodes=$SLURM_JOB_NUM_NODES/$SLURM_NNODES list=$SLURM_JOB_NODELIST \
gpus=$SLURM_GPUS_ON_NODE cpus=$SLURM_CPUS_PER_TASK account=$SLURM_JOB_ACCOUNT submit=$SLURM_SUBMIT_DIR"
echo "first: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
echo "batch tmp: $TMPDIR"
srun --ntasks-per-node=1 bash -c \
    'echo "task $SLURM_PROCID node $SLURM_NODEID of $SLURM_NNODES on $SLURMD_NODENAME tmp $TMPDIR"'
"""


def test_fake_sbatch_and_srun_environment(tmp_path):
    script = write_script(tmp_path, PROBE)
    job = sbatch(tmp_path, script, "--nodes=2", timeout=60)  # the command line overrides #SBATCH --nodes=3
    assert job.returncode == 0, job.describe()
    out = job.output
    assert f"batch: {job.job_id} probe nodes=2/2 list=127.0.0.[1-2] gpus=2 cpus=4 account=test submit={REPO}" in out
    assert "first: 127.0.0.1" in out
    tasks = sorted(line.split() for line in out.splitlines() if line.startswith("task "))
    assert [t[1:7] for t in tasks] == [["0", "node", "0", "of", "2", "on"], ["1", "node", "1", "of", "2", "on"]]
    assert [t[7] for t in tasks] == ["127.0.0.1", "127.0.0.2"]
    batch_tmp = re.search(r"batch tmp: (\S+)", out).group(1)
    assert tasks[0][9] == batch_tmp and tasks[1][9] != batch_tmp  # node-local scratch: one per node
    assert not Path(batch_tmp).exists()  # gone with the job, like $TMPDIR
    assert not job.leftovers


@pytest.mark.parametrize("line, message", [
    ("#SBATCH --acount=x", "unrecognized option '--acount=x'"),
    ("#SBATCH --time=1:00:00 # one hour", "comments on their own line"),
    ("# SBATCH --time=1:00:00", "not read by sbatch"),
    ("#SBATCH --time=1h", "invalid --time"),
])
def test_fake_sbatch_rejects_bad_directives(tmp_path, line, message):
    script = write_script(tmp_path, f"#!/bin/bash\n#SBATCH --nodes=1\n{line}\necho ran\n")
    job = sbatch(tmp_path, script, timeout=60)
    assert job.returncode != 0 and message in job.stderr, job.describe()
    assert not job.out_file.exists()


def test_fake_sbatch_needs_an_account(tmp_path):
    script = write_script(tmp_path, "#!/bin/bash\necho ran\n")
    job = sbatch(tmp_path, script, account=None, timeout=60)
    assert job.returncode == 1 and "--account" in job.stderr and not job.out_file.exists(), job.describe()


def test_fake_srun_kill_on_bad_exit(tmp_path):
    """Node 1 fails at once: --kill-on-bad-exit=1 ends node 0 (which would sleep 120 s) and srun fails."""
    script = write_script(tmp_path, """#!/bin/bash
#SBATCH --nodes=2
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'if [[ $SLURM_NODEID == 1 ]]; then exit 3; fi; exec sleep 120'
echo "srun status $?"
""")
    job = sbatch(tmp_path, script, timeout=60)
    assert job.returncode == 0, job.describe()
    assert "srun status 3" in job.output and "task 1: Exited with exit code 3" in job.output, job.describe()
    assert job.seconds < 30, job.describe()
    assert not job.leftovers


def test_fake_srun_without_kill_waits_for_all(tmp_path):
    script = write_script(tmp_path, """#!/bin/bash
#SBATCH --nodes=2
srun bash -c 'if [[ $SLURM_NODEID == 1 ]]; then exit 3; fi; sleep 2; echo "node 0 done"'
echo "srun status $?"
""")
    job = sbatch(tmp_path, script, timeout=60)
    assert "node 0 done" in job.output and "srun status 3" in job.output, job.describe()


def test_fake_srun_passes_sigusr1_on_and_kills_on_sigterm(tmp_path):
    """Like the real srun: SIGUSR1 reaches every task (it traps it and ends); SIGTERM kills them."""
    script = write_script(tmp_path, """#!/bin/bash
#SBATCH --nodes=2
task='trap "echo \\"task $SLURM_NODEID got USR1\\"; exit 0" USR1; touch "$FAKE_SLURM_JOB_DIR/up-$SLURM_NODEID"
      while true; do sleep 0.1; done'
srun bash -c "$task" &
pid=$!
until [[ -e $FAKE_SLURM_JOB_DIR/up-0 && -e $FAKE_SLURM_JOB_DIR/up-1 ]]; do sleep 0.1; done
kill -USR1 "$pid"
wait "$pid"
echo "srun status after USR1: $?"
srun bash -c 'touch "$FAKE_SLURM_JOB_DIR/up2-$SLURM_NODEID"; exec sleep 120' &
pid=$!
until [[ -e $FAKE_SLURM_JOB_DIR/up2-0 && -e $FAKE_SLURM_JOB_DIR/up2-1 ]]; do sleep 0.1; done
kill -TERM "$pid"
wait "$pid"
echo "srun status after TERM: $?"
""")
    job = sbatch(tmp_path, script, timeout=60)
    out = job.output
    assert "task 0 got USR1" in out and "task 1 got USR1" in out and "srun status after USR1: 0" in out, job.describe()
    assert "forcing job termination" in out and "srun status after TERM: 143" in out, job.describe()
    assert job.seconds < 30 and not job.leftovers, job.describe()


def test_fake_srun_outside_a_job():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FAKE_SLURM_"))}
    result = run_isolated([FAKE / "srun", "true"], timeout=30, env=env)
    assert result.returncode == 1 and "not inside a job" in result.stderr


# ============================================================================ the job scripts, on the CPU

def check_run(job: Job, world_size: int, num_nodes: int, launcher: str) -> dict:
    assert job.returncode == 0, job.describe()
    run_dir = job.runs / job.job_id
    log = (run_dir / "train.log").read_text()
    epoch_lines = [line for line in log.splitlines() if re.match(r"Epoch = +1: Cumulative Time = ", line)]
    assert len(epoch_lines) == 1, log  # rank 0 only
    assert epoch_lines[0] in job.output  # the job's Slurm output file has it too
    assert f"world size: {world_size} = {num_nodes} node(s)" in log
    assert "nvidia-smi" in (run_dir / "topology.txt").read_text()
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    header, epochs = records[0], records[1:]
    assert header["kind"] == "header" and header["world_size"] == world_size, header
    assert header["launcher"] == launcher and header["device"] == "cpu" and header["backend"] == "gloo"
    assert [e["epoch"] for e in epochs] == [1] and 0 <= epochs[0]["val_accuracy"] <= 1
    # every script checkpoints, for a requeue: raw_ddp.py one file, accel_train.py state-<n>/ named by LATEST
    assert f"checkpoints: {run_dir / 'checkpoints'}" in log
    if launcher == "mp.spawn":
        assert (run_dir / "checkpoints" / "checkpoint.pt").is_file()
    else:
        latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
        assert (run_dir / "checkpoints" / latest).is_dir(), latest
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"
    return header


@pytest.mark.parametrize("name, options, world_size, num_nodes, launcher", [
    ("raw_1gpu", [], 1, 1, "mp.spawn"),
    ("raw_2gpu", [], 2, 1, "mp.spawn"),
    ("raw_multinode", ["--nodes=2", "--gres=gpu:1"], 2, 2, "mp.spawn"),
    ("accel_2gpu", [], 2, 1, "accelerate launch"),
    ("accel_multinode", ["--nodes=2", "--gres=gpu:1"], 2, 2, "accelerate launch"),
])
def test_job_script_trains_on_cpu(tmp_path, cifar_dir, name, options, world_size, num_nodes, launcher):
    job = sbatch(tmp_path, SLURM / f"{name}.sbatch", *options, DATA_SRC=cifar_dir, EXTRA_ARGS=TINY)
    check_run(job, world_size, num_nodes, launcher)
    log = (job.runs / job.job_id / "train.log").read_text()
    if num_nodes > 1:
        # both nodes staged their own copy, in their own $TMPDIR, and met at the first host
        staged = re.findall(r"node (\d) \(.*?\): copied \S+ to (\S+)", log)
        assert sorted(n for n, _ in staged) == ["0", "1"] and staged[0][1] != staged[1][1], log
        assert f"rendezvous: 127.0.0.1:{10000 + int(job.job_id) % 20000}" in log
    else:
        assert "copied" in log and "cifar10" in log


def test_multinode_failure_ends_the_job(tmp_path, cifar_dir):
    """Rank 1 (node 1) fails after start-up: the job must fail soon, leaving nothing behind."""
    job = sbatch(tmp_path, SLURM / "raw_multinode.sbatch", "--nodes=2", "--gres=gpu:1", DATA_SRC=cifar_dir,
                 EXTRA_ARGS=TINY + " --dist-timeout 120", CIFAR_WRN_TEST_RAISE_IN_RANK=1)
    assert job.returncode != 0, job.describe()
    assert "injected test fault in rank 1" in job.output and "FAILED (exit status" in job.output, job.describe()
    assert job.seconds < 100, job.describe()
    assert not job.leftovers


def test_submitting_from_elsewhere_says_how(tmp_path):
    job = sbatch(tmp_path, SLURM / "raw_2gpu.sbatch", cwd=tmp_path, timeout=60)
    assert job.returncode == 2 and "submit from the repository root" in job.output, job.describe()


def test_missing_data_says_how_to_prepare_it(tmp_path):
    cmd = 'source slurm/common.sh && stage_data && echo "DATA_DIR=$DATA_DIR"'
    env = fake_env(tmp_path, DATA_SRC=tmp_path / "nothing", TMPDIR=tmp_path / "scratch")
    result = run_isolated(["bash", "-c", cmd], timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    assert "prepare_cifar10.py" in result.stderr and "download" in result.stderr
    assert f"DATA_DIR={tmp_path / 'scratch' / 'cifar10'}" in result.stdout


# ============================================================================ preemption and requeue

# A stand-in for the training, for the batch-shell side: it waits for SIGUSR1 and then exits 75 (as
# raw_ddp.py does after writing its checkpoint); run again after a requeue, it finishes at once.
PREEMPT_PROBE = """#!/bin/bash
#SBATCH --account=probe
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
echo "run ${SLURM_RESTART_COUNT:-0}, checkpoint args: ${RESUME_ARGS[*]}"
run_preemptable "$PYTHON" -c '
import os, pathlib, signal, sys, time
if os.environ.get("SLURM_RESTART_COUNT"):
    print("stand-in " + "resumed", flush=True)  # split: the echoed command line must not match
    sys.exit(0)
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
pathlib.Path(os.environ["RUN_DIR"], "ready").touch()
time.sleep(100)
'
"""


def wait_for(path: Path, what: str, proc: subprocess.Popen, job_id: str, tmp_path: Path, text=None, timeout=150):
    """Until `path` exists (and holds `text`); fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (text is None or text in path.read_text()):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    out = tmp_path / f"job-{job_id}.out"
    pytest.fail(f"{what} never happened (job {'ended' if proc.poll() is not None else 'still running'})\n"
                f"--- job output:\n{out.read_text() if out.exists() else '(none)'}")


def batch_shell(sbatch_pid: int) -> int:
    """The fake sbatch's child: the batch shell running the script (Linux /proc)."""
    children = Path(f"/proc/{sbatch_pid}/task/{sbatch_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_sigusr1_requeues_and_the_requeued_run_continues(tmp_path):
    """SIGUSR1 to the batch shell (the fake sbatch passes it on, like --signal=B:USR1): the shell
    passes it to the training, which exits 75; the script runs `scontrol requeue` and exits 0; the
    fake sbatch runs the job again with SLURM_RESTART_COUNT=1, appending to the same output file."""
    script = write_script(tmp_path, PREEMPT_PROBE)
    calls = tmp_path / "scontrol.log"

    def preempt(proc, job_id):
        wait_for(tmp_path / "runs" / job_id / "ready", "the stand-in training start", proc, job_id, tmp_path)
        os.kill(proc.pid, signal.SIGUSR1)

    job = sbatch(tmp_path, script, timeout=60, during=preempt, FAKE_SLURM_SCONTROL_LOG=calls)
    out = job.output
    assert job.returncode == 0, job.describe()
    checkpoints = job.runs / job.job_id / "checkpoints"
    assert f"run 0, checkpoint args: --checkpoint-dir {checkpoints} --auto-resume" in out, job.describe()
    assert "SIGUSR1 received; passed on to the training as SIGUSR1" in out, job.describe()
    assert "stopped after" in out and f"job {job.job_id} requeued (scontrol requeue)" in out, job.describe()
    assert "run 1," in out and "stand-in resumed" in out and f"job {job.job_id} finished" in out, job.describe()
    requeued = out.index(f"job {job.job_id} requeued")
    assert out.index("run 0") < requeued < out.index("run 1") < out.index("stand-in resumed")  # appended
    assert calls.read_text().splitlines() == [f"scontrol requeue {job.job_id}"]
    log = (job.runs / job.job_id / "train.log").read_text()
    assert "requeued" in log and "stand-in resumed" in log  # train.log holds both runs too
    assert not job.leftovers


def test_sigterm_checkpoints_but_does_not_requeue(tmp_path):
    """SIGTERM to the batch shell (what scancel sends): passed on as SIGUSR1, so the training still
    checkpoints, but no requeue, which would undo the scancel; the job ends with status 75."""
    if not Path("/proc/self/task").exists():
        pytest.skip("needs Linux /proc to find the batch shell")
    script = write_script(tmp_path, PREEMPT_PROBE)
    calls = tmp_path / "scontrol.log"

    def cancel(proc, job_id):
        wait_for(tmp_path / "runs" / job_id / "ready", "the stand-in training start", proc, job_id, tmp_path)
        os.kill(batch_shell(proc.pid), signal.SIGTERM)

    job = sbatch(tmp_path, script, timeout=60, during=cancel, FAKE_SLURM_SCONTROL_LOG=calls)
    out = job.output
    assert job.returncode == 75, job.describe()
    assert "SIGTERM received; passed on to the training as SIGUSR1" in out and "stopped after" in out, job.describe()
    assert "not requeued after SIGTERM" in out and f"CHECKPOINT_DIR={job.runs / job.job_id / 'checkpoints'}" in out
    assert not calls.exists() and "run 1" not in out and not job.leftovers, job.describe()  # no scontrol call


def test_requeue_refused_keeps_status_75_and_says_how_to_continue(tmp_path):
    """Submitted with --no-requeue (it overrides the script's --requeue): scontrol refuses, the job
    ends with status 75 and says how to continue from the checkpoint in a new job."""
    script = write_script(tmp_path, PREEMPT_PROBE)

    def preempt(proc, job_id):
        wait_for(tmp_path / "runs" / job_id / "ready", "the stand-in training start", proc, job_id, tmp_path)
        os.kill(proc.pid, signal.SIGUSR1)

    job = sbatch(tmp_path, script, "--no-requeue", timeout=60, during=preempt)
    out = job.output
    assert job.returncode == 75, job.describe()
    assert f"scontrol requeue {job.job_id} failed" in out and "presently disabled" in out, job.describe()
    assert f"CHECKPOINT_DIR={job.runs / job.job_id / 'checkpoints'} sbatch" in out, job.describe()
    assert "run 1" not in out and not job.leftovers


def test_fake_scontrol_requeue_needs_a_job(tmp_path):
    env = fake_env(tmp_path)
    result = run_isolated([FAKE / "scontrol", "requeue", "4242"], timeout=30, env=env)
    assert result.returncode == 1 and "Invalid job id" in result.stderr


# Long enough to be stopped in the middle: 320 images / 2 ranks / batch 4 = 40 steps an epoch.
PREEMPT_TINY = "--model-width 4 --train-subset 320 --val-subset 101 --batch-size 4 --epochs 3 --set num_workers=0"


def test_preempted_multinode_job_checkpoints_requeues_and_resumes(tmp_path, cifar_dir):
    """raw_multinode.sbatch on 2 fake nodes: SIGUSR1 to the batch shell after the first epoch. The
    shell passes it to srun, srun to both nodes' launchers and ranks; rank 0 writes the checkpoint,
    the training exits 75, the script requeues the job; the second run resumes from the checkpoint
    in the middle of epoch 2 and finishes epochs 2 and 3, appending to the same logs."""
    calls = tmp_path / "scontrol.log"

    def preempt(proc, job_id):
        wait_for(tmp_path / "runs" / job_id / "log.jsonl", "the first epoch", proc, job_id, tmp_path,
                 text='"kind": "epoch"')
        os.kill(proc.pid, signal.SIGUSR1)

    job = sbatch(tmp_path, SLURM / "raw_multinode.sbatch", "--nodes=2", "--gres=gpu:1", during=preempt,
                 DATA_SRC=cifar_dir, EXTRA_ARGS=PREEMPT_TINY, FAKE_SLURM_SCONTROL_LOG=calls, FAKE_SLURM_MAX_RESTARTS=1)
    assert job.returncode == 0, job.describe()
    run_dir = job.runs / job.job_id
    checkpoint = run_dir / "checkpoints" / "checkpoint.pt"
    log = (run_dir / "train.log").read_text()
    stopped = re.search(r"stopped by a signal at epoch (\d), step (\d+): checkpoint written to (\S+);", log)
    assert stopped and stopped.group(3) == str(checkpoint), log
    assert "SIGUSR1 received; passed on to the training" in log
    assert f"scontrol requeue {job.job_id}" in calls.read_text().splitlines(), calls.read_text()
    assert log.count(f"job {job.job_id} requeued") == 1 and "restart 1: this job was requeued" in log, log
    epoch, step = stopped.group(1), stopped.group(2)
    assert f"Resuming from {checkpoint}: epoch {epoch}, step {step} of 40" in log, log
    assert log.index("stopped by a signal") < log.index(f"job {job.job_id} requeued") < log.index("Resuming from")
    assert f"job {job.job_id} finished" in log
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    headers = [r for r in records if r["kind"] == "header"]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2, 3], records  # appended, none twice
    assert len(headers) == 2 and headers[1]["resumed_at"] == {"epoch": int(epoch), "step": int(step)}, headers
    assert checkpoint.is_file()
    out = job.output  # --open-mode=append: the requeued run's output follows the first run's
    assert out.index("Epoch =  1:") < out.index("restart 1: this job was requeued") < out.index("Epoch =  3:"), out
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"


# As PREEMPT_TINY, but 80 steps an epoch: the stop reaches accelerate launch up to a second after the
# signal (launch_stoppable reads the stop file every second), and must still land before the last epoch ends.
ACCEL_PREEMPT_TINY = PREEMPT_TINY.replace("--batch-size 4", "--batch-size 2")


@pytest.mark.parametrize("name, options", [
    ("accel_multinode", ["--nodes=2", "--gres=gpu:1"]),
    ("accel_2gpu", []),
])
def test_preempted_accelerate_job_checkpoints_requeues_and_resumes(tmp_path, cifar_dir, name, options):
    """An accel_* script (accelerate launch) on the fakes: SIGUSR1 to the batch shell after the first
    epoch. The shell must not pass SIGUSR1 on (it would kill `accelerate launch`): it writes "stop"
    into runs/<job id>/stop-request, launch_stoppable on each node sends its accelerate launch
    SIGTERM, the launcher passes it to its ranks, which write a checkpoint (DIR/LATEST) and exit 75;
    accelerate launch exits 1, the script reads the training's "stopped by a signal ... checkpoint
    written" line, requeues the job, and the second run resumes at that step and finishes."""
    calls = tmp_path / "scontrol.log"

    def preempt(proc, job_id):
        wait_for(tmp_path / "runs" / job_id / "log.jsonl", "the first epoch", proc, job_id, tmp_path,
                 text='"kind": "epoch"')
        os.kill(proc.pid, signal.SIGUSR1)

    job = sbatch(tmp_path, SLURM / f"{name}.sbatch", *options, during=preempt, DATA_SRC=cifar_dir,
                 EXTRA_ARGS=ACCEL_PREEMPT_TINY, FAKE_SLURM_SCONTROL_LOG=calls, FAKE_SLURM_MAX_RESTARTS=1)
    assert job.returncode == 0, job.describe()
    run_dir = job.runs / job.job_id
    checkpoints = run_dir / "checkpoints"
    log = (run_dir / "train.log").read_text()
    assert f"checkpoints: {checkpoints} (a requeued run resumes from there)" in log, log
    assert "SIGUSR1 received; passed on to the training through" in log, log
    nodes = 2 if "multinode" in name else 1
    assert log.count("stop requested: SIGTERM to accelerate launch") == nodes, log
    stopped = re.search(r"stopped by a signal at epoch (\d), step (\d+): checkpoint written to (\S+);", log)
    assert stopped and Path(stopped.group(3)).parent == checkpoints, log
    assert "taken as status 75" in log and "stopped after" in log, log  # accelerate launch itself exits 1
    requeues = [c for c in calls.read_text().splitlines() if c.startswith("scontrol requeue")]
    assert requeues == [f"scontrol requeue {job.job_id}"], calls.read_text()
    assert log.count(f"job {job.job_id} requeued") == 1 and "restart 1: this job was requeued" in log, log
    epoch, step = stopped.group(1), stopped.group(2)
    assert f"Resuming from {stopped.group(3)}: epoch {epoch}, step {step} of 80" in log, log
    assert log.index("stopped by a signal") < log.index(f"job {job.job_id} requeued") < log.index("Resuming from")
    assert f"job {job.job_id} finished" in log
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2, 3], records  # appended, none twice
    assert len([r for r in records if r["kind"] == "header"]) == 2, records
    assert (checkpoints / "LATEST").is_file()
    out = job.output  # --open-mode=append: the requeued run's output follows the first run's
    assert out.index("Epoch =  1:") < out.index("restart 1: this job was requeued") < out.index("Epoch =  3:"), out
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"


# The accel_* side, with a stand-in for `accelerate launch` on 2 fake nodes, run through
# launch_stoppable as accel_multinode.sbatch does: SIGUSR1 would kill it (as it kills accelerate
# launch); on SIGTERM node 0's prints the training's "checkpoint written" line, and both exit 1.
ACCEL_PREEMPT_PROBE = """#!/bin/bash
#SBATCH --account=probe
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
    if node == "0":  # split: the echoed command line must not match
        print("stopped by a " + "signal at epoch 1, step 10: checkpoint written to somewhere; rerun", flush=True)
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


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_accel_stop_goes_through_the_stop_file(tmp_path, sig):
    """SIGUSR1 or SIGTERM to the batch shell of an accel_*-style script: never passed on as a signal
    (SIGUSR1 would kill accelerate launch), but written into the stop file; launch_stoppable on each
    node sends its launcher SIGTERM; the launchers exit 1, and the training's "checkpoint written"
    line makes that status 75. SIGUSR1 then requeues (the second run finishes); SIGTERM does not."""
    if not Path("/proc/self/task").exists():
        pytest.skip("needs Linux /proc to find the batch shell")
    script = write_script(tmp_path, ACCEL_PREEMPT_PROBE)
    calls = tmp_path / "scontrol.log"

    def stop(proc, job_id):
        for node in (0, 1):
            wait_for(tmp_path / "runs" / job_id / f"ready-{node}", "the stand-in's start", proc, job_id, tmp_path)
        os.kill(batch_shell(proc.pid), getattr(signal, f"SIG{sig}"))

    job = sbatch(tmp_path, script, timeout=60, during=stop, FAKE_SLURM_SCONTROL_LOG=calls, FAKE_SLURM_MAX_RESTARTS=1)
    out = job.output
    stop_file = job.runs / job.job_id / "stop-request"
    assert "run 0, stop file: run" in out, job.describe()
    assert f"SIG{sig} received; passed on to the training through {stop_file}" in out, job.describe()
    assert out.count("stop requested: SIGTERM to accelerate launch") == 2, job.describe()
    assert "stand-in 0 got SIGTERM" in out and "stand-in 1 got SIGTERM" in out, job.describe()
    assert "taken as status 75" in out and "stopped after" in out, job.describe()
    if sig == "USR1":
        assert job.returncode == 0, job.describe()
        assert f"job {job.job_id} requeued" in out and "run 1, stop file: run" in out, job.describe()
        assert "stand-in resumed" in out and f"job {job.job_id} finished" in out, job.describe()
        assert [c for c in calls.read_text().splitlines() if "requeue" in c] == [f"scontrol requeue {job.job_id}"]
    else:
        assert job.returncode == 75, job.describe()
        assert "not requeued after SIGTERM" in out and "run 1" not in out, job.describe()
        assert not calls.exists() or "requeue" not in calls.read_text()
    assert not job.leftovers, job.describe()
