"""What a --checkpoint-dir may hold when a run resumes from it: the other trainer's checkpoint, a LATEST naming a
missing state folder, a changed byte in a weight, a checkpoint without a checksum. Each is refused before anything
trains, with one error line saying what the folder or file holds, exit status 2, and nothing in the folder is
written or removed (docs/reliability.md, "What a resume refuses").

The runs here are one CPU process each (the checks are the same on every rank; tests/test_resume_rules.py counts a
2-process refusal's error lines) on 64 training and 32 validation images.
"""

import os
import shutil
import struct
import sys
import zipfile

import pytest
import torch
from checks import checkpoint_keys, load_checkpoint, read_training_state
from helpers import TINY, cpu_env, data_flags, finish, start

from cifar_wrn.accel_side import TRAINING_STATE
from cifar_wrn.checkpoints import CheckpointError

TIMEOUT = 180  # seconds per launch (several side by side on a loaded machine); then every process is killed
TRAINERS = ["raw", "accel"]


def command(trainer: str, data_dir, *extra) -> list:
    """One CPU process of `trainer`'s tiny model on 64 + 32 images of `data_dir`, then `extra`."""
    small = data_flags(data_dir, 64, 32)
    if trainer == "raw":
        return [sys.executable, "raw_ddp.py", "--num-gpus", 1, *TINY, *small, *extra]
    return [
        sys.executable,
        "accel_train.py",
        "--cpu",
        "--model-width",
        4,
        "--set",
        "eval_batch_size=64",
        *small,
        *extra,
    ]


def env(trainer: str) -> dict:
    """cpu_env; for accel_train.py without the caller's ACCELERATE_* variables (they change how it starts)."""
    return {k: v for k, v in cpu_env().items() if trainer == "raw" or not k.startswith("ACCELERATE_")}


def launch(*runs: tuple) -> list:
    """Each of `runs` (trainer, data_dir, *flags) started at once, side by side; their results, in order."""
    procs = [start(command(trainer, data_dir, *flags), env=env(trainer)) for trainer, data_dir, *flags in runs]
    return [finish(proc, TIMEOUT) for proc in procs]


def snapshot(folder) -> dict:
    """Every name under `folder` (hidden ones too) -> its bytes, a link's target, or "folder"; but the .lock that
    a run holding the folder writes (its pid and host)."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            if key == ".lock":
                continue
            if os.path.islink(path):
                seen[key] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                seen[key] = "folder"
            else:
                with open(path, "rb") as f:
                    seen[key] = f.read()
    return seen


def error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------- what the folder holds


def accel_folder(ck):
    """What accel_train.py leaves: LATEST naming state-2, and state-2/ (its files' contents do not matter)."""
    (ck / "state-2").mkdir(parents=True)
    (ck / "state-2" / "model.safetensors").write_bytes(b"weights")
    (ck / "state-2" / TRAINING_STATE).write_bytes(b"progress")
    (ck / "LATEST").write_text("state-2\n")


def raw_folder(ck):
    """What raw_ddp.py leaves: checkpoint.pt (its contents do not matter)."""
    ck.mkdir(parents=True)
    (ck / "checkpoint.pt").write_bytes(b"weights")


def dangling_latest(ck):
    """accel_train.py's folder whose state-2/ is gone (removed, or not copied with LATEST)."""
    ck.mkdir(parents=True)
    (ck / "LATEST").write_text("state-2\n")


FOLDERS = {  # case -> (trainer, how the folder is made, what the one error line must say)
    "raw in accel's folder": ("raw", accel_folder, "{ck} holds accel_train.py's checkpoint (LATEST, state-2)"),
    "accel in raw's folder": ("accel", raw_folder, "{ck} holds raw_ddp.py's checkpoint (checkpoint.pt)"),
    "LATEST names a missing folder": ("accel", dangling_latest, "{ck}/LATEST names state-2, which is missing"),
}


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint_folders")
@pytest.mark.parametrize("flag", ["--auto-resume", "--resume"])
@pytest.mark.parametrize("case", FOLDERS)
def test_a_folder_this_trainer_cannot_resume_from_is_refused_untouched(cifar_dir, tmp_path, case, flag):
    """--auto-resume once started afresh beside the other trainer's checkpoint (or overwrote a LATEST naming a
    missing folder), and --resume said "no checkpoint": a folder reused by hand (CHECKPOINT_DIR=... in
    docs/slurm.md) must not silently restart. One error line says what the folder holds; exit 2; nothing but its
    lock is written to the folder or removed from it; nothing trains."""
    trainer, make, message = FOLDERS[case]
    ck = tmp_path / "ck"
    make(ck)
    before = snapshot(ck)
    (result,) = launch((trainer, cifar_dir, "--epochs", 1, "--checkpoint-dir", ck, flag))
    shown = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
    errors = error_lines(result.stderr)
    assert result.returncode == 2 and len(errors) == 1, shown
    assert message.format(ck=ck) in errors[0], shown
    assert "Epoch = " not in result.stdout and "Traceback" not in result.stderr, shown
    assert snapshot(ck) == before


# ----------------------------------------------------------------------------- a changed byte


@pytest.fixture(scope="module")
def one_epoch_checkpoints(cifar_dir, tmp_path_factory) -> dict:
    """trainer -> the checkpoint folder of a 1-epoch run (of 2 resumable); both trainers side by side."""
    folders = {trainer: tmp_path_factory.mktemp(f"one_epoch_{trainer}") / "ck" for trainer in TRAINERS}
    results = launch(*[(trainer, cifar_dir, "--epochs", 1, "--checkpoint-dir", ck) for trainer, ck in folders.items()])
    for trainer, result in zip(folders, results):
        assert result.returncode == 0, f"{trainer}:\n{result.stdout}\n{result.stderr[-3000:]}"
    return folders


def flip_a_weight_byte(path) -> str:
    """One bit of one byte in the middle of the largest tensor `path` holds (raw_ddp.py's checkpoint.pt: a zip
    of torch.save; Accelerate's model.safetensors); the file still loads. Returns the changed tensor's name."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".safetensors":  # 8 bytes: the header's length; the header; then the tensors' bytes
        (header,) = struct.unpack("<Q", data[:8])
        offset = 8 + header + (len(data) - 8 - header) // 2
    else:  # torch.save's zip: each storage an uncompressed record archive/data/<n>
        record = max((i for i in zipfile.ZipFile(path).infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26 : record.header_offset + 30])
        offset = record.header_offset + 30 + name_length + extra_length + record.file_size // 2
    before = load_weights(path)
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    after = load_weights(path)  # loads as it did: only a checksum can tell
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == 1, changed
    return changed[0]


def load_weights(path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return {name: tensor.clone() for name, tensor in load_file(path).items()}  # not a view of the mapped file
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {**state["model"], **{f"momentum {k}": v["momentum_buffer"] for k, v in state["optimizer"]["state"].items()}}


def weights_file(ck, trainer: str):
    if trainer == "raw":
        return ck / "checkpoint.pt"
    return ck / (ck / "LATEST").read_text().strip() / "model.safetensors"


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint_folders")
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_changed_byte_in_a_weight_is_refused(cifar_dir, tmp_path, one_epoch_checkpoints, trainer):
    """One flipped bit in the middle of a tensor loads with weights_only=True; the resume once went on with the
    changed weight. Now the checksum the checkpoint carries refuses it: one error line naming the file, exit 2,
    nothing trains, the file left as it is. The intact copy, resumed side by side, trains epoch 2."""
    damaged = shutil.copytree(one_epoch_checkpoints[trainer], tmp_path / "damaged")
    intact = shutil.copytree(one_epoch_checkpoints[trainer], tmp_path / "intact")
    path = weights_file(damaged, trainer)
    flip_a_weight_byte(path)
    before = snapshot(damaged)
    bad, good = launch(
        *[(trainer, cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--resume") for ck in (damaged, intact)]
    )
    shown = f"stdout:\n{bad.stdout}\nstderr:\n{bad.stderr[-3000:]}"
    errors = error_lines(bad.stderr)
    assert bad.returncode == 2 and len(errors) == 1, shown
    assert str(path) in errors[0] and "checksum" in errors[0], shown
    assert "Epoch = " not in bad.stdout and "Traceback" not in bad.stderr, shown
    assert snapshot(damaged) == before
    assert good.returncode == 0 and good.stdout.count("Epoch = ") == 1, good.stderr[-3000:]


# ----------------------------------------------------------------------------- without processes


def test_a_checkpoint_without_a_checksum_is_refused_as_an_earlier_versions(tmp_path):
    """Written before checkpoints carried their checksum: refused like any checkpoint of an earlier version."""
    torch.save({key: 0 for key in checkpoint_keys("raw") if key != "digest"}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="checkpoint.pt lacks digest: an earlier version wrote it"):
        load_checkpoint(tmp_path)
    torch.save({key: 0 for key in checkpoint_keys("accel") if key != "digest"}, tmp_path / TRAINING_STATE)
    with pytest.raises(CheckpointError, match=f"{TRAINING_STATE} lacks digest: an earlier version wrote it"):
        read_training_state(tmp_path)


def test_the_checksum_is_the_same_after_a_save_and_a_load_and_sees_one_bit(tmp_path):
    """What a checkpoint holds, hashed value by value: a save and a load do not change it (views sharing a storage,
    bfloat16, 0-d tensors, ints, floats, None, nested containers); one changed bit, a key, a type does."""
    from cifar_wrn.checkpoints import digest_of

    base = torch.arange(12, dtype=torch.float32)
    state = {
        "model": {"w": base.view(3, 4), "first row": base[:4], "b": torch.ones(2, dtype=torch.bfloat16)},
        "step": torch.tensor(7),
        "history": [{"val_accuracy": 0.1, "epoch": 1}],
        "rng": [{"torch": torch.get_rng_state(), "cuda": None}],
        "pair": (1, 2.5, "x", True),
    }
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    assert digest_of(loaded) == digest_of(state)
    flipped = torch.load(tmp_path / "s.pt", weights_only=True)
    flipped["model"]["b"].view(torch.int16)[1] ^= 1  # one bit of a bfloat16
    assert digest_of(flipped) != digest_of(state)
    for changed in ({**state, "pair": [1, 2.5, "x", True]}, {**state, "step ": state["step"]}, {**state, "x": 1}):
        assert digest_of(changed) != digest_of(state)
    assert digest_of({**state, "digest": "anything"}) == digest_of(state)  # the key that holds it is not hashed
