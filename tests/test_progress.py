"""Progress bars (cifar_wrn/bars.py, --progress).

Unit tests of the bars: the loss is read from the device only at the trainers' agreement steps, a hidden bar
writes and touches nothing. Then both trainers as users run them, 2 gloo CPU processes, tiny models, one epoch
of 5 steps: with stderr on a pseudo-terminal the bar is drawn there (carriage returns, the step counter, the
validation bar); with stdout and stderr in files (a Slurm output file, a CI log) or pipes there is not one
carriage return, and the epoch lines are the same as in the terminal run (times aside: the validation metrics
to the digit, so the bar does not change training either).
"""

import argparse
import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from subprocess import DEVNULL, PIPE

import pytest
import torch
from helpers import EPOCH_LINE, REPO, TINY, VAL_IMAGES, cpu_env, data_flags, kill_all
from test_accel import CONFIGS, accel_env, accelerate_command, reliability_flags
from torch.utils.data import BatchSampler, DataLoader

import accel_train
import raw_ddp
from cifar_wrn import bars
from cifar_wrn.cifar_files import load_split
from cifar_wrn.cli import add_training_flags, settings_from, show_progress
from cifar_wrn.datasets import CIFAR10, DeviceBatches
from cifar_wrn.evaluation import evaluate
from cifar_wrn.model import WideResNet

TIMEOUT = 240  # seconds per run; every process it started is killed after that (helpers.kill_all)
STEPS = 5  # 320 training images, 32 per process, 2 processes


# ----------------------------------------------------------------------------- the bars, in this process


class Spy(torch.Tensor):
    """A loss tensor that records every torch operation on it and on what is computed from it."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


# What a per-step call may do with the loss: queue work on its device. Anything else (item, __bool__,
# __float__, tolist, cpu, ...) makes the host wait for the device.
ASYNC = {"detach", "float", "clone", "add_"}


@pytest.mark.parametrize("start_step", [0, 7])
def test_loss_is_read_only_at_the_agreement_steps(start_step, capsys):
    """25 steps (resumed at 7): the loss is read at steps 10, 20 and 25, as the trainers' step agreement, and
    the bar shows the mean of the losses since the previous read."""
    bar = bars.EpochBar(True, 3, 25, start_step=start_step, images_per_step=64)
    reads = []
    for step in range(start_step, 25):
        Spy.calls.clear()
        bar.step(torch.tensor(float(step)).as_subclass(Spy))
        assert set(Spy.calls) - {"item"} <= ASYNC, Spy.calls
        if "item" in Spy.calls:
            assert Spy.calls.count("item") == 1
            reads.append((step + 1, bar._bar.postfix))
    bar.close()
    first = (start_step, 9)  # the losses (= step indices) of the first window: steps start_step + 1 ... 10
    assert reads == [
        (10, f"loss={sum(range(first[0], first[1] + 1)) / (first[1] - first[0] + 1):.3f}"),
        (20, f"loss={sum(range(10, 20)) / 10:.3f}"),
        (25, f"loss={sum(range(20, 25)) / 5:.3f}"),
    ]
    err = capsys.readouterr().err
    assert "epoch 3" in err and f"{start_step}/25" in err and "25/25" in err and "img/s" in err
    assert "loss=22.000" in err and "\r" in err


def test_tracking_without_a_bar_reads_the_loss_only_at_the_agreement_steps(capsys):
    """--with-tracking and no bar (a batch job): the mean loss goes to the tracker at the steps the bar would read
    it, at its global step (epoch 3 of 25 steps, resumed at step 7: 50 + 10, 50 + 20, 50 + 25); nothing is drawn."""
    tracked = []
    bar = bars.EpochBar(False, 3, 25, start_step=7, track=lambda values, step: tracked.append((step, values)))
    for step in range(7, 25):
        Spy.calls.clear()
        bar.step(torch.tensor(float(step)).as_subclass(Spy))
        assert set(Spy.calls) - {"item"} <= ASYNC and Spy.calls.count("item") == (step + 1 in (10, 20, 25))
    bar.close()
    means = [sum(range(7, 10)) / 3, sum(range(10, 20)) / 10, sum(range(20, 25)) / 5]
    assert tracked == [(60, {"train_loss": means[0]}), (70, {"train_loss": means[1]}), (75, {"train_loss": means[2]})]
    assert capsys.readouterr() == ("", "")


def test_hidden_bars_write_nothing_and_touch_nothing(capsys):
    bar = bars.EpochBar(False, 1, 25, images_per_step=64)
    Spy.calls.clear()
    for _ in range(25):
        bar.step(torch.tensor(1.0).as_subclass(Spy))
    bar.close()
    bar.close()
    assert Spy.calls == []
    loader = [1, 2, 3]
    assert bars.validation_bar(False, loader) is loader  # not even wrapped
    assert capsys.readouterr() == ("", "")


def test_bars_go_to_stderr_and_erase_themselves(capsys):
    bar = bars.EpochBar(True, 1, 3, images_per_step=64)
    for _ in range(3):
        bar.step(torch.tensor(2.0))
    bar.close()
    assert list(bars.validation_bar(True, range(4))) == [0, 1, 2, 3]
    out, err = capsys.readouterr()
    assert out == ""
    assert "epoch 1" in err and "3/3" in err and "loss=2.000" in err and "validation" in err
    assert err.endswith("\r")  # leave=False: the last thing written blanks the line and returns to its start


def test_close_all_erases_the_bars_an_error_left(capsys):
    bar = bars.EpochBar(True, 1, 10)
    bar.step(torch.tensor(1.0))  # ... and then the step loop raised
    bars.close_all()
    assert bar._bar.disable  # closed
    assert capsys.readouterr().err.endswith("\r")


def test_a_terminal_without_a_size_still_gets_a_bar(monkeypatch):
    """A pseudo-terminal nobody sized (0 rows, 0 columns; what `script -c` gives): tqdm would take the width as
    -1 and draw nothing; the bars are drawn DEFAULT_COLUMNS wide instead."""
    controller, terminal = pty.openpty()
    assert struct.unpack("HHHH", fcntl.ioctl(terminal, termios.TIOCGWINSZ, b"\0" * 8))[:2] == (0, 0)
    received = []

    def read():  # concurrently: a pty's buffer is small, and a writer blocks when it is full
        while True:
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's side is closed and everything written was read
                return
            received.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    with open(terminal, "w") as stream, monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", stream)
        bar = bars.EpochBar(True, 1, 4, images_per_step=64)
        for _ in range(4):
            bar.step(torch.tensor(2.0))
        bar.close()
        assert list(bars.validation_bar(True, range(3))) == [0, 1, 2]
    reader.join(timeout=30)
    os.close(controller)
    drawn = b"".join(received).decode()
    lines = [line for line in re.split(r"[\r\n]+", drawn) if line.strip()]
    assert any(line.startswith("epoch 1: 100%|") and "4/4" in line and "loss=2.000" in line for line in lines), drawn
    assert any(re.match(r"validation: +\d+%\|.*\| \d/3 \[", line) for line in lines), drawn
    assert {len(line) for line in lines} == {bars.DEFAULT_COLUMNS}, drawn  # every bar drawn that wide


class FakeStderr(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize(
    "flags, terminal, is_main, shown",
    [
        ([], True, True, True),  # auto: a terminal
        ([], False, True, False),  # auto: a file or a pipe
        ([], True, False, False),  # never on the other ranks
        (["--progress", "on"], False, True, True),  # asked for
        (["--progress", "on"], True, False, False),
        (["--progress", "off"], True, True, False),  # refused
    ],
)
@pytest.mark.parametrize("trainer", [raw_ddp, accel_train])
def test_show_progress(trainer, flags, terminal, is_main, shown, monkeypatch):
    """The trainer's own command line, through cli.settings_from (the Settings the trainers pass), decides."""
    settings = settings_from(trainer.parse_args(flags))
    monkeypatch.setattr(sys, "stderr", FakeStderr(terminal))
    assert show_progress(settings, is_main) is shown


def test_progress_flag_refuses_other_values(capsys):
    parser = argparse.ArgumentParser()
    add_training_flags(parser, parser)  # the launch group: the parser itself here
    with pytest.raises(SystemExit):
        parser.parse_args(["--progress", "yes"])
    assert "invalid choice" in capsys.readouterr().err


def test_evaluate_through_a_validation_bar(cifar_dir, capsys):
    """evaluate() takes the bar in place of the loader, with both pipelines' loaders, and sums the same."""
    images, labels = load_split(cifar_dir, train=False, subset=VAL_IMAGES)
    torch.manual_seed(0)
    model = WideResNet(width=4)
    mask = torch.ones(VAL_IMAGES, dtype=torch.bool)
    cpu = torch.device("cpu")
    loaders = [
        DataLoader(CIFAR10(images, labels, augment=False), batch_size=16),
        DataLoader(
            DeviceBatches(images, labels, "cpu", augment=False),
            batch_size=None,
            sampler=BatchSampler(range(VAL_IMAGES), 16, drop_last=False),
        ),
    ]
    for loader in loaders:
        expected = evaluate(model, loader, mask, cpu)
        assert torch.equal(evaluate(model, bars.validation_bar(True, loader), mask, cpu), expected)
        assert expected[2] == VAL_IMAGES
    assert "validation" in capsys.readouterr().err


# ----------------------------------------------------------------------------- both trainers, end to end


def raw_command(data_dir, *flags):
    return [
        sys.executable,
        "raw_ddp.py",
        "--num-nodes",
        1,
        "--node-id",
        0,
        "--num-gpus",
        2,
        *TINY,
        "--dist-timeout",
        60,
        *data_flags(data_dir),
        "--epochs",
        1,
        *flags,
    ]


def accel_command(data_dir, *flags):
    return accelerate_command(CONFIGS / "two_cpus.yaml", *reliability_flags(data_dir, "--epochs", 1, *flags))


TRAINERS = {"raw_ddp": (raw_command, cpu_env), "accel_train": (accel_command, accel_env)}


def run_in_terminal(cmd, env) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (100 columns) and stdout on a pipe, as `python raw_ddp.py ... | tee`
    in a terminal has them. Returns the exit status, stdout, and everything written to the terminal."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    attributes = termios.tcgetattr(terminal)
    attributes[1] &= ~termios.OPOST  # no "\n" -> "\r\n": every carriage return read back was written by the run
    termios.tcsetattr(terminal, termios.TCSANOW, attributes)
    proc = subprocess.Popen(
        list(map(str, cmd)), cwd=REPO, env=env, stdin=DEVNULL, stdout=PIPE, stderr=terminal, start_new_session=True
    )
    os.close(terminal)
    out_fd = proc.stdout.fileno()
    received = {controller: [], out_fd: []}
    open_fds = set(received)
    deadline = time.monotonic() + TIMEOUT
    try:
        while open_fds:
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {TIMEOUT} s (every process killed): {' '.join(map(str, cmd))}")
            for fd in select.select(list(open_fds), [], [], 1.0)[0]:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every process holding the terminal has exited
                    data = b""
                if data:
                    received[fd].append(data)
                else:
                    open_fds.discard(fd)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            kill_all(proc)
            proc.wait()
        os.close(controller)
        proc.stdout.close()
    text = {fd: b"".join(data).decode(errors="replace") for fd, data in received.items()}
    return proc.returncode, text[out_fd], text[controller]


def run_to_files(cmd, env, folder) -> tuple[int, str, str]:
    """Run with stdout and stderr in files, as a Slurm job or a CI log has them."""
    with open(folder / "out.txt", "w") as out, open(folder / "err.txt", "w") as err:
        proc = subprocess.Popen(
            list(map(str, cmd)), cwd=REPO, env=env, stdin=DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_all(proc)
            proc.wait()
            pytest.fail(f"timed out after {TIMEOUT} s (every process killed): {' '.join(map(str, cmd))}")
    # Bytes: read_text() would turn every "\r" into "\n" (universal newlines) and hide what is looked for.
    return proc.returncode, *((folder / name).read_bytes().decode() for name in ("out.txt", "err.txt"))


def without_times(stdout: str) -> str:
    """stdout less what differs between two runs alike: the times, and the run folder named by its start."""
    stdout = re.sub(r"Run log: \S+", "Run log: *", stdout)
    return re.sub(r"(Cumulative Time|Epoch Time|Images/sec) = [\d.]+", r"\1 = *", stdout)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
def test_bar_in_a_terminal_and_clean_files(trainer, cifar_dir, tmp_path):
    command, env = TRAINERS[trainer]
    rc, stdout, terminal = run_in_terminal(command(cifar_dir), env())
    assert rc == 0, terminal[-3000:]
    # The bars, on stderr: redrawn in place, the training bar up to its last step, the validation bar.
    assert "\r" in terminal and "epoch 1" in terminal and f"{STEPS}/{STEPS}" in terminal, terminal[-3000:]
    assert re.search(r"img/s, loss=\d+\.\d{3}", terminal) and "validation" in terminal, terminal[-3000:]
    # Drawn by rank 0 only: one bar, so one "0/5" at its start.
    assert terminal.count(f" 0/{STEPS} ") == 1, terminal[-3000:]
    # stdout (here a pipe, as with `| tee`) has the epoch line only.
    assert "\r" not in stdout and EPOCH_LINE.findall(stdout) == ["1"], stdout

    rc, file_stdout, file_stderr = run_to_files(command(cifar_dir), env(), tmp_path)
    assert rc == 0, file_stderr[-3000:]
    assert "\r" not in file_stdout + file_stderr
    assert "epoch 1" not in file_stderr and "img/s" not in file_stderr and "validation" not in file_stderr
    # The same epoch line to the digit (times aside): the bar changed nothing in training or in the output.
    assert without_times(file_stdout) == without_times(stdout), (file_stdout, stdout)


@pytest.mark.slow
def test_raw_ddp_progress_off_in_a_terminal(cifar_dir):
    rc, stdout, terminal = run_in_terminal(raw_command(cifar_dir, "--progress", "off"), cpu_env())
    assert rc == 0, terminal[-3000:]
    assert "\r" not in terminal and "epoch 1" not in terminal and EPOCH_LINE.findall(stdout) == ["1"]


@pytest.mark.slow
def test_accel_train_progress_on_into_a_file(cifar_dir, tmp_path):
    """Asked for, the bar is drawn into a file too (rank 0's only); the epoch line stays on stdout."""
    rc, stdout, stderr = run_to_files(accel_command(cifar_dir, "--progress", "on"), accel_env(), tmp_path)
    assert rc == 0, stderr[-3000:]
    assert "\r" in stderr and f"{STEPS}/{STEPS}" in stderr and stderr.count(f" 0/{STEPS} ") == 1
    assert "\r" not in stdout and EPOCH_LINE.findall(stdout) == ["1"]


@pytest.mark.slow
def test_an_error_starts_on_its_own_line(cifar_dir):
    """A run stopped in the middle of an epoch (a learning rate that diverges: a non-finite loss at step 2, found
    at the agreement at step 2): the bar is erased before the error message, which does not run on after it."""
    rc, stdout, terminal = run_in_terminal(raw_command(cifar_dir, "--set", "base_lr=1.0e+12"), cpu_env())
    assert rc == 1, terminal[-3000:]
    line = terminal[: terminal.index("error: non-finite loss")].rsplit("\n", 1)[-1]
    assert line.rsplit("\r", 1)[-1] == "", repr(terminal[-2000:])
