"""--profile and --trace on a real 2-process CPU run."""

import re

import pytest
from checks import check_profile

from cifar_wrn.runlog import read_log


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [
        pytest.param("raw", marks=pytest.mark.xdist_group("torchrun_profile_run")),
        pytest.param("accel", marks=pytest.mark.xdist_group("bf16_profile_run")),
    ],
)
def test_profile_parts_add_up_to_the_epoch_and_trace_is_written(trainer, request):
    """2 processes, 2 epochs, --profile and --trace: conftest's torchrun_profile_run (raw_ddp.py started by
    torchrun) or bf16_profile_run (accel_train.py by accelerate launch). 2 epochs: parts not reset between epochs
    would exceed the second epoch's time."""
    result, out = request.getfixturevalue({"raw": "torchrun_profile_run", "accel": "bf16_profile_run"}[trainer])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"Profile of epoch \d \(rank 0\)", result.stdout)) == 2
    check_profile(out / "log.jsonl", out / "trace")
    assert all(p.stat().st_size > 1000 for p in (out / "trace").iterdir())


@pytest.mark.slow
@pytest.mark.xdist_group("two_process_run")
def test_no_profile_when_off(two_process_run):
    """conftest's shared run, without --profile."""
    result, out = two_process_run
    assert result.returncode == 0, result.stderr
    assert "Profile" not in result.stdout
    _, epochs = read_log(out / "log.jsonl")
    assert epochs and all("profile" not in e for e in epochs)
