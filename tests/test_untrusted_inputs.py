"""Files from shared storage must not run code, and the last bad inputs.

A crafted file here is one whose unpickling would call open(marker, "w"), as it could call anything: loading
must refuse it with a message naming the file, and the marker must not exist afterwards.
"""

import pickle
import re
import shutil
import struct
import sys

import pytest
import torch
from checks import checkpoint_keys, load_checkpoint, read_training_state
from helpers import (
    TINY,
    cpu_env,
    data_flags,
    raw_ddp,
    resume_flags,
    run,
    synthetic_batch,
    write_cifar,
)

from cifar_wrn.accel_side import TRAINING_STATE, resolve_accel_launch
from cifar_wrn.checkpoints import CheckpointError, file_digest, with_digest
from cifar_wrn.cifar_files import DataError, load_split
from cifar_wrn.raw_side import resolve_raw_launch

NOT_OURS = "is not a checkpoint this project wrote"


class RunsCode:
    """Unpickled by a full unpickler, this creates `marker`: what a crafted file could do with any code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


# The 2-process runs here use raw_ddp's default timeout (180 s): with 90 s a run that had printed its refusal was
# still shutting down when the timeout struck, on 2 cores loaded by several pytest workers.


def accel_train(*flags, timeout=180):
    """accel_train.py as one CPU process without a launcher (the file handling is the same as with 2)."""
    return run(
        [sys.executable, "accel_train.py", "--cpu", *flags],
        timeout=timeout,
        env={k: v for k, v in cpu_env().items() if not k.startswith("ACCELERATE_")},
    )


# ----------------------------------------------------------------------------- CIFAR-10 batch files


class Python2Pickler(pickle._Pickler):
    """What Python 2's cPickle wrote for the official files: protocol 2, byte strings as BINSTRING (read back
    as str with encoding="latin1"), numpy's functions under numpy.core."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_python2_str(self, obj):
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_python2_str

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)


@pytest.mark.parametrize("protocol", ["python2", 0, 2, 4, 5])
def test_batch_files_load_whatever_wrote_them(tmp_path, protocol):
    """The official files (Python 2), the offline copy (protocol 4) and copies others may write (0-5)."""
    write_cifar(tmp_path, per_train_file=4, val_images=4)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    batch = synthetic_batch(4, seed=7)
    if protocol == "python2":
        batch = {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": batch["labels"],
            b"data": batch["data"],
            b"filenames": [b"a.png", b"b.png", b"c.png", b"d.png"],
        }
        with open(path, "wb") as f:
            Python2Pickler(f, protocol=2).dump(batch)
        assert b"cnumpy.core.multiarray\n_reconstruct\n" in path.read_bytes()
    else:
        path.write_bytes(pickle.dumps(dict(batch, batch_label="testing batch 1 of 1"), protocol=protocol))
    images, labels = load_split(tmp_path, train=False, subset=4)
    assert torch.equal(images.reshape(4, -1), torch.from_numpy(synthetic_batch(4, seed=7)["data"]))
    assert labels.tolist() == synthetic_batch(4, seed=7)["labels"]


def crafted_batch(path, marker):
    with open(path, "wb") as f:
        pickle.dump({**synthetic_batch(4, seed=3), "batch_label": RunsCode(marker)}, f)


def test_crafted_batch_file_is_refused_and_runs_nothing(tmp_path):
    write_cifar(tmp_path, per_train_file=4, val_images=4)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    crafted_batch(path, tmp_path / "marker")
    with pytest.raises(DataError, match=f"{path} is not a CIFAR-10 batch file: it asks for io.open"):
        load_split(tmp_path, train=True, subset=8)
    assert not (tmp_path / "marker").exists()


BAD_LABELS = {
    "None": None,
    "a number": 3,
    "strings": ["cat"] * 4,
    "a string": "0123",
    "floats": [0.5] * 4,
    "nested lists": [[1]] * 4,
    "too few": [1, 2, 3],
}


@pytest.mark.parametrize("case", BAD_LABELS)
def test_malformed_labels_are_a_data_error_naming_the_file(tmp_path, case):
    """A DataError (what load_splits turns into the answer every rank shares), not a TypeError or ValueError."""
    write_cifar(tmp_path, per_train_file=4, val_images=4)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    with open(path, "wb") as f:
        pickle.dump({**synthetic_batch(4, seed=1), "labels": BAD_LABELS[case]}, f)
    with pytest.raises(DataError, match=re.escape(f"{path}: ")):
        load_split(tmp_path, train=True, subset=8)


@pytest.mark.slow
def test_training_refuses_a_crafted_batch_file(cifar_dir, tmp_path):
    shutil.copytree(cifar_dir, tmp_path / "d")
    path = tmp_path / "d" / "cifar-10-batches-py" / "data_batch_5"
    crafted_batch(path, tmp_path / "marker")
    result = raw_ddp("--num-gpus", 2, *TINY, *data_flags(tmp_path / "d"), "--dist-timeout", 30)
    assert result.returncode == 2, result.stderr
    assert f"{path} is not a CIFAR-10 batch file" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "marker").exists()


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_raw_resume_refuses_a_crafted_checkpoint(cifar_dir, tmp_path):
    path = tmp_path / "ck" / "checkpoint.pt"
    path.parent.mkdir()
    torch.save({"epoch": 1, "world_size": 2, "model_width": 4, "recipe": RunsCode(tmp_path / "marker")}, path)
    before = path.read_bytes()
    result = raw_ddp(
        "--num-gpus",
        2,
        *TINY,
        *data_flags(cifar_dir),
        "--dist-timeout",
        30,
        "--epochs",
        2,
        "--checkpoint-dir",
        path.parent,
        "--resume",
    )
    assert result.returncode == 2, result.stderr
    assert f"{path} {NOT_OURS}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "marker").exists()
    assert path.read_bytes() == before  # left as it was, for whoever looks into it


def test_checkpoint_files_are_read_as_data_only(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match=f"{NOT_OURS} \\(it holds a list, not a dict\\)"):
        load_checkpoint(tmp_path)
    torch.save({"epoch": 1}, path)
    with pytest.raises(CheckpointError, match="checkpoint.pt lacks step, "):
        load_checkpoint(tmp_path)
    torch.save({"epoch": RunsCode(tmp_path / "marker")}, tmp_path / TRAINING_STATE)
    with pytest.raises(CheckpointError, match=f"{TRAINING_STATE} {NOT_OURS} .*Unsupported global: GLOBAL io.open"):
        read_training_state(tmp_path)
    assert not (tmp_path / "marker").exists()


@pytest.fixture(scope="module")
def accel_checkpoint(cifar_dir, tmp_path_factory):
    """accel_train.py's checkpoint after epoch 1 of 2 (EMA on), and the 2-epoch run's final (EMA) weights."""
    out = tmp_path_factory.mktemp("accel_ck")
    common = [*data_flags(cifar_dir), "--model-width", 4, "--set", "eval_batch_size=64", "--set", "ema_decay=0.9"]
    straight = accel_train(*common, "--epochs", 2, "--save", out / "straight.pt")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = accel_train(*common, "--epochs", 1, "--checkpoint-dir", out / "ck")
    assert first.returncode == 0, first.stderr[-3000:]
    files = [p.name for p in (out / "ck" / "state-1").iterdir()]
    assert TRAINING_STATE in files and not any(name.startswith("custom_checkpoint") for name in files)
    return out / "ck", [*common, "--epochs", 2], out / "straight.pt"


def as_legacy(directory):
    """The folder as accel_train.py wrote it before training_state.pt: register_for_checkpointing's files."""
    folder = directory / (directory / "LATEST").read_text().strip()
    state = torch.load(folder / TRAINING_STATE)
    ema = state.pop("ema")
    torch.save(state, folder / "custom_checkpoint_0.pkl")
    torch.save(ema, folder / "custom_checkpoint_1.pkl")
    (folder / TRAINING_STATE).unlink()
    return folder


@pytest.mark.slow
@pytest.mark.xdist_group("test_untrusted_inputs.accel_checkpoint")
def test_accel_resume_with_ema_is_exact(accel_checkpoint, tmp_path):
    ck, flags, straight = accel_checkpoint
    shutil.copytree(ck, tmp_path / "ck")
    resumed = accel_train(*flags, "--checkpoint-dir", tmp_path / "ck", "--resume", "--save", tmp_path / "w.pt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and resumed.stdout.count("Epoch = ") == 1
    a, b = torch.load(straight), torch.load(tmp_path / "w.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the EMA weights, bitwise


@pytest.mark.slow
@pytest.mark.xdist_group("test_untrusted_inputs.accel_checkpoint")
@pytest.mark.parametrize("crafted", [None, "custom_checkpoint_0.pkl"])
def test_an_accel_folder_of_the_earlier_layout_is_refused_unread(accel_checkpoint, tmp_path, crafted):
    """A folder written before training_state.pt (register_for_checkpointing's custom_checkpoint_N.pkl, which
    Accelerate unpickles in full) is refused with one line; a crafted one runs nothing."""
    ck, flags, _ = accel_checkpoint
    shutil.copytree(ck, tmp_path / "ck")
    folder = as_legacy(tmp_path / "ck")
    if crafted:
        path = folder / crafted
        torch.save({**torch.load(path, weights_only=False), "extra": RunsCode(tmp_path / "marker")}, path)
    result = accel_train(*flags, "--checkpoint-dir", tmp_path / "ck", "--auto-resume")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{folder} was written by an earlier accel_train.py" in result.stderr
    assert 'accel_train.py", line' not in result.stderr and "Epoch = " not in result.stdout
    assert not (tmp_path / "marker").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("test_untrusted_inputs.accel_checkpoint")
@pytest.mark.parametrize("crafted", [TRAINING_STATE, "optimizer.bin", "random_states_0.pkl"])
def test_accel_resume_refuses_crafted_files(accel_checkpoint, tmp_path, crafted):
    """What accel_train.py reads: its own file, and what accelerator.load_state reads. Whoever can write the
    folder can also write the checksums training_state.pt holds for the other files: they are rewritten to match,
    so that weights-only loading, not the checksum, must refuse the crafted file."""
    ck, flags, _ = accel_checkpoint
    shutil.copytree(ck, tmp_path / "ck")
    folder = tmp_path / "ck" / (tmp_path / "ck" / "LATEST").read_text().strip()
    path = folder / crafted
    torch.save({**torch.load(path, weights_only=False), "extra": RunsCode(tmp_path / "marker")}, path)
    if crafted != TRAINING_STATE:
        state = torch.load(folder / TRAINING_STATE, weights_only=True)
        files = {p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.name != TRAINING_STATE}
        torch.save(with_digest({**state, "files": files}), folder / TRAINING_STATE)
    before = path.read_bytes()
    result = accel_train(*flags, "--checkpoint-dir", tmp_path / "ck", "--auto-resume")
    assert result.returncode == 2, result.stderr[-3000:]
    shown = path if crafted == TRAINING_STATE else folder
    assert f"{shown} {NOT_OURS}" in result.stderr and 'accel_train.py", line' not in result.stderr
    assert "Epoch = " not in result.stdout and not (tmp_path / "marker").exists()
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- nothing outside the folder


def victim_folder(tmp_path):
    """Somebody's folder outside the checkpoint folder, named like a checkpoint."""
    victim = tmp_path / "elsewhere" / "state-7"
    victim.mkdir(parents=True)
    (victim / "data").write_text("precious")
    return victim


def bad_latest(ck, victim, how):
    """DIR/LATEST (or what it names) leading outside DIR, as another account sharing the folder could make it."""
    ck.mkdir(exist_ok=True)
    if how == "absolute":
        (ck / "LATEST").write_text(f"{victim}\n")
    elif how == "dot-dot":
        (ck / "LATEST").write_text(f"../{victim.parent.name}/{victim.name}\n")
    elif how == "..":
        (ck / "LATEST").write_text("..\n")
    elif how == "symlinked folder":
        (ck / "state-7").symlink_to(victim)
        (ck / "LATEST").write_text("state-7\n")
    else:  # LATEST itself a link to a file that names a folder
        (victim.parent / "pointer").write_text("state-7\n")
        (ck / "LATEST").symlink_to(victim.parent / "pointer")


LATEST_CASES = ["absolute", "dot-dot", "..", "symlinked folder", "symlinked LATEST"]


@pytest.mark.parametrize("how", LATEST_CASES)
def test_latest_naming_anything_but_a_folder_of_dir_is_refused(tmp_path, how):
    from cifar_wrn.accel_side import latest_checkpoint, publish_checkpoint

    ck, victim = tmp_path / "ck", victim_folder(tmp_path)
    bad_latest(ck, victim, how)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(ck / 'LATEST'))} .*(refused|link)") as refused:
        latest_checkpoint(ck)
    assert "\n" not in str(refused.value)
    (ck / ".incomplete").mkdir()
    with pytest.raises(CheckpointError):
        publish_checkpoint(ck, ck / ".incomplete")  # once removed the "previous checkpoint" it named
    assert (victim / "data").read_text() == "precious" and (ck / ".incomplete").is_dir()


def test_temporary_files_never_follow_a_link(tmp_path):
    """Names another account could put in a shared folder beforehand, as links to somebody's file or folder."""
    import os

    from cifar_wrn.checkpoints import check_writable, save_atomic
    from cifar_wrn.safe_files import fresh_folder

    ck, victim = tmp_path / "ck", victim_folder(tmp_path)
    ck.mkdir()
    (ck / f".write-test-{os.getpid()}").symlink_to(victim / "data")  # the names these files once had
    (ck / f".checkpoint.pt.tmp-{os.getpid()}").symlink_to(victim / "data")
    (ck / ".incomplete").symlink_to(victim)
    check_writable(ck)
    save_atomic({"epoch": 1}, ck / "checkpoint.pt")
    fresh_folder(ck / ".incomplete")  # the link goes, a new empty folder takes its place
    assert (victim / "data").read_text() == "precious" and sorted(p.name for p in victim.iterdir()) == ["data"]
    assert (ck / ".incomplete").is_dir() and not (ck / ".incomplete").is_symlink()
    assert torch.load(ck / "checkpoint.pt") == {"epoch": 1}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["..", "absolute", "symlinked folder"])
def test_accel_run_never_touches_what_latest_names_outside_dir(cifar_dir, tmp_path, how):
    """From outside: a run that would save (and then remove "the previous checkpoint") or resume. `..` once
    raised IndexError on rank 0 alone, leaving the other rank waiting: 2 processes there, both stop."""
    from test_accel import CONFIGS, accelerate_launch

    ck, victim = tmp_path / "ck", victim_folder(tmp_path)
    bad_latest(ck, victim, how)
    common = [
        *data_flags(cifar_dir),
        "--model-width",
        4,
        "--set",
        "eval_batch_size=64",
        "--epochs",
        1,
        "--checkpoint-dir",
        ck,
    ]
    if how == "..":
        result = accelerate_launch(CONFIGS / "two_cpus.yaml", "--cpu", *common, "--dist-timeout", 300)
    else:
        result = accel_train(*common, *(["--auto-resume"] if how == "absolute" else []))
    # 180 s: start-up under 4 loaded workers; a rank left waiting would take --dist-timeout (300 s) more
    assert result.returncode != 0 and result.seconds < 180, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{ck / 'LATEST'} " in errors[0] and "refused" in errors[0], result.stderr[-3000:]
    assert 'accel_train.py", line' not in result.stderr and "lost contact" not in result.stderr
    assert (victim / "data").read_text() == "precious" and sorted(p.name for p in victim.iterdir()) == ["data"]


# ----------------------------------------------------------------------------- a part one rank cannot load


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
def test_raw_checkpoint_without_rank_1s_random_state_stops_every_rank(cifar_dir, tmp_path, resume_runs):
    """Any real 2-process checkpoint will do: a copy of conftest's resume_runs (raw_ddp.py after epoch 1), resumed
    with the flags it was written with (resume_flags), so that only rank 1's missing part can stop the run."""
    ck = resume_runs.copy("raw/ck", tmp_path)
    state = torch.load(ck / "checkpoint.pt")
    # data only, its checksum made to match, but rank 1's part is gone
    torch.save(with_digest({**state, "rng": state["rng"][:1]}), ck / "checkpoint.pt")
    result = raw_ddp("--num-gpus", 2, *resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--resume"))
    assert result.returncode == 2, result.stderr[-3000:]
    expected = "error: cannot resume from {}: rank 1: its part of the checkpoint was found but cannot be loaded into "
    expected = expected.format(ck / "checkpoint.pt") + "this run (IndexError"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), result.stderr[-3000:]  # said once, by rank 0
    assert "Traceback" not in result.stderr and "Epoch = " not in result.stdout


def fake_random_states(path, cuda: bool):
    import random

    import numpy as np

    states = {
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    torch.save({**states, **({"torch_cuda_manual_seed": [torch.zeros(16, dtype=torch.uint8)]} if cuda else {})}, path)


def test_a_checkpoint_of_another_device_type_is_refused_clearly(tmp_path):
    """A CPU checkpoint resumed on a GPU (or the reverse) once ended in a traceback from set_rng_state (raw) or
    silently skipped the random states (accel). No GPU is needed to see the message: it comes first."""
    from types import SimpleNamespace

    from cifar_wrn.accel_side import AccelCheckpointer
    from cifar_wrn.raw_side import RawCheckpointer

    def restore_accel(accelerator, folder, state, device_type, ema, generator):
        run = SimpleNamespace(
            process=SimpleNamespace(accelerator=accelerator),
            device=torch.device(device_type),
            ema=ema,
            data=SimpleNamespace(generator=generator),
        )
        AccelCheckpointer(None).restore(run, folder, state)

    restore_raw = lambda checkpoint, run: RawCheckpointer(None).restore(run, "the checkpoint", checkpoint)

    cpu_written = {"rng": [{"torch": torch.get_rng_state(), "cuda": None, "pipeline": None}]}
    gpu_written = {
        "rng": [{"torch": torch.get_rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8), "pipeline": None}]
    }
    for checkpoint, saved, running in ((cpu_written, "cpu", "cuda"), (gpu_written, "cuda", "cpu")):
        with pytest.raises(
            CheckpointError,
            match=f"written by a run on {saved}, this run is on {running}: its random states.* do not carry over",
        ):
            restore_raw(
                checkpoint,
                SimpleNamespace(
                    rank=0,
                    device=torch.device(running),
                    raw_model=None,
                    eval_model=None,
                    data=SimpleNamespace(train_set=None),
                ),
            )
    accelerator = SimpleNamespace(process_index=0)
    fake_random_states(tmp_path / "random_states_0.pkl", cuda=False)
    with pytest.raises(CheckpointError, match="written by a run on cpu, this run is on cuda"):
        restore_accel(accelerator, tmp_path, {"device": "cpu"}, "cuda", None, None)
    # a folder from before "device" was kept is refused, not read as if written on this device
    torch.save({key: None for key in checkpoint_keys("accel") if key != "device"}, tmp_path / TRAINING_STATE)
    with pytest.raises(CheckpointError, match=f"{TRAINING_STATE} lacks device: an earlier version wrote it"):
        read_training_state(tmp_path)
    fake_random_states(tmp_path / "random_states_0.pkl", cuda=True)
    with pytest.raises(CheckpointError, match="written by a run on cuda, this run is on cpu"):
        restore_accel(accelerator, tmp_path, {"device": "cuda"}, "cpu", None, None)
    (tmp_path / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointError, match="random_states_0.pkl is missing"):
        restore_accel(accelerator, tmp_path, {"device": "cpu"}, "cpu", None, None)


# ----------------------------------------------------------------------------- bad inputs, before any process

BAD_INPUTS = {
    "label_smoothing": (["--set", "label_smoothing=1.5"], r"label_smoothing must be in \[0, 1\) \(got 1.5\)"),
    "momentum": (["--set", "momentum=2"], r"momentum must be in \[0, 1\) \(got 2.0\)"),
    "binary recipe": (["--recipe", "{binary}"], r"{binary}: not a text file \(byte 0 is not UTF-8\)"),
    "warmup": (
        ["--recipe", "fast", "--set", "warmup_epochs=3", "--epochs", "2"],
        r"warmup_epochs 3 is longer than epochs 2: the learning rate would still be rising when training "
        r"ends, at 67% of its peak",
    ),
}


def bad_input(tmp_path, case):
    binary = tmp_path / "recipe.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    flags, message = BAD_INPUTS[case]
    return [f.format(binary=binary) for f in flags], message.format(binary=re.escape(str(binary)))


@pytest.mark.parametrize("entry", ["raw_ddp", "accel_train"])
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_are_refused_when_the_flags_are_read(tmp_path, monkeypatch, entry, case):
    """resolve() runs before raw_ddp.py spawns its ranks, and in accel_train.py before Accelerator() joins them."""
    import importlib

    from cifar_wrn.errors import UserError

    for key in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "ACCELERATE_MIXED_PRECISION",
    ):
        monkeypatch.delenv(key, raising=False)
    module = importlib.import_module(entry)
    flags, message = bad_input(tmp_path, case)
    launch = ["--device", "cpu"] if entry == "raw_ddp" else ["--cpu"]
    with pytest.raises(UserError, match=message) as refused:
        resolve = resolve_raw_launch if entry == "raw_ddp" else resolve_accel_launch
        resolve(module.parse_args([*launch, *flags]))
    assert "\n" not in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["raw_ddp.py", "accel_train.py"])
def test_bad_input_is_one_error_line_and_status_2(tmp_path, entry):
    flags, message = bad_input(tmp_path, "binary recipe")
    launch = ["--device", "cpu"] if entry == "raw_ddp.py" else ["--cpu"]
    result = run([sys.executable, entry, *launch, *flags])
    assert result.returncode == 2 and result.stdout == ""
    assert re.fullmatch("error: " + message + ".*", result.stderr.strip()), result.stderr
