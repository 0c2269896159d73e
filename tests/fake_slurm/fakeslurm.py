"""A fake Slurm on one machine: `sbatch`, `srun`, `scontrol show hostnames` and `scontrol requeue`,
enough to run the job scripts in slurm/ end to end without a cluster (see docs/slurm.md, "Testing without a cluster").

    PATH=tests/fake_slurm:$PATH sbatch -A course --nodes=2 slurm/raw_multinode.sbatch

sbatch   reads the script's #SBATCH lines (then SBATCH_* variables, then its own command line, the
         same precedence as Slurm), rejects options it does not know, sets the job's SLURM_*
         variables and runs the script in the foreground, its output in --output (slurm-%j.out).
         It returns the script's exit status, like `sbatch --wait`. SIGUSR1/SIGUSR2 to the fake
         sbatch go to the batch shell only, like `--signal=B:USR1@...` or `scancel --batch
         --signal=USR1`; SIGTERM/SIGINT/SIGHUP cancel the job (SIGTERM to the batch shell).
         A job that `scontrol requeue` requeued is ended (SIGTERM to the batch shell, SIGKILL after
         FAKE_SLURM_KILL_WAIT s) and run again with the same job id, fresh node-local TMPDIRs and
         SLURM_RESTART_COUNT=1, 2, ... (at most FAKE_SLURM_MAX_RESTARTS times; default 3).
srun     starts one copy of its command per task (one per node unless --ntasks-per-node says
         otherwise) as separate processes, each with its own SLURM_NODEID, SLURM_PROCID,
         SLURM_LOCALID, SLURMD_NODENAME and TMPDIR; waits for all; with --kill-on-bad-exit=1 the
         first task to fail ends the others (SIGTERM, then SIGKILL). Like the real srun it passes
         SIGUSR1 and SIGUSR2 on to every process of every task (each task's process group), and
         answers SIGTERM, SIGINT and SIGHUP with "forcing job termination": SIGKILL to the tasks.
scontrol `show hostnames [LIST]` expands a hostlist such as node[01-03,07] (default
         $SLURM_JOB_NODELIST); `requeue JOBID[,JOBID...]` requeues a job of the fake sbatch
         (refused for one submitted with --no-requeue). With FAKE_SLURM_SCONTROL_LOG set, every
         call is appended to that file, one line each ("scontrol requeue 123456").

The fake nodes are named 127.0.0.1, 127.0.0.2, ... (the hostlist 127.0.0.[1-N]): distinct names
that all reach this machine's loopback, so a script that takes MASTER_ADDR from the first host of
the node list works unchanged. FAKE_SLURM_NODELIST replaces the names. Each fake node has its own
TMPDIR (<job dir>/<node>/tmp), like the node-local scratch on a real cluster, deleted when the job ends.

Environment knobs: FAKE_SLURM_JOB_ID (the job id; default random), FAKE_SLURM_NODELIST,
FAKE_SLURM_ROOT (where job folders go; default $TMPDIR/fake-slurm-<uid>), FAKE_SLURM_KEEP_JOB_DIR=1,
FAKE_SLURM_KILL_WAIT (seconds between SIGTERM and SIGKILL; default 5), FAKE_SLURM_GPUS_ON_NODE
(force SLURM_GPUS_ON_NODE), FAKE_SLURM_MAX_RESTARTS (requeues the fake sbatch runs again; default 3),
FAKE_SLURM_SCONTROL_LOG (a file that records every scontrol call).

CPU binding: in a job of several nodes, each fake node's tasks are bound to their own share of
this machine's cores (one core each when there are more nodes than cores); the batch shell is not.

What it does not emulate: time limits (and so the timed --signal: send the signal to the fake
sbatch instead), preemption, memory limits, --cpus-per-task binding, GPU binding
(CUDA_VISIBLE_DEVICES is left alone), queueing, job arrays, srun --label / --output, and separate
disks: the fake nodes share one file system, so a script that hands node 0's TMPDIR path to the
other nodes would still work here.
"""
import functools
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class FakeSlurmError(Exception):
    pass


# ----------------------------------------------------------------------------- hostlists

def _split_top_level(spec: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise FakeSlurmError(f"invalid hostlist {spec!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise FakeSlurmError(f"invalid hostlist {spec!r}: unbalanced '['")
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str, spec: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", name)
    if not m:
        if "[" in name or "]" in name:
            raise FakeSlurmError(f"invalid hostlist {spec!r}")
        return [name]
    prefix, ranges, rest = m.groups()
    names = []
    for item in ranges.split(","):
        lo, _, hi = item.partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise FakeSlurmError(f"invalid range {item!r} in hostlist {spec!r}")
        for number in range(int(lo), int(hi) + 1):
            for tail in _expand_name(rest, spec):
                names.append(f"{prefix}{number:0{len(lo)}d}{tail}")
    return names


def expand_hostlist(spec: str) -> list[str]:
    """'node[01-03,07],gpu5' -> ['node01', 'node02', 'node03', 'node07', 'gpu5']"""
    names = []
    for part in _split_top_level(spec):
        names.extend(_expand_name(part, spec))
    if not names:
        raise FakeSlurmError(f"empty hostlist {spec!r}")
    return names


def compress_numbered(prefix: str, first: int, count: int) -> str:
    return f"{prefix}{first}" if count == 1 else f"{prefix}[{first}-{first + count - 1}]"


def compress_hostlist(names: list[str]) -> str:
    """Good enough for the step node list: consecutive names 'p<i>' collapse to p[a-b]."""
    matches = [re.match(r"^(.*?)(\d+)$", n) for n in names]
    if all(matches) and len({m.group(1) for m in matches}) == 1 and len(names) > 1:
        numbers = [int(m.group(2)) for m in matches]
        widths = {len(m.group(2)) for m in matches}
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))) and widths == {len(str(numbers[0]))}:
            return compress_numbered(matches[0].group(1), numbers[0], len(numbers))
    return ",".join(names)


# ----------------------------------------------------------------------------- options

VALUE, FLAG, OPTIONAL = "value", "flag", "optional"


def _table(*rows):
    by_name = {}
    for long, short, kind in rows:
        by_name["--" + long] = (long, kind)
        if short:
            by_name["-" + short] = (long, kind)
    return by_name


SBATCH_OPTIONS = _table(
    ("account", "A", VALUE), ("partition", "p", VALUE), ("time", "t", VALUE), ("nodes", "N", VALUE),
    ("ntasks", "n", VALUE), ("ntasks-per-node", None, VALUE), ("cpus-per-task", "c", VALUE),
    ("gres", None, VALUE), ("gpus", "G", VALUE), ("gpus-per-node", None, VALUE), ("gpus-per-task", None, VALUE),
    ("mem", None, VALUE), ("mem-per-cpu", None, VALUE), ("mem-per-gpu", None, VALUE), ("job-name", "J", VALUE),
    ("output", "o", VALUE), ("error", "e", VALUE), ("chdir", "D", VALUE), ("qos", "q", VALUE),
    ("constraint", "C", VALUE), ("mail-type", None, VALUE), ("mail-user", None, VALUE), ("signal", None, VALUE),
    ("exclusive", None, OPTIONAL), ("requeue", None, FLAG), ("no-requeue", None, FLAG), ("export", None, VALUE),
    ("wait", "W", FLAG), ("parsable", None, FLAG), ("open-mode", None, VALUE), ("exclude", "x", VALUE),
    ("reservation", None, VALUE), ("comment", None, VALUE), ("hint", None, VALUE), ("distribution", "m", VALUE),
)

SRUN_OPTIONS = _table(
    ("nodes", "N", VALUE), ("ntasks", "n", VALUE), ("ntasks-per-node", None, VALUE), ("cpus-per-task", "c", VALUE),
    ("kill-on-bad-exit", "K", OPTIONAL), ("gres", None, VALUE), ("gpus-per-node", None, VALUE),
    ("gpus-per-task", None, VALUE), ("gpu-bind", None, VALUE), ("cpu-bind", None, VALUE), ("export", None, VALUE),
    ("mpi", None, VALUE), ("unbuffered", "u", FLAG), ("overlap", None, FLAG), ("exclusive", None, OPTIONAL),
    ("distribution", "m", VALUE), ("mem", None, VALUE), ("chdir", "D", VALUE), ("job-name", "J", VALUE),
    ("time", "t", VALUE),
)


def parse_options(tokens: list[str], table: dict, prog: str, where: str = "") -> tuple[dict, list[str]]:
    """getopt-style: options until the first non-option word; returns (options, the rest)."""
    opts, i = {}, 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return opts, tokens[i + 1:]
        if not token.startswith("-") or token == "-":
            return opts, tokens[i:]
        if token.startswith("--"):
            name, has_value, value = token.partition("=")
        else:  # -N2 or -N 2
            name, value = token[:2], token[2:]
            has_value = bool(value)
        if name not in table:
            raise FakeSlurmError(f"{prog}: unrecognized option '{token}'{where} (the fake knows: "
                                 f"{', '.join(sorted(k for k in table if k.startswith('--')))})")
        long, kind = table[name]
        if kind == FLAG:
            if has_value:
                raise FakeSlurmError(f"{prog}: option '{name}' takes no value{where}")
            opts[long] = True
        elif kind == OPTIONAL:
            opts[long] = value if has_value else True
        else:
            if not has_value:
                i += 1
                if i >= len(tokens):
                    raise FakeSlurmError(f"{prog}: option '{name}' requires a value{where}")
                value = tokens[i]
            opts[long] = value
        i += 1
    return opts, []


def positive_int(value, what: str, prog: str) -> int:
    text = str(value).split("-")[0]  # "2-4" (min-max nodes): the fake takes the minimum
    if not text.isdigit() or int(text) < 1:
        raise FakeSlurmError(f"{prog}: invalid {what} {value!r}")
    return int(text)


TIME_FORMATS = [r"\d+", r"\d+:\d{1,2}", r"\d+:\d{1,2}:\d{1,2}", r"\d+-\d+", r"\d+-\d+:\d{1,2}",
                r"\d+-\d+:\d{1,2}:\d{1,2}", "infinite", "unlimited"]


def check_time(value: str, prog: str) -> None:
    if not any(re.fullmatch(f, value) for f in TIME_FORMATS):
        raise FakeSlurmError(f"{prog}: invalid --time specification {value!r}")


def check_signal(value: str, prog: str) -> None:
    """--signal=[{R|B}:]<sig_num>[@sig_time]: a signal name or number, an optional time in seconds."""
    names = {s.name[3:] for s in signal.Signals} | {s.name for s in signal.Signals}
    m = re.fullmatch(r"(?:([RB]+):)?([A-Za-z0-9]+)(?:@(\d+))?", value)
    if not m or not (m.group(2).isdigit() or m.group(2).upper() in names):
        raise FakeSlurmError(f"{prog}: invalid --signal specification {value!r} (expected [{{R|B}}:]SIG[@SECONDS], "
                             f"e.g. B:USR1@120)")


def merge_options(opts: dict, found: dict) -> None:
    """opts.update(found), where --requeue and --no-requeue cancel each other (the later one wins)."""
    for flag, opposite in (("requeue", "no-requeue"), ("no-requeue", "requeue")):
        if flag in found:
            opts.pop(opposite, None)
    opts.update(found)


def gpus_per_node(opts: dict, prog: str) -> int | None:
    """From --gres=gpu[:type]:N[,...] or --gpus-per-node=[type:]N."""
    if "gpus-per-node" in opts:
        return positive_int(str(opts["gpus-per-node"]).split(":")[-1], "--gpus-per-node", prog)
    for item in str(opts.get("gres", "")).split(","):
        fields = item.split(":")
        if fields[0] == "gpu":
            return positive_int(fields[-1] if len(fields) > 1 else "1", "--gres gpu count", prog)
    return None


# ----------------------------------------------------------------------------- jobs

def fake_root() -> Path:
    return Path(os.environ.get("FAKE_SLURM_ROOT") or Path(tempfile.gettempdir()) / f"fake-slurm-{os.getuid()}")


def node_tmpdir(job_dir: Path, node: str) -> Path:
    path = job_dir / node / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_directives(script: Path) -> list[tuple[int, list[str]]]:
    """#SBATCH lines before the first command, as sbatch reads them."""
    lines = script.read_text().splitlines()
    if not lines or not lines[0].startswith("#!"):
        raise FakeSlurmError("sbatch: error: This does not look like a batch script. The first line must start "
                             "with #! followed by the path to an interpreter.")
    directives = []
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            break  # sbatch stops reading directives at the first command
        if line.startswith("#SBATCH"):
            words = shlex.split(line[len("#SBATCH"):])
            if any(w.startswith("#") for w in words):
                raise FakeSlurmError(f"sbatch: {script}:{number}: put comments on their own line, not after an "
                                     f"#SBATCH option")
            directives.append((number, words))
        elif re.match(r"^#\s*SBATCH", line):
            raise FakeSlurmError(f"sbatch: {script}:{number}: {line.strip()!r} is not read by sbatch "
                                 f"(write '#SBATCH' at the start of the line)")
    return directives


SBATCH_ENV = {"SBATCH_ACCOUNT": "account", "SBATCH_PARTITION": "partition", "SBATCH_TIMELIMIT": "time",
              "SBATCH_JOB_NAME": "job-name", "SBATCH_GRES": "gres", "SBATCH_QOS": "qos"}


def output_path(pattern: str, job_id: str, job_name: str, first_node: str, workdir: Path) -> Path:
    subs = {"j": job_id, "A": job_id, "x": job_name, "u": os.environ.get("USER", "user"), "N": first_node,
            "a": "4294967294", "%": "%"}
    text = re.sub(r"%(\w|%)", lambda m: subs.get(m.group(1), m.group(0)), pattern)
    return workdir / text


def sbatch_main(argv: list[str]) -> int:
    cli, rest = parse_options(argv, SBATCH_OPTIONS, "sbatch")
    if not rest:
        raise FakeSlurmError("sbatch: the fake needs a script file (it does not read one from stdin)")
    script, script_args = Path(rest[0]), rest[1:]
    if not script.is_file():
        raise FakeSlurmError(f"sbatch: error: Unable to open file {script}")
    opts = {}
    for number, words in read_directives(script):
        found, extra = parse_options(words, SBATCH_OPTIONS, "sbatch", f" in {script}:{number}")
        if extra:
            raise FakeSlurmError(f"sbatch: {script}:{number}: unexpected words {extra} in an #SBATCH line")
        merge_options(opts, found)
    merge_options(opts, {key: os.environ[var] for var, key in SBATCH_ENV.items() if os.environ.get(var)})
    merge_options(opts, cli)

    if not opts.get("account"):
        raise FakeSlurmError("sbatch: error: no --account given (Falcon needs your allocation: #SBATCH --account=..., "
                             "sbatch --account=..., or SBATCH_ACCOUNT)")
    if "time" in opts:
        check_time(str(opts["time"]), "sbatch")
    if "signal" in opts:
        check_signal(str(opts["signal"]), "sbatch")
    num_nodes = positive_int(opts.get("nodes", 1), "--nodes", "sbatch")
    if os.environ.get("FAKE_SLURM_NODELIST"):
        nodelist = os.environ["FAKE_SLURM_NODELIST"]
        names = expand_hostlist(nodelist)
        if len(names) != num_nodes:
            raise FakeSlurmError(f"sbatch: FAKE_SLURM_NODELIST {nodelist!r} has {len(names)} nodes, the job asks "
                                 f"for {num_nodes}")
    else:
        if num_nodes > 254:
            raise FakeSlurmError("sbatch: the fake has at most 254 nodes")
        nodelist = compress_numbered("127.0.0.", 1, num_nodes) if num_nodes == 1 else f"127.0.0.[1-{num_nodes}]"
        names = expand_hostlist(nodelist)
    if "ntasks-per-node" in opts:
        tasks_per_node = positive_int(opts["ntasks-per-node"], "--ntasks-per-node", "sbatch")
    elif "ntasks" in opts:
        tasks_per_node = -(-positive_int(opts["ntasks"], "--ntasks", "sbatch") // num_nodes)
    else:
        tasks_per_node = 1
    ntasks = positive_int(opts["ntasks"], "--ntasks", "sbatch") if "ntasks" in opts else tasks_per_node * num_nodes
    cpus_per_task = None
    if "cpus-per-task" in opts:
        cpus_per_task = positive_int(opts["cpus-per-task"], "--cpus-per-task", "sbatch")
    gpus = os.environ.get("FAKE_SLURM_GPUS_ON_NODE") or gpus_per_node(opts, "sbatch")

    job_id = os.environ.get("FAKE_SLURM_JOB_ID") or str(random.randint(100000, 999999))
    if not job_id.isdigit():
        raise FakeSlurmError(f"sbatch: FAKE_SLURM_JOB_ID must be a number (got {job_id!r})")
    job_name = opts.get("job-name") or script.name
    workdir = Path(opts.get("chdir") or os.getcwd())
    if not workdir.is_dir():
        raise FakeSlurmError(f"sbatch: --chdir {workdir} does not exist")
    out_path = output_path(opts.get("output", "slurm-%j.out"), job_id, job_name, names[0], workdir)
    err_path = output_path(opts["error"], job_id, job_name, names[0], workdir) if "error" in opts else None
    for path in filter(None, (out_path, err_path)):
        if not path.parent.is_dir():
            raise FakeSlurmError(f"sbatch: the folder of the job's output file {path} does not exist: Slurm does not "
                                 f"create it and the job would fail without writing any output")

    job_dir = fake_root() / f"job-{job_id}"
    if job_dir.exists():
        raise FakeSlurmError(f"sbatch: job folder {job_dir} exists already (job id {job_id} in use?)")
    job_dir.mkdir(parents=True)
    batch_script = job_dir / "slurm_script"  # Slurm runs a copy too: $0 is not in the repository
    shutil.copyfile(script, batch_script)
    batch_script.chmod(0o755)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    cpus_on_node = cpus_per_task * tasks_per_node if cpus_per_task else (os.cpu_count() or 1)
    env.update({
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": job_name,
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(num_nodes), "SLURM_NNODES": str(num_nodes),
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{num_nodes})" if num_nodes > 1 else str(tasks_per_node),
        "SLURM_CPUS_ON_NODE": str(cpus_on_node), "SLURM_JOB_CPUS_PER_NODE": str(cpus_on_node),
        "SLURM_SUBMIT_DIR": os.getcwd(), "SLURM_SUBMIT_HOST": socket.gethostname(),
        "SLURM_CLUSTER_NAME": "fake", "SLURM_JOB_ACCOUNT": str(opts["account"]),
        "SLURM_JOB_PARTITION": str(opts.get("partition", "normal_q")),
        "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": names[0],
        "SLURM_TOPOLOGY_ADDR": names[0], "ENVIRONMENT": "BATCH",
        "TMPDIR": str(node_tmpdir(job_dir, names[0])), "FAKE_SLURM_JOB_DIR": str(job_dir),
    })
    if "ntasks-per-node" in opts:
        env["SLURM_NTASKS_PER_NODE"] = str(tasks_per_node)
    if cpus_per_task:
        env["SLURM_CPUS_PER_TASK"] = str(cpus_per_task)
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    if "gpus-per-node" in opts:
        env["SLURM_GPUS_PER_NODE"] = str(opts["gpus-per-node"])

    if opts.get("no-requeue"):
        (job_dir / NO_REQUEUE).touch()  # `scontrol requeue` refuses this job, as Slurm does
    max_restarts = int(os.environ.get("FAKE_SLURM_MAX_RESTARTS", "3"))
    kill_wait = float(os.environ.get("FAKE_SLURM_KILL_WAIT", "5"))

    print(job_id if opts.get("parsable") else f"Submitted batch job {job_id}", flush=True)
    running = {}  # the batch shell of the current run, for the signal handlers
    cancelled = []

    def cancel(signum, _frame):  # scancel: SIGTERM to the batch script (which passes it on to its steps)
        cancelled.append(signum)
        if "proc" in running:
            running["proc"].send_signal(signal.SIGTERM)

    def batch_signal(signum, _frame):  # `--signal=B:USR1@...` or `scancel --batch --signal=USR1`
        if "proc" in running:
            running["proc"].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, cancel)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, batch_signal)

    restarts = 0
    while True:
        # --open-mode=append: every run of a requeued job adds to the same file; else each run starts it afresh
        mode = "a" if opts.get("open-mode") == "append" else "w"
        out = open(out_path, mode)
        err = open(err_path, mode) if err_path else None
        if restarts:
            env["SLURM_RESTART_COUNT"] = str(restarts)
        proc = subprocess.Popen([str(batch_script), *script_args], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err or subprocess.STDOUT)
        running["proc"] = proc
        status = wait_for_batch_shell(proc, job_dir / REQUEUE_MARK, kill_wait)
        running.pop("proc")
        out.close()
        if err:
            err.close()
        requeued = (job_dir / REQUEUE_MARK).exists()
        if not requeued or cancelled:
            break
        if restarts >= max_restarts:
            print(f"fake sbatch: job {job_id} was requeued, but it has run {restarts + 1} times "
                  f"(FAKE_SLURM_MAX_RESTARTS={max_restarts}): not running it again", file=sys.stderr, flush=True)
            break
        restarts += 1
        print(f"fake sbatch: job {job_id} requeued; running it again (SLURM_RESTART_COUNT={restarts})",
              file=sys.stderr, flush=True)
        for entry in job_dir.iterdir():  # a new allocation: fresh node-local scratch, step ids from 0
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.name not in ("slurm_script", NO_REQUEUE):
                entry.unlink()
        node_tmpdir(job_dir, names[0])
    if os.environ.get("FAKE_SLURM_KEEP_JOB_DIR") != "1":
        shutil.rmtree(job_dir, ignore_errors=True)  # like the node-local $TMPDIR at the end of a job
    code = status if status >= 0 else 128 - status
    print(f"fake sbatch: job {job_id} ended with exit code {code}; output in {out_path}", file=sys.stderr, flush=True)
    return code


REQUEUE_MARK, NO_REQUEUE = "requeue", "no-requeue"  # files in the job folder (see scontrol_main)


def wait_for_batch_shell(proc: subprocess.Popen, requeue_mark: Path, kill_wait: float) -> int:
    """Wait for the batch shell. Once `scontrol requeue` has marked the job, end this run as Slurm
    does: SIGTERM to the batch shell, SIGKILL kill_wait seconds later if it is still there."""
    kill_at = None
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        if kill_at is None and requeue_mark.exists():
            proc.send_signal(signal.SIGTERM)
            kill_at = time.monotonic() + kill_wait
        elif kill_at is not None and time.monotonic() > kill_at:
            proc.kill()


# ----------------------------------------------------------------------------- steps

def next_step_id(job_dir: Path) -> int:
    counter = job_dir / "steps"
    step = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(step + 1))
    return step


def _load_prctl():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _load_prctl()


def node_cpus(node_index: int, num_nodes: int) -> set[int] | None:
    """This machine's cores shared out among the fake nodes, so that each node has cores of its own,
    as separate machines would (and trainers that size their thread pools by their cores do not
    oversubscribe the machine); a node gets one core when there are more nodes than cores."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if num_nodes <= 1:
        return None
    if len(cpus) < num_nodes:
        return {cpus[node_index % len(cpus)]}
    share = len(cpus) // num_nodes
    return set(cpus[node_index * share:(node_index + 1) * share])


def task_preexec(cpus: set[int] | None = None) -> None:
    """In each task: its own process group; on Linux, SIGKILL when the fake srun dies (the real
    slurmstepd ends a step's tasks too), so a killed srun leaves no orphans; and its node's cores."""
    os.setpgrp()
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if cpus:
        os.sched_setaffinity(0, cpus)


def srun_main(argv: list[str]) -> int:
    opts, command = parse_options(argv, SRUN_OPTIONS, "srun")
    if not command:
        raise FakeSlurmError("srun: no command given")
    env = dict(os.environ)
    if "SLURM_JOB_ID" not in env or "FAKE_SLURM_JOB_DIR" not in env:
        raise FakeSlurmError("srun: not inside a job of the fake sbatch (run the script with tests/fake_slurm/sbatch)")
    if opts.get("export", "ALL") != "ALL":
        raise FakeSlurmError("srun: the fake supports only --export=ALL (the default)")
    job_dir = Path(env["FAKE_SLURM_JOB_DIR"])
    job_nodes = expand_hostlist(env["SLURM_JOB_NODELIST"])
    num_nodes = positive_int(opts["nodes"], "--nodes", "srun") if "nodes" in opts else len(job_nodes)
    if num_nodes > len(job_nodes):
        raise FakeSlurmError(f"srun: error: --nodes={num_nodes}, but the job has {len(job_nodes)} nodes")
    if "ntasks-per-node" in opts:
        tasks_per_node = positive_int(opts["ntasks-per-node"], "--ntasks-per-node", "srun")
        ntasks = positive_int(opts["ntasks"], "--ntasks", "srun") if "ntasks" in opts else tasks_per_node * num_nodes
    elif "ntasks" in opts:
        ntasks = positive_int(opts["ntasks"], "--ntasks", "srun")
        tasks_per_node = -(-ntasks // num_nodes)
    else:
        tasks_per_node = int(env.get("SLURM_NTASKS_PER_NODE", "1"))
        ntasks = tasks_per_node * num_nodes
    if ntasks > tasks_per_node * num_nodes:
        raise FakeSlurmError(f"srun: {ntasks} tasks do not fit {num_nodes} nodes x {tasks_per_node} tasks")
    kill_on_bad_exit = str(opts.get("kill-on-bad-exit", "0")) not in ("0", "")
    kill_wait = float(os.environ.get("FAKE_SLURM_KILL_WAIT", "5"))
    cwd = opts.get("chdir") or os.getcwd()

    step_id = next_step_id(job_dir)
    # block distribution: node 0 takes tasks 0..tasks_per_node-1, node 1 the next, ...
    placement = [(rank // tasks_per_node, rank % tasks_per_node) for rank in range(ntasks)]
    used_nodes = job_nodes[:placement[-1][0] + 1]
    tasks = []  # (rank, node name, Popen)

    def kill_all(sig):
        for _, _, p in tasks:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def terminate_all():
        kill_all(signal.SIGTERM)
        deadline = time.monotonic() + kill_wait
        while time.monotonic() < deadline and any(p.poll() is None for _, _, p in tasks):
            time.sleep(0.05)
        kill_all(signal.SIGKILL)
        for _, _, p in tasks:
            p.wait()

    def on_signal(signum, _frame):  # the real srun: "forcing job termination", SIGKILL to every task
        print(f"srun: forcing job termination (signal {signum})", file=sys.stderr, flush=True)
        kill_all(signal.SIGKILL)
        for _, _, p in tasks:
            p.wait()
        sys.exit(128 + signum)

    def forward(signum, _frame):  # the real srun passes other signals on to every process of the step
        kill_all(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)

    try:
        for rank, (node_index, local_id) in enumerate(placement):
            node = job_nodes[node_index]
            task_env = dict(env)
            task_env.update({
                "SLURM_NODEID": str(node_index), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_id),
                "SLURMD_NODENAME": node, "SLURM_TOPOLOGY_ADDR": node,
                "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
                "SLURM_STEP_ID": str(step_id), "SLURM_STEPID": str(step_id),
                "SLURM_STEP_NUM_NODES": str(len(used_nodes)), "SLURM_STEP_NUM_TASKS": str(ntasks),
                "SLURM_STEP_NODELIST": compress_hostlist(used_nodes),
                "SLURM_STEP_TASKS_PER_NODE": str(tasks_per_node),
                "TMPDIR": str(node_tmpdir(job_dir, node)),  # node-local scratch
            })
            if "cpus-per-task" in opts:
                task_env["SLURM_CPUS_PER_TASK"] = str(opts["cpus-per-task"])
            try:  # a process group per task, so that ending a task ends everything it started
                proc = subprocess.Popen(command, env=task_env, cwd=cwd, stdin=subprocess.DEVNULL,
                                        preexec_fn=functools.partial(task_preexec,
                                                                     node_cpus(node_index, len(job_nodes))))
            except OSError as exc:
                print(f"srun: error: {node}: task {rank}: cannot run {command[0]!r}: {exc}", file=sys.stderr)
                terminate_all()
                return 2
            tasks.append((rank, node, proc))

        first_failure = None
        running = list(tasks)
        while running:
            finished = [item for item in running if item[2].poll() is not None]
            for item in finished:
                running.remove(item)
                rank, node, proc = item
                if proc.returncode != 0:
                    status = proc.returncode
                    how = f"Exited with exit code {status}" if status > 0 else f"Killed by signal {-status}"
                    print(f"srun: error: {node}: task {rank}: {how}", file=sys.stderr, flush=True)
                    if first_failure is None:
                        first_failure = status if status > 0 else 128 - status
            if first_failure is not None and kill_on_bad_exit and running:
                print(f"srun: error: --kill-on-bad-exit: terminating the other {len(running)} task(s)",
                      file=sys.stderr, flush=True)
                terminate_all()
                break
            time.sleep(0.05)
        return first_failure or 0
    finally:
        kill_all(signal.SIGKILL)


# ----------------------------------------------------------------------------- scontrol

def scontrol_main(argv: list[str]) -> int:
    if os.environ.get("FAKE_SLURM_SCONTROL_LOG"):  # for tests: what was asked, one call a line
        with open(os.environ["FAKE_SLURM_SCONTROL_LOG"], "a") as log:
            log.write(shlex.join(["scontrol", *argv]) + "\n")
    if len(argv) in (2, 3) and argv[0] == "show" and argv[1] in ("hostnames", "hostname"):
        spec = argv[2] if len(argv) == 3 else os.environ.get("SLURM_JOB_NODELIST")
        if not spec:
            raise FakeSlurmError("scontrol: show hostnames: no hostlist given and SLURM_JOB_NODELIST is unset")
        print("\n".join(expand_hostlist(spec)))
        return 0
    if len(argv) == 2 and argv[0] == "requeue":
        return requeue(argv[1].split(","))
    raise FakeSlurmError(f"scontrol: the fake only does 'show hostnames [LIST]' and 'requeue JOBID' "
                         f"(got {' '.join(argv)!r})")


def requeue(job_ids: list[str]) -> int:
    """Mark running jobs of the fake sbatch for a requeue: it ends the current run and starts another."""
    status = 0
    for job_id in job_ids:
        job_dir = fake_root() / f"job-{job_id}"
        if not job_id.isdigit() or not job_dir.is_dir():
            print(f"scontrol: error: Invalid job id specified for job {job_id}", file=sys.stderr)
            status = 1
        elif (job_dir / NO_REQUEUE).exists():
            print(f"scontrol: error: Requeue of JobId={job_id}: Requested operation is presently disabled "
                  f"(the job was submitted with --no-requeue)", file=sys.stderr)
            status = 1
        else:
            (job_dir / REQUEUE_MARK).touch()
    return status


def main(entry) -> None:
    try:
        sys.exit(entry(sys.argv[1:]))
    except FakeSlurmError as exc:
        message = str(exc)
        named = message.split(":")[0] in ("sbatch", "srun", "scontrol")
        print(f"fake {message}" if named else f"fake slurm: {message}", file=sys.stderr)
        sys.exit(1)
