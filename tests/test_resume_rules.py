"""What a resume may and may not continue, for both trainers (2 CPU processes each): a resume whose stopping rule
already holds on the epochs the checkpoint recorded trains nothing and ends with the course's last line; a
checkpoint without the training counts of its epoch (train_correct, train_seen: an earlier version's) is refused
on every rank, one error line, before anything trains. A run that had stopped early, resumed under a stricter
rule with epochs left, trains on; under a rule that holds, or with no epoch left, it trains nothing.

The tests resume from copies of one shared 2-epoch run per trainer (two_epoch_runs: their target, 0.99, unmet)
or of one run per trainer that stopped early after epoch 1 (stopped_early_runs: target 0.01, patience 1).
"""

import re
import shutil
import signal
import sys

import pytest
import torch
from helpers import ACCEL_TINY, EPOCH_LINE, TINY, cpu_env, data_flags, finish, start
from test_accel import CONFIGS, accel_env, accelerate_command

from cifar_wrn.runlog import read_log

TRAINERS = ["raw", "accel"]
TIMEOUT = 240  # seconds per launch (several side by side on a loaded machine); then every process is killed
FIRST_TARGET = 0.99  # the first runs' target: not met in 2 epochs of the tiny model


def command(trainer: str, data_dir, *extra) -> list:
    """2 CPU processes of `trainer`'s tiny model on all of `data_dir`, --dist-timeout 60, then `extra`."""
    if trainer == "raw":
        return [
            sys.executable,
            "raw_ddp.py",
            "--num-gpus",
            2,
            *TINY,
            *data_flags(data_dir),
            "--dist-timeout",
            60,
            *extra,
        ]
    flags = ["--cpu", *ACCEL_TINY, *data_flags(data_dir), "--dist-timeout", 60, *extra]
    return accelerate_command(CONFIGS / "two_cpus.yaml", *flags)


def launch(trainer: str, data_dir, *runs: list) -> list:
    """Each of `runs` (a list of flags) launched at once, side by side; their results, in order."""
    env = cpu_env() if trainer == "raw" else accel_env()
    procs = [start(command(trainer, data_dir, *flags), env=env) for flags in runs]
    return [finish(proc, TIMEOUT) for proc in procs]


def runs_side_by_side(cifar_dir, tmp_path_factory, name: str, *flags) -> tuple[dict, dict]:
    """Both trainers' runs with `flags` at once, each in a folder of its own (ck/, log.jsonl): trainer -> folder,
    trainer -> result, each run checked to have exited 0."""
    folders = {trainer: tmp_path_factory.mktemp(f"{name}_{trainer}") for trainer in TRAINERS}
    procs = {
        trainer: start(
            command(trainer, cifar_dir, *flags, "--checkpoint-dir", folder / "ck", "--log-json", folder / "log.jsonl"),
            env=cpu_env() if trainer == "raw" else accel_env(),
        )
        for trainer, folder in folders.items()
    }
    results = {trainer: finish(proc, TIMEOUT) for trainer, proc in procs.items()}
    for trainer, result in results.items():
        assert result.returncode == 0, f"{trainer}:\n{result.stdout}\n{result.stderr[-3000:]}"
    return folders, results


@pytest.fixture(scope="module")
def two_epoch_runs(cifar_dir, tmp_path_factory) -> dict:
    """trainer -> a folder holding ck/ (the checkpoint after epoch 2) and log.jsonl, of 2 epochs with
    --target-accuracy 0.99 (unmet); both trainers' runs side by side. Tests resume from copies (copy_run)."""
    folders, results = runs_side_by_side(
        cifar_dir, tmp_path_factory, "first", "--epochs", 2, "--target-accuracy", FIRST_TARGET
    )
    for trainer, result in results.items():
        assert [int(n) for n in EPOCH_LINE.findall(result.stdout)] == [1, 2], result.stdout
        _, epochs = read_log(folders[trainer] / "log.jsonl")
        # what the tests rely on: the first run's target unmet, the resumes' target (0.01) met after each epoch
        assert all(0.01 <= e["val_accuracy"] < FIRST_TARGET for e in epochs), epochs
    return folders


def copy_run(first, into):
    """A test's own copy of a first run's folder: ck/ and log.jsonl."""
    return shutil.copytree(first, into)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.slow
@pytest.mark.xdist_group("resume_rules")
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_resume_whose_stopping_rule_already_holds_trains_nothing(cifar_dir, tmp_path, two_epoch_runs, trainer):
    """The 2-epoch run resumed with --epochs 5 and a target of 0.01 (met by both epochs): at patience 2 or 1 the
    resume's check, after epoch 2, holds. Neither resume trains an epoch, each ends with the course's last line
    for epoch 2, and the log keeps its 2 epochs. (A resume that ignored the rule in force would train epoch 3.)"""
    first = two_epoch_runs[trainer]
    _, logged = read_log(first / "log.jsonl")
    copies = {patience: copy_run(first, tmp_path / f"patience{patience}") for patience in (2, 1)}
    results = launch(
        trainer,
        cifar_dir,
        *[
            ["--resume", "--epochs", 5, "--target-accuracy", 0.01, "--patience", patience]
            + ["--checkpoint-dir", folder / "ck", "--log-json", folder / "log.jsonl"]
            for patience, folder in copies.items()
        ],
    )
    for (patience, folder), result in zip(copies.items(), results):
        shown = f"patience {patience}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
        assert result.returncode == 0, shown
        assert "Resuming from" in result.stdout and ": epoch 3, step 0" in result.stdout, shown
        assert "Epoch = " not in result.stdout, shown  # nothing trained
        assert last_line(result.stdout) == "Early stopping after epoch 2", shown  # where the resume checked
        _, epochs = read_log(folder / "log.jsonl")
        assert [e["epoch"] for e in epochs] == [1, 2]
        assert epochs == logged  # the first run's records, nothing added or rewritten


def training_state_file(checkpoint_dir, trainer: str):
    """The file holding the run's progress: raw_ddp.py's checkpoint.pt, accel_train.py's training_state.pt in
    the folder LATEST names."""
    if trainer == "raw":
        return checkpoint_dir / "checkpoint.pt"
    return checkpoint_dir / (checkpoint_dir / "LATEST").read_text().strip() / "training_state.pt"


def rank_exit_codes(stderr: str) -> dict:
    """rank -> exit status, from torchrun's failure report (accelerate launch prints it when a rank failed)."""
    report = re.findall(r"rank +: (\d+) \(local_rank: \d+\)\s+exitcode +: (-?\d+)", stderr)
    return {int(rank): int(status) for rank, status in report}


@pytest.mark.slow
@pytest.mark.xdist_group("resume_rules")
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_checkpoint_without_the_training_counts_is_refused(cifar_dir, tmp_path, two_epoch_runs, trainer):
    """The checkpoint after epoch 2 less train_correct and train_seen (as an earlier version wrote it): --resume
    for a third epoch stops every rank with exit status 2 before anything trains, one error line (from one rank,
    the other stops silently) naming the file and both keys, no traceback; the file is left as it was."""
    folder = copy_run(two_epoch_runs[trainer], tmp_path / "run")
    path = training_state_file(folder / "ck", trainer)
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert {"train_correct", "train_seen"} <= state.keys(), sorted(state)  # written by this version
    del state["train_correct"], state["train_seen"]
    torch.save(state, path)
    before = path.read_bytes()
    (result,) = launch(trainer, cifar_dir, ["--resume", "--epochs", 3, "--checkpoint-dir", folder / "ck"])
    shown = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
    assert "Epoch = " not in result.stdout, shown
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, shown  # one rank says it; the other stops silently
    assert str(path) in errors[0] and "train_correct" in errors[0] and "train_seen" in errors[0], shown
    if trainer == "raw":  # mp.spawn's launcher exits as the ranks did
        assert result.returncode == 2, shown
        assert "Traceback" not in result.stderr, shown
    else:  # torchrun's agent (in accelerate launch) reports each rank's status, then raises ChildFailedError
        # Each rank exits 2 by itself, unless the agent, seeing the first one gone, ended it first (SIGTERM: -15)
        statuses = rank_exit_codes(result.stderr)
        assert set(statuses) <= {0, 1} and 2 in statuses.values(), shown  # torch 2.7's agent may list one
        assert set(statuses.values()) <= {2, -signal.SIGTERM} and result.returncode != 0, shown
        # the one traceback is the launcher's own; no rank printed one
        assert result.stderr.count("Traceback") == 1 and "raise ChildFailedError(" in result.stderr, shown
        assert 'accel_train.py", line' not in result.stderr, shown
    assert path.read_bytes() == before  # left as it was


@pytest.fixture(scope="module")
def stopped_early_runs(cifar_dir, tmp_path_factory) -> dict:
    """trainer -> a folder holding ck/ and log.jsonl of a run of up to 3 epochs that stopped early after epoch 1
    (--target-accuracy 0.01 --patience 1: met at once); its checkpoint says it finished. Both side by side."""
    flags = ["--epochs", 3, "--target-accuracy", 0.01, "--patience", 1]
    folders, results = runs_side_by_side(cifar_dir, tmp_path_factory, "stopped", *flags)
    for trainer, result in results.items():
        assert [int(n) for n in EPOCH_LINE.findall(result.stdout)] == [1], result.stdout
        assert last_line(result.stdout) == "Early stopping after epoch 1", result.stdout
        state = torch.load(training_state_file(folders[trainer] / "ck", trainer), weights_only=True)
        assert state["finished"] and state["epoch"] == 1, {k: state[k] for k in ("epoch", "step", "finished")}
    return folders


@pytest.mark.slow
@pytest.mark.xdist_group("resume_rules")
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_run_that_stopped_early_trains_on_under_a_stricter_rule(cifar_dir, tmp_path, stopped_early_runs, trainer):
    """The rule in force after the resume decides, also for a run that had finished. Resumed with --patience 2
    (epochs 2 and 3 left), the run says it trains on, trains epoch 2 (the rule, 2 epochs at 0.01, then holds) and
    stops early after it. Resumed under its own rule, or with --patience 2 and --epochs 1 (no epoch left), it
    trains nothing, says so, and ends with the course's last line under the rule in force; exit 0 each time.
    (The run once said "Nothing to do: that run had already finished" whatever the rule in force.)"""
    first = stopped_early_runs[trainer]
    _, logged = read_log(first / "log.jsonl")
    cases = {
        "stricter": ["--epochs", 3, "--patience", 2],
        "same rule": ["--epochs", 3, "--patience", 1],
        "no epoch left": ["--epochs", 1, "--patience", 2],
    }
    copies = {case: copy_run(first, tmp_path / case.replace(" ", "_")) for case in cases}
    results = launch(
        trainer,
        cifar_dir,
        *[
            ["--resume", "--target-accuracy", 0.01, *flags, "--checkpoint-dir", copies[case] / "ck"]
            + ["--log-json", copies[case] / "log.jsonl"]
            for case, flags in cases.items()
        ],
    )
    shown = {
        case: f"{case}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
        for case, result in zip(cases, results)
    }
    results = dict(zip(cases, results))
    for case, result in results.items():
        assert result.returncode == 0, shown[case]
        assert "Resuming from" in result.stdout and ": epoch 2, step 0" in result.stdout, shown[case]

    stricter = results["stricter"]
    assert "Nothing to do" not in stricter.stdout, shown["stricter"]
    assert (
        "That run had stopped early after epoch 1 (target_accuracy 0.01, patience 1); under the rule now in force "
        "(target_accuracy 0.01, patience 2) it trains on" in stricter.stdout
    ), shown["stricter"]
    assert [int(n) for n in EPOCH_LINE.findall(stricter.stdout)] == [2], shown["stricter"]
    assert last_line(stricter.stdout) == "Early stopping after epoch 2", shown["stricter"]
    _, epochs = read_log(copies["stricter"] / "log.jsonl")
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[0] == logged[0]

    finals = {
        "same rule": "Early stopping after epoch 1",
        "no epoch left": "Target accuracy 0.01 not reached 2 epochs in a row within 1 epochs",
    }
    for case, final in finals.items():
        result = results[case]
        assert "Nothing to do: that run had already finished" in result.stdout, shown[case]
        assert "Epoch = " not in result.stdout and last_line(result.stdout) == final, shown[case]
        _, epochs = read_log(copies[case] / "log.jsonl")
        assert epochs == logged, shown[case]  # nothing added or rewritten
