"""Refusals: values no one can mean are refused before any process starts, and every
refusal is one `error:` line from one process, exit status 2. Under `accelerate launch` or torchrun the
launcher's own report of the failed process follows that line, and the launcher exits 1.

The quick tier runs each entry point's `__main__` in this process, as `python <trainer> <flags>` would, with
the launch (raw_ddp.py's Launcher, the ranks' report_failures) replaced by a stub that fails the test: a value
that is not refused fails there, before any process or training starts."""

import os
import re
import runpy
import sys

import pytest
import torch
from helpers import ACCEL_TINY, REPO, TINY, cpu_env, data_flags, finish, free_port, start

import cifar_wrn.rendezvous
import cifar_wrn.resilience
from cifar_wrn.accel_side import resolve_accel_launch
from cifar_wrn.errors import UserError
from cifar_wrn.raw_side import resolve_raw_launch

TRAINERS = ("raw_ddp.py", "accel_train.py")
DEVICE = {"raw_ddp.py": ["--device", "cpu"], "accel_train.py": ["--cpu"]}
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = 240  # seconds per launch; every process is killed after that


def clean_launch_environment(monkeypatch):
    for key in [*LAUNCH_VARIABLES, *(k for k in list(os.environ) if k.startswith("ACCELERATE_"))]:
        monkeypatch.delenv(key, raising=False)


def main_in_this_process(trainer, flags, monkeypatch, capsys, device=True) -> tuple[int, str]:
    """`python <trainer> <flags>` on the CPU (with the trainer's CPU flag unless not `device`), up to where it would
    start the ranks: (exit status, stderr)."""

    def not_refused(*args, **kwargs):
        raise AssertionError(f"{trainer} {' '.join(map(str, flags))} was not refused: it went on to train")

    clean_launch_environment(monkeypatch)
    monkeypatch.setattr(cifar_wrn.rendezvous, "Launcher", not_refused)
    monkeypatch.setattr(cifar_wrn.resilience, "report_failures", not_refused)
    monkeypatch.setattr(sys, "argv", [trainer, *(DEVICE[trainer] if device else []), *map(str, flags)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / trainer), run_name="__main__")
    return exit_.value.code, capsys.readouterr().err


def assert_one_error_line(stderr: str, message: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.search(message, errors[0]), errors[0]
    return errors[0]


# ----------------------------------------------------------------------------- without processes (item 6)

FLOAT32_MAX = "3.4e\\+38, the largest float32"
UNMEANT = {
    "dist-timeout nan": (["--dist-timeout", "nan"], r"--dist-timeout must be a number of seconds in \(0, 1e\+09\]"),
    "dist-timeout inf": (["--dist-timeout", "inf"], r"--dist-timeout .* \(got inf\)"),
    "dist-timeout 1e10": (["--dist-timeout", "1e10"], r"--dist-timeout .* \(got 1e\+10\)"),
    "seed flag 2**64": (["--seed", 2**64], rf"seed must be in \[0, 2\*\*63\) \(got {2**64}\)"),
    "seed set 2**64": (["--set", f"seed={2**64}"], rf"seed must be in \[0, 2\*\*63\) \(got {2**64}\)"),
    "seed 2**64-1": (["--seed", 2**64 - 1], r"seed must be in \[0, 2\*\*63\)"),  # + rank 1: beyond 64 bits
    "seed -1": (["--seed", -1], r"seed must be in \[0, 2\*\*63\) \(got -1\)"),
    "base_lr 1e300": (["--set", "base_lr=1e300"], rf"the learning rate 1e\+300 .* is beyond {FLOAT32_MAX}"),
    "base-lr 2e38 x 2": (["--base-lr", 2e38, "--batch-size", 64], rf"the learning rate 4e\+38 .*{FLOAT32_MAX}"),
    "bn_lr_scale 1e300": (["--set", "bn_lr_scale=1e300"], rf"BatchNorm parameters' learning rate .*{FLOAT32_MAX}"),
    "weight_decay 1e300": (["--set", "weight_decay=1e300"], rf"weight_decay must be at most {FLOAT32_MAX}"),
}


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("case", UNMEANT)
def test_values_no_one_can_mean_are_one_error_line_and_status_2(trainer, case, monkeypatch, capsys):
    """Each used to reach a traceback inside a rank (timedelta, torch.manual_seed, SGD's float32 step)."""
    flags, message = UNMEANT[case]
    status, stderr = main_in_this_process(trainer, flags, monkeypatch, capsys)
    assert status == 2 and "Traceback" not in stderr
    assert_one_error_line(stderr, message)


RECIPE_FILES = {
    "seed 2**64": (f"seed: {2**64}\n", r"seed must be in \[0, 2\*\*63\) \(got 18446744073709551616\)"),
    # YAML would keep base_lr 0.2, the merged 0.1 dropped: a key written twice, which a recipe refuses
    "merge key": ("<<: {base_lr: 0.1}\nbase_lr: 0.2\n", r"line 1: a merge key \(<<\)"),
}


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("case", RECIPE_FILES)
def test_a_recipe_files_seed_beyond_64_bits_and_its_merge_keys_are_refused(
    trainer, case, tmp_path, monkeypatch, capsys
):
    text, message = RECIPE_FILES[case]
    (recipe := tmp_path / "recipe.yaml").write_text(text)
    status, stderr = main_in_this_process(trainer, ["--recipe", recipe], monkeypatch, capsys)
    assert status == 2 and "Traceback" not in stderr
    assert_one_error_line(stderr, message)


FULL_RUN_WITHOUT_GPU = (
    r"^error: no GPU here: submit the job \(README\), or train on the CPU with --device cpu \(hours on the full "
    r"data; a short run: add --train-subset 2000 --val-subset 1000 --epochs 2\)$"
)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_full_data_run_without_a_gpu_stops_before_any_process_saying_what_to_do(trainer, monkeypatch, capsys):
    """--device auto (the default), no CUDA, the full data: once a warning and hours of training on 2 CPU cores;
    now one line before any process starts (the stub that stands for the launch fails the test if reached)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    status, stderr = main_in_this_process(trainer, ["--data-dir", "data"], monkeypatch, capsys, device=False)
    assert status == 2 and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == assert_one_error_line(stderr, FULL_RUN_WITHOUT_GPU)


@pytest.mark.parametrize(
    "trainer, flags, environment",
    [
        ("raw_ddp.py", ["--device", "cpu"], {}),
        ("raw_ddp.py", ["--train-subset", 64], {}),
        ("accel_train.py", ["--device", "cpu"], {}),
        ("accel_train.py", ["--cpu"], {}),
        ("accel_train.py", ["--train-subset", 64], {}),
        ("accel_train.py", [], {"ACCELERATE_USE_CPU": "1"}),  # the launch asked for the CPU (DEVICE=cpu jobs)
    ],
)
def test_asking_for_the_cpu_or_a_subset_still_starts_without_a_gpu(trainer, flags, environment, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [trainer, "--data-dir", "data", *map(str, flags)])
    resolve = resolve_raw_launch if trainer == "raw_ddp.py" else resolve_accel_launch
    module = runpy.run_path(str(REPO / trainer))  # its parse_args, not its __main__
    settings, _ = resolve(module["parse_args"]())
    assert settings.data.data_dir == "data"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_float32_bound_counts_every_process_of_the_global_batch(trainer, monkeypatch):
    """base_lr 2e38 is a float32, but linear scaling doubles it at 2 processes of 32 (the reference batch 32)."""
    import accel_train
    import raw_ddp

    clean_launch_environment(monkeypatch)
    flags = [*DEVICE[trainer], "--base-lr", "2e38"]
    if trainer == "raw_ddp.py":
        resolve_raw_launch(raw_ddp.parse_args(flags))  # one process: 2e38, held
        launch = lambda: resolve_raw_launch(raw_ddp.parse_args([*flags, "--num-gpus", "2"]))
    else:
        resolve_accel_launch(accel_train.parse_args(flags))
        monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it
        launch = lambda: resolve_accel_launch(accel_train.parse_args(flags))
    lr = r"the learning rate 4e\+38 \(base_lr 2e\+38, lr_scaling linear, global batch 64, bn_lr_scale 1\) is beyond"
    with pytest.raises(UserError, match=lr):
        launch()


def test_a_repeated_set_takes_the_last_value_and_a_dedicated_flag_beats_set(monkeypatch):
    import raw_ddp

    clean_launch_environment(monkeypatch)
    flags = ["--device", "cpu", "--set", "momentum=0.5", "--set", "momentum=0.9", "--set", "seed=3", "--seed", "4"]
    _, recipe = resolve_raw_launch(raw_ddp.parse_args(flags))
    assert (recipe.momentum, recipe.seed) == (0.9, 4)


def test_a_refusal_another_process_finds_alike_is_said_by_one(monkeypatch):
    """LOCAL_RANK 0 raises at once; another waits for the launcher to end it (once the first has exited with
    its line), and says it itself only if it is still running after that wait."""
    from cifar_wrn.errors import said_by_one

    waits = []
    monkeypatch.setattr("time.sleep", waits.append)
    for local_rank, expected in ((None, []), ("0", []), ("1", [10.0])):
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        if local_rank is not None:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(UserError, match="bad"), said_by_one():
            raise UserError("bad")
        with said_by_one():
            pass
        assert waits == expected
        waits.clear()


# ----------------------------------------------------------------------------- processes (items 6 and 7)


def accel_env(**extra) -> dict:
    env = {k: v for k, v in cpu_env().items() if not k.startswith("ACCELERATE_")}
    return {**env, **{k: str(v) for k, v in extra.items()}}


OUR_FRAME = re.compile(r'File "[^"]*(raw_ddp\.py|accel_train\.py|cifar_wrn/)')
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
TWO_CPUS = ["--config_file", REPO / "accelerate_configs" / "two_cpus.yaml"]
LAUNCHES = {
    # accelerate launch of 2 processes (item 7): the launch's settings refused
    "mixed_precision fp16": (
        [*TWO_CPUS, "--mixed_precision", "fp16"],
        [],
        r"error: the launch asks for mixed_precision 'fp16': make it bf16 or 'no'",
    ),
    "dynamo_backend aot_eager": (
        [*TWO_CPUS, "--dynamo_backend", "aot_eager"],
        [],
        r"error: the launch asks for dynamo_backend 'aot_eager': make it inductor or 'no'",
    ),
    # a value no one can mean (item 6), under the launcher
    "base_lr 1e300": ([*TWO_CPUS], ["--set", "base_lr=1e300"], r"error: invalid recipe: the learning rate 2e\+300"),
    # accelerate launch --cpu --num_processes 2 without a config: one process, refused
    "--cpu --num_processes 2": (
        ["--cpu", "--num_processes", 2, "--num_machines", 1, "--mixed_precision", "no", "--dynamo_backend", "no"],
        [],
        r"error: accelerate launch was asked for several processes but started only this one",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LAUNCHES)
def test_a_refusal_under_accelerate_launch_is_one_line_from_one_process(case, cifar_dir, tmp_path):
    """Every process finds the refusal; one says it, exit status 2 (accelerate launch's report names it as the
    root cause, and the launcher exits 1); the others stay silent."""
    launch, flags, message = LAUNCHES[case]
    log = tmp_path / "log.jsonl"
    port = ["--main_process_port", free_port()]
    trainer = ["accel_train.py", "--cpu", *ACCEL_TINY, *data_flags(cifar_dir), "--epochs", 1, "--log-json", log]
    result = finish(start([*ACCELERATE, *launch, *port, *trainer, *flags], env=accel_env()), TIMEOUT)
    assert result.returncode != 0 and not log.exists()
    line = assert_one_error_line(result.stderr, message)
    assert not OUR_FRAME.search(result.stderr), result.stderr[-3000:]  # no traceback through our code
    assert result.stderr.index(line) < result.stderr.find("Traceback") or "Traceback" not in result.stderr
    if case != "--cpu --num_processes 2":  # 2 processes: torchrun's report names the one that failed first
        assert re.search(r"Root Cause[^\[]*\[0\]:[^\[]*exitcode\s*: 2 ", result.stderr), result.stderr[-3000:]


@pytest.mark.slow
def test_a_refusal_under_torchrun_is_one_line_from_one_process(cifar_dir, tmp_path):
    """raw_ddp.py's ranks under torchrun, as under accelerate launch: one line, the others silent."""
    log = tmp_path / "log.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", 2, "--master_port", free_port()]
    flags = [*TINY, *data_flags(cifar_dir), "--epochs", 1, "--log-json", log, "--set", "base_lr=1e300"]
    result = finish(start([*torchrun, "raw_ddp.py", *flags]), TIMEOUT)
    assert result.returncode != 0 and not log.exists()
    assert_one_error_line(result.stderr, r"error: invalid recipe: the learning rate 2e\+300")
    assert not OUR_FRAME.search(result.stderr), result.stderr[-3000:]
    assert re.search(r"Root Cause[^\[]*\[0\]:[^\[]*exitcode\s*: 2 ", result.stderr), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_value_no_one_can_mean_ends_the_process_with_status_2(trainer, cifar_dir, tmp_path):
    """The trainers as processes (raw_ddp.py asked for 2): one line, status 2, nothing trained."""
    log = tmp_path / "log.jsonl"
    extra = ["--num-gpus", 2] if trainer == "raw_ddp.py" else []
    flags = [*DEVICE[trainer], *data_flags(cifar_dir), "--log-json", log, *extra, "--set", "weight_decay=1e300"]
    result = finish(start([sys.executable, trainer, "--model-width", 4, *flags], env=accel_env()), 120)
    assert result.returncode == 2 and "Traceback" not in result.stderr and not log.exists()
    assert_one_error_line(result.stderr, r"error: invalid recipe: weight_decay must be at most 3.4e\+38")
