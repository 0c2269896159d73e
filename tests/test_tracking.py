"""--with-tracking: TensorBoard events of the course's epoch line and the training loss, the same tags from both
trainers (raw_ddp.py: a SummaryWriter on rank 0; accel_train.py: Accelerator(log_with="tensorboard")), read back
with TensorBoard's own reader; and one clear error where TensorBoard is not installed."""

import sys
from pathlib import Path

import pytest
from helpers import ACCEL_TINY, TINY, data_flags, run
from test_accel import CONFIGS, accel_env, accelerate_command

import raw_ddp
from cifar_wrn.errors import UserError
from cifar_wrn.raw_side import resolve_raw_launch
from cifar_wrn.runlog import read_log

EPOCH_TAGS = ("train_accuracy", "val_accuracy", "val_loss", "images_per_sec", "cumulative_time")


def scalars(folder: Path) -> dict:
    """{tag: [(step, value), ...]} of the one run TensorBoard finds under folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {path.parent for path in folder.rglob("events.out.tfevents.*")}
    reader = EventAccumulator(str(events))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw_ddp.py", "accel_train.py"])
def test_tracking_writes_the_epoch_lines_numbers_and_the_loss(trainer, cifar_dir, tmp_path):
    """2 processes, 2 epochs of 20 steps: each epoch's numbers at step = epoch, as the JSON log has them, and the
    mean training loss every 10 steps at the global step; in --project-dir/<the run log's folder>."""
    log = tmp_path / "run-1" / "log.jsonl"
    log.parent.mkdir()
    flags = [*data_flags(cifar_dir), "--epochs", 2, "--set", "batch_size=8", "--log-json", log]
    flags += ["--with-tracking", "--project-dir", tmp_path / "tb"]
    if trainer == "raw_ddp.py":
        result = run([sys.executable, "raw_ddp.py", "--num-gpus", 2, *TINY, *flags])
    else:
        result = run(accelerate_command(CONFIGS / "two_cpus.yaml", "--cpu", *ACCEL_TINY, *flags), env=accel_env())
    assert result.returncode == 0, result.stderr
    found = scalars(tmp_path / "tb")
    assert [path.name for path in (tmp_path / "tb").iterdir()] == ["run-1"]
    _, epochs = read_log(log)
    for tag in EPOCH_TAGS:
        assert [step for step, _ in found[tag]] == [e["epoch"] for e in epochs] == [1, 2]
        assert [value for _, value in found[tag]] == pytest.approx([e[tag] for e in epochs], rel=1e-6), tag
    assert [step for step, _ in found["train_loss"]] == [10, 20, 30, 40]
    assert all(0 < loss < 5 for _, loss in found["train_loss"])
    assert set(found) == {*EPOCH_TAGS, "train_loss"}


def test_tracking_without_tensorboard_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: find_spec finds nothing
    with pytest.raises(UserError, match=r"--with-tracking writes TensorBoard events: pip install tensorboard"):
        resolve_raw_launch(raw_ddp.parse_args(["--device", "cpu", "--with-tracking"]))


@pytest.mark.slow
def test_tracking_without_tensorboard_stops_before_any_process_starts(tmp_path):
    """Run as a user runs it, in an interpreter where TensorBoard cannot be imported: one line, exit 2."""
    hide = "import runpy, sys; sys.modules['tensorboard'] = None; sys.argv[0] = 'raw_ddp.py'; "
    code = hide + "runpy.run_path('raw_ddp.py', run_name='__main__')"
    result = run([sys.executable, "-c", code, "--device", "cpu", "--with-tracking", "--data-dir", tmp_path])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --with-tracking writes TensorBoard events: pip install tensorboard (or the extra: .[tensorboard])"
    ]


def test_tracking_goes_to_the_run_folders_place_and_help_survives_python_OO(monkeypatch):
    """--project-dir defaults to where the run folders go ($RUNS_DIR, else runs/), so that a run's events land in
    its own folder; under python -OO (no docstrings) the parser still builds, without the epilog."""
    from cifar_wrn.cli import launch_commands

    monkeypatch.setenv("RUNS_DIR", "/scratch/me/runs")
    assert raw_ddp.parse_args([]).project_dir == "/scratch/me/runs"
    monkeypatch.delenv("RUNS_DIR")
    assert raw_ddp.parse_args([]).project_dir == "runs"
    assert launch_commands(None) is None and launch_commands(raw_ddp.__doc__).startswith("commands:\n    # 1 node")
