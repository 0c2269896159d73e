"""The console commands pip installs (cifar-wrn-data, cifar-wrn-report), called in-process through the functions
pyproject.toml names, and the versions and the chip the run log's header records. The installed scripts
themselves run in tests/test_installed.py."""

import importlib
import json
import pickle
import platform
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision
from helpers import REPO, write_cifar

from cifar_wrn import cifar_files, runlog
from cifar_wrn.cli import Logging
from cifar_wrn.model import COURSE_WIDTH
from cifar_wrn.recipe import Recipe
from cifar_wrn.report import cli
from cifar_wrn.stopping import Progress


def scripts() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def entry(name: str):
    module, function = scripts()[name].split(":")
    return getattr(importlib.import_module(module), function)


def data(argv, capsys) -> tuple[int, str, str]:
    code = entry("cifar-wrn-data")(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(result, message: str) -> None:
    code, out, err = result
    assert code == 2 and out == "", result
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.fixture(scope="module")
def full_cifar(tmp_path_factory) -> Path:
    """CIFAR-10's sizes (5 x 10000 training, 10000 validation images), all zeros: quick to write."""
    folder = tmp_path_factory.mktemp("full") / cifar_files.FOLDER
    folder.mkdir()
    batch = {"data": np.zeros((10_000, 3072), np.uint8), "labels": [3] * 10_000}
    for name in cifar_files.TRAIN_FILES + cifar_files.VAL_FILES:
        (folder / name).write_bytes(pickle.dumps(batch))
    return folder.parent


def test_the_commands_are_the_report_and_the_data_functions():
    assert entry("cifar-wrn-report") is cli.main and entry("cifar-wrn-data") is cifar_files.main
    assert set(scripts()) == {"cifar-wrn-report", "cifar-wrn-data"}


@pytest.mark.parametrize("name", ["cifar-wrn-data", "cifar-wrn-report"])
def test_each_command_has_help_under_its_own_name(name, capsys):
    with pytest.raises(SystemExit) as stop:
        entry(name)(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith(f"usage: {name} "), out
    if name == "cifar-wrn-data":
        assert "{download,check} DIR" in out and cifar_files.OFFICIAL_URL in out and "CIFAR10_URL" in out


def test_the_data_check_accepts_a_whole_cifar10(full_cifar, capsys):
    code, out, err = data(["check", full_cifar], capsys)
    assert (code, err) == (0, "")
    assert out == f"ok: {full_cifar / cifar_files.FOLDER}: 50000 training and 10000 validation images\n"


def test_the_data_download_of_a_folder_that_holds_it_downloads_nothing(full_cifar, monkeypatch, capsys):
    monkeypatch.setenv("CIFAR10_URL", "http://127.0.0.1:9/nothing-listens-here.tar.gz")
    code, out, err = data(["download", full_cifar], capsys)
    assert (code, err) == (0, "") and out.startswith("ok: "), (out, err)


def test_the_data_check_refuses_a_folder_without_cifar10(tmp_path, capsys):
    assert_refused(data(["check", tmp_path], capsys), f"CIFAR-10 is not in {tmp_path / cifar_files.FOLDER}")


def test_the_data_check_refuses_a_subset_and_a_corrupt_file(tmp_path, capsys):
    write_cifar(tmp_path)  # the tests' 320 + 101 images: not CIFAR-10
    assert_refused(data(["check", tmp_path], capsys), "the train split has 320 images, expected 50000")
    (tmp_path / cifar_files.FOLDER / "data_batch_3").write_bytes(b"\x80\x04truncated")
    assert_refused(data(["check", tmp_path], capsys), "data_batch_3 cannot be read")


def test_a_failed_download_is_one_line(tmp_path, monkeypatch, capsys):
    url = (tmp_path / "no-such-archive.tar.gz").as_uri()
    monkeypatch.setenv("CIFAR10_URL", url)
    result = data(["download", tmp_path / "data"], capsys)
    assert_refused(result, f"download from {url} failed")


def test_the_data_command_refuses_an_unknown_action(capsys):
    with pytest.raises(SystemExit) as stop:
        data(["fetch", "data"], capsys)
    assert stop.value.code == 2 and "invalid choice: 'fetch'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the run log's header
def test_the_header_records_the_versions_and_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(runlog, "git_commit", lambda: "abc")
    sizes = lambda: dict(train_images=320, val_images=101, steps_per_epoch=10)
    run = SimpleNamespace(recipe=Recipe(), is_main=True, world_size=1, device=torch.device("cpu"))
    run.__dict__.update(global_batch_size=32, lr=0.1, data=SimpleNamespace(sizes=sizes), model_width=COURSE_WIDTH)
    run.raw_model, log = torch.nn.Linear(1, 1), tmp_path / "log.jsonl"
    launch = dict(num_nodes=1, num_gpus=1, backend="gloo", device="cpu", launcher="mp.spawn")
    runlog.open_run_log(run, Progress(), Logging(str(log)), **launch).close()
    header = json.loads(log.read_text())
    assert header["python_version"] == platform.python_version()
    assert header["torchvision_version"] == torchvision.__version__
    assert header["cuda_version"] == torch.version.cuda  # the build's (None on a CPU-only torch), GPU or not
    assert header["cudnn_version"] == torch.backends.cudnn.version()
    if not torch.cuda.is_available():
        assert header["nccl_version"] is None
    assert isinstance(header["device_name"], str) and header["device_name"].strip()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "model name" in cpuinfo.read_text():
        assert f": {header['device_name']}\n" in cpuinfo.read_text()  # the model, not just "x86_64"


def test_on_cuda_the_header_names_the_gpu_and_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"NVIDIA A30 ({device})")
    found = runlog.versions(torch.device("cuda", 1))
    assert (found["nccl_version"], found["device_name"]) == ("2.21.5", "NVIDIA A30 (cuda:1)")


def test_without_cpuinfo_the_header_names_the_machine(monkeypatch):
    monkeypatch.setattr(Path, "is_file", lambda self: False)
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert runlog.versions(None)["device_name"] == platform.machine()


def test_the_docs_data_commands_are_the_commands_actions():
    """Each `cifar-wrn-data ACTION` the README, docs and slurm/ comments give is one the command takes."""
    texts = [p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "slurm").glob("*")]]
    actions = [a for text in texts for a in re.findall(r"cifar-wrn-data (\S+)", text)]
    assert "download" in actions and set(actions) <= {"download", "check"}, actions
