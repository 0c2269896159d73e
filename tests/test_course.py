"""course/: the course's single-GPU script and its DDP version. Their diff is the eleven steps, every hunk tagged,
and the DDP version prints raw_ddp.py's numbers."""

import difflib
import importlib.util
import re
import sys

import pytest
from helpers import EPOCH_LINE, REPO, cpu_env, data_flags, free_port, pythonpath_with, run

SINGLE, DDP = REPO / "course" / "cifar10.py", REPO / "course" / "cifar10_ddp.py"
TAG = re.compile(r"# (R1\.(\d+)\b|beyond R1: \w)")
STEPS = {f"R1.{n}" for n in range(1, 12)}


def hunks(old: list[str], new: list[str]) -> list[tuple[list[str], list[str]]]:
    """The diff's hunks, without context: (removed lines, added lines); blank-line-only changes left out."""
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    changes = [(old[i1:i2], new[j1:j2]) for op, i1, i2, j1, j2 in matcher.get_opcodes() if op != "equal"]
    return [(gone, added) for gone, added in changes if any(line.strip() for line in gone + added)]


def untagged_hunks(old: list[str], new: list[str]) -> list[str]:
    """Hunks none of whose added lines carries `# R1.<n>` or `# beyond R1: <why>` (a removal alone counts too)."""
    return ["\n".join(["-" + x for x in gone] + ["+" + x for x in added]) for gone, added in hunks(old, new)
            if not any(TAG.search(line) for line in added)]  # fmt: skip


def diff_tags(old: list[str], new: list[str]) -> set[str]:
    return {f"R1.{n}" for _, added in hunks(old, new) for line in added for n in re.findall(r"R1\.(\d+)", line)}


def lines(path) -> list[str]:
    return path.read_text().splitlines()


def test_every_hunk_of_the_course_diff_carries_its_tag_and_all_eleven_steps_are_there():
    assert untagged_hunks(lines(SINGLE), lines(DDP)) == []
    assert diff_tags(lines(SINGLE), lines(DDP)) == STEPS


def test_the_tag_check_fails_an_untagged_hunk_and_a_missing_step():
    old = ["a = 1", "b = 2", "c = 3", "", "d = 4"]
    new = ["a = 1", "x = 0  # R1.2 rank", "b = 2", "c = 5", "", "", "d = 4"]
    assert untagged_hunks(old, new) == ["-c = 3\n+c = 5\n+"]
    assert untagged_hunks(old, ["a = 1", "b = 2"]) == ["-c = 3\n-\n-d = 4"]  # a bare removal
    assert untagged_hunks(old, [*old, "lr = 2  # beyond R1: the scaling rule"]) == []
    assert diff_tags(old, new) == {"R1.2"} != STEPS


def test_the_course_scripts_stay_small_and_the_single_gpu_one_knows_no_distribution():
    assert len(lines(SINGLE)) <= 170 and len(lines(DDP)) <= 230
    assert "torch.distributed" not in SINGLE.read_text() and "multiprocessing" not in SINGLE.read_text()
    for path in (SINGLE, DDP):  # the course's model, not a copy of it
        assert "from cifar_wrn.model import WideResNet" in path.read_text()
        assert not re.search(r"^class ", path.read_text(), re.M)


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: __main__'s block does not run
    return module


@pytest.mark.parametrize("path", [SINGLE, DDP], ids=["cifar10", "cifar10_ddp"])
def test_help_leaves_out_the_test_only_flags_which_still_work(path, monkeypatch, capsys):
    module = load(path)
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit):
        module.parse_args()
    help_text = capsys.readouterr().out
    assert "--data-dir" in help_text and "--epochs" in help_text
    for flag in ("--train-subset", "--val-subset", "--model-width"):
        assert flag not in help_text
    monkeypatch.setattr(sys, "argv", [path.name, "--train-subset", "8", "--val-subset", "4", "--model-width", "4"])
    args = module.parse_args()
    assert (args.train_subset, args.val_subset, args.model_width) == (8, 4, 4)
    if path == DDP:
        assert "--num-nodes" in help_text and "--node-id" in help_text and "--num-gpus" in help_text
        # its default port, 29500, is every job's: two 2-GPU jobs on one 4-GPU node would collide there
        assert "two jobs on one node need two (the course_* jobs give each its own)" in " ".join(help_text.split())


def numbers(stdout: str) -> list[tuple[str, str, str]]:
    """(training accuracy, validation loss, validation accuracy) of each epoch line, as printed."""
    found = re.findall(
        r"Training Accuracy = ([\d.]+), Validation Loss = ([\d.]+), Validation Accuracy = ([\d.]+)", stdout
    )
    assert len(found) == len(EPOCH_LINE.findall(stdout)), stdout
    return found


@pytest.mark.core
def test_the_minimal_ddp_script_prints_raw_ddps_numbers(cifar_dir):
    """The same seed, data and model on 2 gloo processes: course/cifar10_ddp.py and raw_ddp.py --recipe baseline
    print the same training accuracy, validation loss and validation accuracy, epoch by epoch. 256 training
    images (4 steps of 32 per rank) and 100 validation images: 50 a rank, so no rank's shard is padded.
    The minimal script averages each rank's means, exact only when every rank holds as many validation images (a
    padded shard counts a repeated image twice); raw_ddp.py sums losses and counts, exact for any split.
    Batch size 32: the course scales the learning rate by the GPUs, raw_ddp.py by global batch / 32; the same here."""
    course, raw = course_and_raw_ddp(cifar_dir)
    assert numbers(course.stdout) == numbers(raw.stdout), (course.stdout, raw.stdout)
    assert len(set(numbers(course.stdout))) == 3  # it learns: the epochs differ


def course_and_raw_ddp(cifar_dir, env=None) -> tuple:
    """course/cifar10_ddp.py (in `env`) and raw_ddp.py, each 3 epochs on 2 gloo processes: their results."""
    same = [*data_flags(cifar_dir, 256, 100), "--model-width", 4, "--epochs", 3, "--seed", 1]
    course = run([sys.executable, DDP, "--num-gpus", 2, "--master-port", free_port(), *same], env=env)
    raw = run([sys.executable, REPO / "raw_ddp.py", "--num-gpus", 2, "--device", "cpu", "--recipe", "baseline", *same])
    assert course.returncode == 0, course.stderr[-3000:]
    assert raw.returncode == 0, raw.stderr[-3000:]
    assert len(numbers(course.stdout)) == 3, course.stdout
    return course, raw


def gloo_before_2_8_env() -> dict:
    """cpu_env with tests/gloo_before_2_8/ first on PYTHONPATH: torch 2.7.1's gloo, without ReduceOp.AVG."""
    env = cpu_env()
    return {**env, "PYTHONPATH": pythonpath_with(REPO / "tests" / "gloo_before_2_8", REPO, env=env)}


@pytest.mark.slow
def test_before_torch_2_8_the_course_scripts_sum_and_divide_where_gloo_has_no_avg(cifar_dir):
    """On Falcon's torch 2.7.1 (stood in for by tests/gloo_before_2_8/) gloo has no ReduceOp.AVG: the course
    script and `course/steps.py reduce` once stopped in its traceback. Their fallback (SUM, then divide) prints
    raw_ddp.py's numbers still, and the demo its mean."""
    course, raw = course_and_raw_ddp(cifar_dir, gloo_before_2_8_env())
    assert numbers(course.stdout) == numbers(raw.stdout), (course.stdout, raw.stdout)
    demo = run([sys.executable, REPO / "course" / "steps.py", "reduce"], env=gloo_before_2_8_env())
    assert demo.returncode == 0 and "Traceback" not in demo.stderr, demo.stderr[-3000:]
    assert demo.stdout.count("accuracy 0.810 (the mean)") == 2, demo.stdout


@pytest.mark.slow
def test_the_course_scripts_refuse_missing_data_in_one_line_each(tmp_path):
    for command in ([SINGLE], [DDP, "--num-gpus", 2, "--master-port", free_port()]):
        result = run([sys.executable, *command, "--data-dir", tmp_path / "none"], timeout=120)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode != 0 and errors, result.stderr
        assert set(errors) == {errors[0]} and "CIFAR-10 is not in" in errors[0]
        assert "Traceback" not in result.stderr, result.stderr
