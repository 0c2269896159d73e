"""Shared test helpers: small synthetic CIFAR-10 in the official layout, and process runs that cannot hang.

The tiers (docs/development.md): every test that starts a process (a training run, a shell, a Slurm job) is
marked `slow`, automatically (pytest_collection_modifyitems): the test, the fixtures it uses and whatever they
call, followed through the names their code uses, reach `subprocess` or `multiprocessing`. A test left unmarked
that starts a process all the same fails at once (no_process_in_the_fast_tier), so `pytest -m "not slow"` runs
exactly the tests that start none.

As in pytest's documented `--runslow` example, `python -m pytest` skips the slow tests except the few marked
`core` in the test files (each trainer's 2-process run, DDP equivalence, one resume, one fault); `--runslow` runs
them all. The tests that use the real Slurm cluster (the `cluster` fixture: daemons, as root) are marked `slurm`
and run only with `--slurm`; asked for, a cluster that cannot start fails them instead of skipping them.
"""

import atexit
import inspect
import multiprocessing.process
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: F401  first import runs ldconfig (a process): here, not inside whichever test imports it first

REPO = Path(__file__).resolve().parent.parent
# Runs that are not given --log-json write a run folder under $RUNS_DIR: the tests' go to a folder of their own,
# never into the checkout's runs/, where a student's report would pick them up.
os.environ["RUNS_DIR"] = tempfile.mkdtemp(prefix="cifar-wrn-test-runs-")
atexit.register(shutil.rmtree, os.environ["RUNS_DIR"], True)
TESTS = REPO / "tests"
LEAN_GC = TESTS / "lean_gc"


# ============================================================================ the fast tier

PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing")


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:  # nested functions, lambdas, comprehensions
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _starts_processes(obj, seen: set) -> bool:
    """Whether obj (a function or class) refers to subprocess/multiprocessing, directly or through the functions
    and classes of the tests' own modules that its code names (globals, and attributes of those modules)."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if inspect.isclass(obj):
        return any(
            _starts_processes(member, seen)
            for member in vars(obj).values()
            if inspect.isfunction(member) or isinstance(member, (property, staticmethod, classmethod))
        )
    if isinstance(obj, property):
        return _starts_processes(obj.fget, seen)
    if isinstance(obj, (staticmethod, classmethod)):
        return _starts_processes(obj.__func__, seen)
    obj = inspect.unwrap(obj)
    if not inspect.isfunction(obj) or not Path(obj.__code__.co_filename).is_relative_to(TESTS):
        return False  # the project's code and libraries: a test that runs them in-process starts nothing
    names = {name for code in _code_objects(obj.__code__) for name in code.co_names}
    for name in names:
        value = obj.__globals__.get(name)
        if isinstance(value, types.ModuleType):
            if value.__name__.startswith(PROCESS_MODULES):
                return True
            if getattr(value, "__file__", None) and Path(value.__file__).is_relative_to(TESTS):
                if any(_starts_processes(getattr(value, attr), seen) for attr in names if hasattr(value, attr)):
                    return True
        elif (inspect.isfunction(value) or inspect.isclass(value)) and _starts_processes(value, seen):
            return True
    return False


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="run every test that starts a process, not only those marked core (the full suite)",
    )
    parser.addoption(
        "--slurm",
        action="store_true",
        default=False,
        help="run the tests under a real Slurm: starts munged, slurmctld and two slurmd daemons (root, "
        "Debian's slurm and munge packages installed); they fail if it cannot start",
    )


def skip_unasked(config, item):
    """pytest's --runslow convention: a slow test runs when asked for (or when it is one of the core runs)."""
    if item.get_closest_marker("slurm"):
        if not config.getoption("--slurm"):
            item.add_marker(pytest.mark.skip(reason="starts a real Slurm (daemons, as root): pass --slurm"))
    elif item.get_closest_marker("slow") and not item.get_closest_marker("core") and not config.getoption("--runslow"):
        item.add_marker(pytest.mark.skip(reason="slow (starts processes): pass --runslow for the full suite"))


# Fixtures whose processes every worker may start for itself: the test Slurm cluster (its daemons mostly
# wait; grouping every Slurm test onto one worker would run them one after another).
PER_WORKER = {"cluster"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = [
            (name, d)
            for name, defs in item._fixtureinfo.name2fixturedefs.items()
            for d in defs
            if name != "no_process_in_the_fast_tier"
        ]
        if any(
            _starts_processes(f, set()) for f in [getattr(item, "function", None), *(d.func for _, d in fixtures)] if f
        ):
            item.add_marker(pytest.mark.slow)
        if "cluster" in item.fixturenames:  # tests/test_slurm.py's session cluster: real daemons
            item.add_marker(pytest.mark.slurm)
        skip_unasked(config, item)
    # A module- or session-wide fixture that starts a run is built once per pytest-xdist worker: the tests that
    # share one go to the same worker (--dist loadgroup), so that it is built once, not once per worker. A test
    # that uses two such fixtures joins their groups into one (else it would form a third group of its own).
    shared = {
        item: {
            f"{Path(inspect.getfile(d.func)).stem}.{name}"
            for name, defs in item._fixtureinfo.name2fixturedefs.items()
            for d in defs
            if d.scope in ("module", "session") and name not in PER_WORKER and _starts_processes(d.func, set())
        }
        for item in items
    }
    parent = {}

    def root(name):  # union-find over the fixtures: used together by one test -> one group
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    for names in shared.values():
        for name in names:
            parent[root(name)] = root(min(names))
    for item, names in shared.items():
        if names:
            item.add_marker(pytest.mark.xdist_group(root(min(names))))
    # Longest first: the Slurm jobs that train (minutes each, much of it waiting on the scheduler), then the other
    # tests that start processes, then those that start none; otherwise a job started last keeps one worker busy
    # while the others idle. (A stable sort: each file's tests keep their order.)
    items.sort(
        key=lambda item: (
            0 if {"cluster", "cifar_dir"} <= set(item.fixturenames) else 1 if item.get_closest_marker("slow") else 2
        )
    )


@pytest.fixture(autouse=True)
def no_process_in_the_fast_tier(request, monkeypatch):
    """A test not marked slow must not start a process: fail at once, before anything starts."""
    if request.node.get_closest_marker("slow") is None:

        def refuse(*args, **kwargs):
            pytest.fail(
                f"{request.node.nodeid} starts a process but is not marked slow (conftest.py did not see "
                f"it reach subprocess or multiprocessing): mark it @pytest.mark.slow",
                pytrace=True,
            )

        monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        monkeypatch.setattr(os, "fork", refuse)
        monkeypatch.setattr(os, "posix_spawn", refuse)
        monkeypatch.setattr(os, "system", refuse)


PER_TRAIN_FILE = 64  # 5 files -> 320 training images
VAL_IMAGES = 101  # odd on purpose: DistributedSampler must pad it for 2 ranks
TRAIN_IMAGES = 5 * PER_TRAIN_FILE


def synthetic_batch(n: int, seed: int) -> dict:
    """Learnable images: each class is its own mean colour plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    palette = np.random.default_rng(1234).integers(30, 225, (10, 3))
    images = palette[labels][:, :, None, None] + rng.normal(0, 25, (n, 3, 32, 32))
    data = np.clip(images, 0, 255).astype(np.uint8).reshape(n, 3072)
    return {"data": data, "labels": labels.tolist()}


def write_cifar(root: Path, per_train_file=PER_TRAIN_FILE, val_images=VAL_IMAGES) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(synthetic_batch(per_train_file, seed=i), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(synthetic_batch(val_images, seed=99), f)
    return root


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    """A data dir with 320 training and 101 validation images; use --train-subset/--val-subset."""
    return write_cifar(tmp_path_factory.mktemp("cifar"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def pythonpath_with(*folders, env: dict) -> str:
    """`env`'s PYTHONPATH with `folders` first (a sitecustomize module there is the one Python imports)."""
    return os.pathsep.join(filter(None, [*map(str, folders), env.get("PYTHONPATH")]))


def cpu_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore::UserWarning")
    # Every Python process started with this environment collects garbage less often, and not at exit
    # (tests/lean_gc/sitecustomize.py): a quarter of the CPU time a test run of raw_ddp.py costs.
    env["PYTHONPATH"] = pythonpath_with(LEAN_GC, env=env)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def raise_in_rank_env(rank: int, env: dict) -> dict:
    """`env` with tests/raise_in_rank/ first on PYTHONPATH: rank `rank` raises in its first loss computation.
    The checkout comes next, so that the processes import its cifar_wrn, whatever pip installed."""
    return {**env, "PYTHONPATH": pythonpath_with(TESTS / "raise_in_rank", REPO, env=env), "RAISE_IN_RANK": str(rank)}


def exit_threads_env(folder: Path, env: dict) -> dict:
    """`env` with tests/exit_threads/ first on PYTHONPATH: every process writes to `folder` the threads it still
    runs at exit (check_no_gloo_thread_at_exit reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {**env, "PYTHONPATH": pythonpath_with(TESTS / "exit_threads", env=env), "EXIT_THREADS_DIR": str(folder)}


def check_no_gloo_thread_at_exit(folder: Path) -> None:
    """No process started with exit_threads_env(folder, ...) still ran a gloo thread at exit (the launcher and the
    two ranks, at least, wrote what they ran)."""
    threads = {file.name: file.read_text().split("\n") for file in folder.iterdir()}
    assert len(threads) >= 3, threads
    assert {pid: names for pid, names in threads.items() if any("gloo" in name for name in names)} == {}


def start(cmd, env=None, cwd=REPO) -> subprocess.Popen:
    """A new session, so that a timeout can kill the launcher and every rank it spawned (kill_all)."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the process started by start(), its group, and every process descending from it. The group alone
    is not enough: torchrun's agent (which accelerate launch runs too) starts each rank in a session of its own,
    and a rank left alive holds the test's pipes open, so that communicate() would wait for it, a hang."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)  # before the kill orphans them
    except psutil.Error:
        descendants = []
    os.killpg(proc.pid, signal.SIGKILL)
    for process in descendants:
        try:
            process.kill()
        except psutil.Error:  # gone already
            pass


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    import time

    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s (every process killed)\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - t0)


def run(cmd, timeout: float = 180, env=None) -> Result:
    return finish(start(cmd, env), timeout)


def raw_ddp(*flags, timeout: float = 180, env=None) -> Result:
    return run([sys.executable, "raw_ddp.py", *flags], timeout=timeout, env=env)


# The tiny model the tests train: raw_ddp.py's flags (TINY) and accel_train.py's (ACCEL_TINY: its device comes from
# the launch or --cpu; eval_batch_size 16 gives several validation batches and a remainder).
TINY = ["--device", "cpu", "--model-width", "4", "--set", "eval_batch_size=64"]
ACCEL_TINY = ["--model-width", "4", "--set", "eval_batch_size=16"]

# The course's epoch line as both trainers print it (cifar_wrn/runlog.py's epoch_line); group 1: the epoch.
EPOCH_LINE = re.compile(
    r"^Epoch = +(\d+): Cumulative Time = [\d.]+, Epoch Time = [\d.]+, Images/sec = [\d.]+, "
    r"Training Accuracy = [\d.]+, Validation Loss = [\d.]+, Validation Accuracy = [\d.]+$",
    re.M,
)


def data_flags(data_dir, train=TRAIN_IMAGES, val=VAL_IMAGES) -> list:
    """The flags that point a trainer at `data_dir` (conftest's synthetic CIFAR-10), `train` and `val` images of it."""
    return ["--data-dir", data_dir, "--train-subset", train, "--val-subset", val]


def raw_flags(data_dir, *extra) -> list:
    """raw_ddp.py's tiny model on all of `data_dir`, --dist-timeout 60 (a rank left waiting fails the run in a
    minute), then `extra`; without --num-gpus."""
    return [*TINY, *data_flags(data_dir), "--dist-timeout", 60, *extra]


def torchrun_command(*args, nproc: int = 2) -> list:
    """torchrun (python -m torch.distributed.run) of `nproc` processes on this machine, its rendezvous on a free
    port; `args`: the script and its flags (or --no-python and a program)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        nproc,
        "--master_port",
        free_port(),
        *args,
    ]


def two_node_flags(node_id, port) -> list:
    """raw_ddp.py's flags for node `node_id` of two "nodes" of one process each on this machine, meeting at `port`."""
    return [
        "--num-nodes",
        2,
        "--node-id",
        node_id,
        "--num-gpus",
        1,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]


def profile_flags(out: Path) -> list:
    """2 epochs with --profile, the traces in out/trace and the log in out/log.jsonl: what check_profile reads."""
    return ["--epochs", 2, "--profile", "--trace", out / "trace", "--log-json", out / "log.jsonl"]


# The fast recipe at batch size 32 for 2 epochs, without the safety net: fast.yaml's extra_epochs would add a third
# epoch whenever epoch 1 misses 0.85 and epoch 2 meets it (tests/test_safety_net.py tests the net).
FAST_2_EPOCHS = ["--recipe", "fast", "--batch-size", 32, "--epochs", 2, "--set", "extra_epochs=0"]

# The fast recipe's options that both trainers' end-to-end tests add (tests/test_fast.py, tests/test_accel.py):
# EMA, DDP bucket view and static graph, bf16 gradient compression, flip TTA, augmentation (random crop and flip),
# a doubled rate for BatchNorm parameters, BatchNorm recalibration on 100 training images.
EVERY_OPTION = [
    "ema_decay=0.9",
    "ddp_bucket_view=true",
    "ddp_static_graph=true",
    "grad_compression=bf16",
    "tta_flip=true",
    "augment=true",
    "bn_lr_scale=2",
    "bn_recalibration=100",
]


@pytest.fixture(scope="session")
def two_process_run(cifar_dir, tmp_path_factory) -> tuple[Result, Path]:
    """One plain 2-process run, shared by the tests that only read what it printed and wrote: (result, folder
    holding w.pt, log.jsonl and threads/, the threads each process ran at exit). 2 epochs: at most 6, stopped early
    by a target of 0 with patience 2."""
    out = tmp_path_factory.mktemp("run")
    result = raw_ddp(
        "--num-nodes",
        1,
        "--node-id",
        0,
        "--num-gpus",
        2,
        *TINY,
        *data_flags(cifar_dir),
        "--epochs",
        6,
        "--target-accuracy",
        0.0,
        "--patience",
        2,
        "--set",
        "momentum=0.9",
        "--base-lr",
        0.02,  # learns in 10 steps
        "--save",
        out / "w.pt",
        "--log-json",
        out / "log.jsonl",
        env=exit_threads_env(out / "threads", cpu_env()),
    )
    return result, out


def wait_for_epoch(log_path, timeout=120, text='"kind": "epoch"'):
    """Block until a run's JSON log holds its first epoch record (then signal it mid-run); with `text`, until
    the log holds that text (the first record that says so)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log_path.exists() and text in log_path.read_text():
            return
        time.sleep(0.05)
    pytest.fail(f"the run never wrote {text} to its log within {timeout} s")


def check_profile(log_path, trace_dir):
    """--profile records: every phase, non-negative, summing to the epoch time within 5%; one trace per rank."""
    from cifar_wrn.profiling import PHASES
    from cifar_wrn.runlog import read_log

    _, epochs = read_log(log_path)
    for e in epochs:
        assert set(e["profile"]) == set(PHASES) and all(v >= 0 for v in e["profile"].values())
        assert sum(e["profile"].values()) == pytest.approx(e["epoch_time"], rel=0.05)
        assert e["profile"]["forward"] > 0 and e["profile"]["backward"] > 0
        assert 0 <= e["comm_estimate"] < e["epoch_time"]
    traces = sorted(p.name.split(".")[0] for p in trace_dir.iterdir())
    assert traces == ["rank0", "rank1"]


def check_metrics_of_saved_weights(log_path, weights_path, cifar_dir):
    """The last logged validation metrics (bf16, flip TTA) equal one process evaluating the saved weights."""
    from torch.utils.data import BatchSampler, DataLoader

    from cifar_wrn.data import load_split
    from cifar_wrn.evaluation import evaluate
    from cifar_wrn.model import WideResNet
    from cifar_wrn.pipeline import DeviceBatches
    from cifar_wrn.runlog import read_log

    _, epochs = read_log(log_path)
    model = WideResNet(width=4)
    model.load_state_dict(torch.load(weights_path))
    val = DeviceBatches(*load_split(cifar_dir, train=False, subset=VAL_IMAGES), "cpu", augment=False)
    loader = DataLoader(val, batch_size=None, sampler=BatchSampler(range(VAL_IMAGES), 50, drop_last=False))
    totals = evaluate(
        model,
        loader,
        torch.ones(VAL_IMAGES, dtype=torch.bool),
        torch.device("cpu"),
        torch.bfloat16,
        tta_flip=True,
    )
    assert epochs[-1]["val_accuracy"] == pytest.approx(totals[1].item() / VAL_IMAGES, abs=1e-12)
    assert epochs[-1]["val_loss"] == pytest.approx(totals[0].item() / VAL_IMAGES, rel=1e-3)  # bf16 batches differ


def check_bn_recalibrated(weights_path, cifar_dir, images: int, world_size: int):
    """The saved network's BatchNorm statistics are its own: re-estimating them (32 per batch, bf16 and
    channels_last, as the tests' fast recipe runs) on each rank's recalibration images and averaging over
    the ranks (bench/eval_variants.py's `recalibrated`) gives them back."""

    sys.path.insert(0, str(REPO / "bench"))
    from eval_variants import recalibrated

    from cifar_wrn.data import load_split
    from cifar_wrn.model import WideResNet
    from cifar_wrn.pipeline import DeviceBatches
    from cifar_wrn.recipe import load_recipe

    saved = WideResNet(width=4)
    saved.load_state_dict(torch.load(weights_path))
    train_set = DeviceBatches(*load_split(cifar_dir, train=True, subset=TRAIN_IMAGES), "cpu", augment=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the threads of each of the run's processes on 2 cores: bf16 rounds the same way
    again = recalibrated(
        saved.to(memory_format=torch.channels_last),
        train_set,
        load_recipe("fast", {"batch_size": 32, "bn_recalibration": images}),
        world_size,
    )
    torch.set_num_threads(threads)
    for key, expected in again.state_dict().items():
        if "running" in key:
            error = ((saved.state_dict()[key] - expected).norm() / expected.norm()).item()
            # bf16 rounding differs after the first convolution and grows with depth (< 1.5 % measured); the
            # ranks' own statistics differ from their mean by 1-37 %: a missing average or recalibration fails.
            assert error < (1e-6 if key.startswith("stem.") else 0.03), (key, error)


def check_slow_bf16_warning(stderr: str):
    """A bf16 run on this CPU warned once (per node) where the CPU lacks bfloat16 kernels, and not otherwise."""
    from cifar_wrn.recipe import slow_bf16_warning

    warning = slow_bf16_warning("cpu", "bf16")
    if warning:
        assert stderr.count(warning) == 1, stderr[-3000:]
    else:
        assert "without bfloat16 kernels" not in stderr, stderr[-3000:]


def parameter_distance(weights_a, weights_b, width: int = 4) -> float:
    """L2 distance between the trainable parameters (not the BatchNorm buffers) of two saved state_dicts."""
    from cifar_wrn.model import WideResNet

    a, b = torch.load(weights_a), torch.load(weights_b)
    names = [name for name, _ in WideResNet(width=width).named_parameters()]
    return sum(((a[n].double() - b[n].double()) ** 2).sum() for n in names).sqrt().item()


# One plain-SGD step (baseline: no momentum, no weight decay) of 2 x 16 images at a fixed learning rate.
ONE_STEP = [
    "--recipe",
    "baseline",
    "--batch-size",
    16,
    "--epochs",
    1,
    "--train-subset",
    32,
    "--val-subset",
    VAL_IMAGES,
    "--set",
    "lr_scaling=none",
    "--set",
    "momentum=0",  # plain SGD: the tests measure one step's own size (the baseline's momentum is 0.9)
]


# ---- shared runs (speed-a)
# The resume tests of test_agreement.py and test_reliability.py resume from, or compare with, the same three runs:
# started once per session (test start-up, not training, is what a run costs), side by side. A test that resumes
# into one (or only might write into it) copies its folder first; a test resuming raw_ddp.py's must pass
# resume_flags, as the runs did: the checkpoint records the data and batch size and refuses others.


def resume_flags(data_dir, *extra):
    """raw_ddp.py's flags for the shared runs, without --num-gpus (2 in the runs: two_nodes passes its own).
    --batch-size 4: 40 steps per epoch, so that a signal can stop a run in the middle of an epoch."""
    return raw_flags(data_dir, "--batch-size", 4, *extra)


@dataclass
class ResumeRuns:
    checkpoint: Result  # raw_ddp.py --epochs 1 --auto-resume into an empty folder: folder/raw/ck, folder/raw/l.jsonl
    straight: Result  # raw_ddp.py --epochs 2, never stopped: folder/straight/w.pt, folder/straight/l.jsonl
    accel: Result  # accel_train.py --epochs 1 (test_accel.reliability_flags): folder/accel/ck
    folder: Path

    def copy(self, name: str, into: Path) -> Path:
        """A test's own copy of folder/name, as into/<its last part>: to resume into, the shared runs unchanged."""
        import shutil

        return Path(shutil.copytree(self.folder / name, into / Path(name).name))


@pytest.fixture(scope="session")
def resume_runs(cifar_dir, tmp_path_factory) -> ResumeRuns:
    from test_accel import CONFIGS, accelerate_launch, reliability_flags

    folder = tmp_path_factory.mktemp("resume_runs")
    raw, straight = folder / "raw", folder / "straight"
    raw.mkdir()
    straight.mkdir()
    procs = [
        start([sys.executable, "raw_ddp.py", "--num-gpus", 2, *resume_flags(cifar_dir, *extra)])
        for extra in (
            ["--epochs", 1, "--checkpoint-dir", raw / "ck", "--auto-resume", "--log-json", raw / "l.jsonl"],
            ["--epochs", 2, "--save", straight / "w.pt", "--log-json", straight / "l.jsonl"],
        )
    ]
    accel = accelerate_launch(
        CONFIGS / "two_cpus.yaml",  # meanwhile, the raw runs go on
        *reliability_flags(cifar_dir, "--epochs", 1, "--checkpoint-dir", folder / "accel" / "ck"),
    )
    runs = ResumeRuns(*(finish(p, 240) for p in procs), accel, folder)  # 240 s: three runs at once on a loaded machine
    for result in (runs.checkpoint, runs.straight, runs.accel):
        assert result.returncode == 0, result.stderr[-3000:]
    return runs


# ---- shared runs (speed-c)


@pytest.fixture(scope="session")
def torchrun_profile_run(cifar_dir, tmp_path_factory) -> tuple[Result, Path]:
    """raw_ddp.py started by torchrun (2 processes), 2 epochs of a width-8 model in bf16 with --profile and
    --trace: (result, folder holding log.jsonl and trace/). tests/test_raw_ddp.py's torchrun launch and
    tests/test_profile.py's profile test read it (one launch for both: the launcher does not matter to the
    profile, the profile not to the launch)."""
    out = tmp_path_factory.mktemp("torchrun_profile")
    result = run(
        torchrun_command(
            "raw_ddp.py",
            *TINY,
            "--model-width",
            8,
            "--set",
            "precision=bf16",
            *data_flags(cifar_dir),
            *profile_flags(out),
        ),
        timeout=300,
    )
    return result, out


# ---- shared runs (share-more)


@pytest.fixture(scope="session")
def rank_1_raises(cifar_dir) -> Result:
    """raw_ddp.py, 2 processes, rank 1 raising in its first loss computation (tests/raise_in_rank/): one run for
    test_raw_ddp.py's test_worker_that_raises_is_named_with_traceback (core) and
    test_rank_that_raises_ends_the_run_promptly (--runslow), which launched it with the same flags.
    --dist-timeout 300: rank 0, were it left waiting, would wait that long, so each test's bound on the run's time
    tells. The timeout (240 s)
    only kills a hang; the tests assert their own bounds on result.seconds."""
    return raw_ddp(
        "--num-gpus",
        2,
        *TINY,
        *data_flags(cifar_dir),
        "--dist-timeout",
        300,
        env=raise_in_rank_env(1, cpu_env()),
        timeout=240,
    )
