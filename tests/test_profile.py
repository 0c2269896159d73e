"""--profile and --trace on a real 2-process CPU run."""
import re

from cifar_wrn.runlog import read_log
from conftest import check_profile, TINY, TRAIN_IMAGES, VAL_IMAGES, raw_ddp as run_raw


def test_profile_parts_add_up_to_the_epoch_and_trace_is_written(cifar_dir, tmp_path):
    result = run_raw("--num-gpus", 2, *TINY, "--model-width", 8, "--data-dir", cifar_dir, "--train-subset",
                     TRAIN_IMAGES, "--val-subset", VAL_IMAGES, "--epochs", 2, "--profile", "--trace", tmp_path / "trace",
                     "--log-json", tmp_path / "log.jsonl")
    assert result.returncode == 0, result.stderr
    assert len(re.findall(r"Profile of epoch \d \(rank 0\)", result.stdout)) == 2
    check_profile(tmp_path / "log.jsonl", tmp_path / "trace")
    assert all(p.stat().st_size > 1000 for p in (tmp_path / "trace").iterdir())


def test_no_profile_when_off(two_process_run):
    """conftest's shared run, without --profile."""
    result, out = two_process_run
    assert result.returncode == 0, result.stderr
    assert "Profile" not in result.stdout
    _, epochs = read_log(out / "log.jsonl")
    assert epochs and all("profile" not in e for e in epochs)
