"""The epoch record is defined once (runlog.EPOCH_RECORD): the epoch line, the report's readers of a JSON log and of
printed lines, and TensorBoard's scalars all follow it; the run's objects are built once."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from cifar_wrn import runlog
from cifar_wrn.report.logs import EPOCH_FIELDS
from cifar_wrn.report.textlog import epoch_record
from cifar_wrn.run import Data, Process, Run
from cifar_wrn.watch import Watch

RECORD = dict(
    epoch=3,
    cumulative_time=12.5,
    epoch_time=4.25,
    images_per_sec=80.0,
    train_accuracy=0.5,
    train_correct=160,
    train_seen=320,
    val_loss=1.25,
    val_accuracy=0.625,
)


def test_the_epoch_line_prints_the_labelled_fields_in_the_record_s_order_and_the_report_reads_them_back():
    line = runlog.epoch_line(RECORD)
    assert line == (
        "Epoch =  3: Cumulative Time = 12.500, Epoch Time = 4.250, Images/sec = 80.0, Training Accuracy = 0.500, "
        "Validation Loss = 1.250, Validation Accuracy = 0.625"
    )
    number, rest = line.removeprefix("Epoch =  ").split(": ", 1)
    printed = {
        k: v for k, v in RECORD.items() if runlog.EPOCH_RECORD[[f.key for f in runlog.EPOCH_RECORD].index(k)].label
    }
    assert epoch_record("line 1", number, rest) == printed
    assert set(EPOCH_FIELDS) <= RECORD.keys() and "train_accuracy" not in EPOCH_FIELDS  # the course's first script


def test_a_new_field_is_one_entry_of_the_record(monkeypatch):
    """Adding the learning rate: one Field, and the line, the text reader and TensorBoard follow."""
    field = runlog.Field("lr", "Learning Rate", ".4f", tracked=True, required=False)
    monkeypatch.setattr(runlog, "EPOCH_RECORD", (*runlog.EPOCH_RECORD, field))
    assert runlog.epoch_line({**RECORD, "lr": 0.1}).endswith("Validation Accuracy = 0.625, Learning Rate = 0.1000")


def fake_watch(logged: list, tracked: list) -> Watch:
    watch = Watch.__new__(Watch)
    watch.profile, watch.extras = False, {}
    watch.log = SimpleNamespace(write=logged.append)
    watch.tracker = SimpleNamespace(log=lambda values, step: tracked.append((values, step)))
    watch.run = SimpleNamespace(is_main=True)
    return watch


def test_the_log_holds_the_record_tensorboard_its_tracked_fields_and_an_unknown_key_is_refused():
    logged, tracked = [], []
    watch = fake_watch(logged, tracked)
    watch.log_epoch(RECORD)
    assert logged == [{"kind": "epoch", **RECORD}]
    expected = {f.key for f in runlog.EPOCH_RECORD if f.tracked}
    assert tracked == [({k: RECORD[k] for k in expected}, 3)] and "val_accuracy" in expected
    with pytest.raises(ValueError, match="not in the epoch record: learning_rate"):
        watch.log_epoch({**RECORD, "learning_rate": 0.1})
    assert len(logged) == 1


def test_a_run_is_built_once_from_what_setup_and_build_data_returned():
    """No field left to fill later: the Run's objects are its constructor's arguments (the EMA may be None), its
    derived ones made in it; the Process and Data it holds cannot change."""
    required = [f.name for f in dataclasses.fields(Run) if f.init and f.default is dataclasses.MISSING]
    assert required == [
        "recipe",
        "process",
        "data",
        "model",
        "raw_model",
        "optimizer",
        "scheduler",
        "criterion",
    ]
    process = Process(0, 0, 1, torch.device("cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        process.rank = 1
    assert dataclasses.fields(Data) and Data.__dataclass_params__.frozen
    assert not [
        f.name for f in dataclasses.fields(Run) if not f.init and f.name not in ("optimizer_step", "recalibration")
    ]
