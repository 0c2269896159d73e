"""The safety net (recipe key extra_epochs): when the epoch budget ends with the target still
reachable within the extra epochs, both trainers train on at the budget's last epoch's learning rates; the
epoch lines and the JSON log say so. A checkpoint taken inside an extra epoch resumes exactly: test_reliability.py's
test_a_stop_signal_checkpoints_and_the_run_resumes_exactly."""

import re
import sys

import pytest
from helpers import EPOCH_LINE, TINY, cpu_env, data_flags, finish, start
from test_accel import CONFIGS, accel_env, accelerate_command, reliability_flags

from cifar_wrn.model import WideResNet
from cifar_wrn.optim import build_optimizer, build_scheduler
from cifar_wrn.recipe import Recipe, load_recipe
from cifar_wrn.runlog import epoch_line, read_log
from cifar_wrn.stopping import Progress, criterion_met, final_line, trailing_streak

# ----------------------------------------------------------------------------- the rule, without processes


def simulate(accuracies: list, progress: Progress | None = None, **recipe_keys) -> tuple[Progress, bool, list]:
    """The trainers' epoch loop (Progress.epochs / end_epoch) over given validation accuracies."""
    recipe = Recipe(epochs=4, target_accuracy=0.85, patience=2, **recipe_keys)
    progress, done, records = progress or Progress(), False, []
    for epoch in progress.epochs(recipe):
        metrics = {"epoch": epoch + 1, "val_accuracy": accuracies[epoch]}
        done = progress.end_epoch(metrics, recipe)
        records.append(metrics)
        if done:
            break
    return progress, done, records


def test_off_by_default_the_budget_ends_the_run():
    progress, done, records = simulate([0.70, 0.80, 0.849, 0.866])
    assert (progress.epoch, done) == (4, False)
    assert not any("safety_net" in r or "extra_epoch" in r for r in records)
    assert (
        final_line(progress, Recipe(epochs=4)) == "Target accuracy 0.85 not reached 2 epochs in a row within 4 epochs"
    )


def test_near_miss_at_the_budgets_end_fires_and_the_extra_epoch_completes_the_criterion():
    progress, done, records = simulate([0.70, 0.80, 0.849, 0.866, 0.86], extra_epochs=1)
    assert (progress.epoch, done) == (5, True)
    assert records[3]["safety_net"] == {"budget": 4, "extra_epochs": 1, "streak": 1, "patience": 2}
    assert records[4]["extra_epoch"] == 1 and "safety_net" not in records[4]
    assert (
        final_line(progress, Recipe(epochs=4, extra_epochs=1))
        == "Early stopping after epoch 5 (1 safety-net epoch(s) after the 4-epoch budget)"
    )
    line = epoch_line({**records[3], "cumulative_time": 1.0, "epoch_time": 1.0, "images_per_sec": 1.0, "val_loss": 1.0})
    course, note = line.split("\n")
    assert course.startswith("Epoch =  4: ") and note.startswith("Safety net: the target was met 1 of 2 epochs")


def test_an_extra_epoch_that_misses_ends_the_run_unmet():
    progress, done, records = simulate([0.70, 0.80, 0.849, 0.866, 0.849], extra_epochs=1)
    assert (progress.epoch, done) == (5, False)
    assert (
        final_line(progress, Recipe(epochs=4, extra_epochs=1))
        == "Target accuracy 0.85 not reached 2 epochs in a row within 4 epochs and 1 safety-net epoch(s)"
    )


@pytest.mark.parametrize(
    "accuracies, extra_epochs, epochs_run",
    [
        ([0.70, 0.80, 0.84, 0.845], 1, 4),  # both last epochs missed: one extra epoch cannot make two
        ([0.70, 0.86, 0.87], 1, 3),  # met inside the budget: nothing to catch
        ([0.70, 0.80, 0.84, 0.845, 0.86, 0.86], 2, 6),  # two extra epochs can make two in a row
        ([0.70, 0.80, 0.849, 0.866, 0.84, 0.9], 2, 5),  # a miss leaves 1 epoch for 2 in a row: stop there
    ],
)
def test_the_net_runs_only_while_the_criterion_can_still_be_met(accuracies, extra_epochs, epochs_run):
    progress, _, records = simulate(accuracies, extra_epochs=extra_epochs)
    assert progress.epoch == epochs_run
    assert [r["epoch"] for r in records if "safety_net" in r] == ([4] if epochs_run > 4 else [])


def test_a_resumed_progress_decides_alike():
    """The rule reads only the epoch and the streak, which a checkpoint stores (Progress.as_dict): a Progress at
    the budget's end, restored from its dict, goes on into the net's epoch as the uninterrupted loop does."""
    accuracies = [0.70, 0.80, 0.849, 0.866, 0.86]
    first, _, _ = simulate(accuracies[:4])
    resumed, done, records = simulate(accuracies, Progress.of(first.as_dict()), extra_epochs=1)
    assert (resumed.epoch, done, [r["epoch"] for r in records]) == (5, True, [5])


def test_a_resume_that_changes_the_rule_recounts_the_streak_from_the_logged_accuracies():
    """A run at target 0.85 logs 0.70, 0.86 (streak 1), then resumes at target 0.87: the course's rule (the last
    `patience` accuracies all >= target) reads 0.86 under 0.87, so epoch 3's 0.88 is one epoch in a row, not
    two; the run stops at epoch 4. A lowered patience counts the logged epochs too."""
    first, at_target = Progress(), Recipe(epochs=4, target_accuracy=0.85, patience=2)
    assert [first.end_epoch({"epoch": e + 1, "val_accuracy": a}, at_target) for e, a in enumerate((0.70, 0.86))] == [
        False,
        False,
    ]
    assert first.epoch == 2 and trailing_streak(first.accuracies, 0.85) == 1
    raised = Recipe(epochs=4, target_accuracy=0.87, patience=2)
    resumed = Progress.of(first.as_dict())
    assert [(e, resumed.end_epoch({"epoch": e + 1, "val_accuracy": a}, raised)) for e, a in ((2, 0.88), (3, 0.89))] == [
        (2, False),
        (3, True),
    ]
    assert criterion_met([0.70, 0.86, 0.88], 0.87, 2) is False and criterion_met([0.86, 0.88, 0.89], 0.87, 2)
    assert criterion_met([0.86], 0.85, 2) is False and criterion_met([0.86], 0.85, 1)


def test_extra_epochs_replay_the_budgets_last_epoch_learning_rates():
    """Linear decay reaches 0 at the budget's end; each extra epoch runs the last epoch's rates again (not lr 0)."""
    recipe = Recipe(epochs=2, lr_schedule="warmup_linear", warmup_epochs=0.5, extra_epochs=2)
    optimizer = build_optimizer(WideResNet(width=4), recipe, lr=1.0)
    scheduler, lrs = build_scheduler(optimizer, recipe, steps_per_epoch=10), []
    for _ in range(40):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[20:30] == lrs[10:20] == lrs[30:40] and lrs[20] > lrs[29] and lrs[20] > 0


def test_extra_epochs_is_checked_and_only_fast_turns_it_on():
    with pytest.raises(Exception, match="extra_epochs must be >= 0"):
        load_recipe("fast", {"extra_epochs": -1})
    assert load_recipe("baseline").extra_epochs == 0 and load_recipe("fast").extra_epochs == 1


# ----------------------------------------------------------------------------- both trainers, 2 processes


def command(trainer, cifar_dir, ck, *extra) -> tuple[list, dict]:
    """(command line, environment) of a 2-process run of `trainer` with a 2-epoch budget and target 0."""
    common = [
        *data_flags(cifar_dir),
        "--epochs",
        2,
        "--target-accuracy",
        0.0,
        "--set",
        "lr_schedule=warmup_linear",
        "--set",
        "warmup_epochs=0.5",
        "--checkpoint-dir",
        ck,
        *extra,
    ]
    if trainer == "raw":
        return [sys.executable, "raw_ddp.py", "--num-gpus", 2, *TINY, *common], cpu_env()
    return accelerate_command(CONFIGS / "two_cpus.yaml", *reliability_flags(cifar_dir), *common), accel_env()


def launcher(trainer, cifar_dir, ck):
    """Runs of `trainer` into checkpoint folder ck, each to its end (240 s at most: a loaded machine)."""
    return lambda *extra: finish(start(*command(trainer, cifar_dir, ck, *extra)), 240)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_the_net_fires_and_logs(cifar_dir, tmp_path, trainer):
    """Target 0 makes every epoch pass: with patience 3 a 2-epoch budget ends one short (a deterministic near
    miss), so extra_epochs=2 runs epoch 3, which completes the criterion."""
    keys = ["--patience", 3, "--set", "extra_epochs=2"]
    straight = launcher(trainer, cifar_dir, tmp_path / "ck_a")(
        *keys, "--save", tmp_path / "a.pt", "--log-json", tmp_path / "a.jsonl"
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert [int(n) for n in EPOCH_LINE.findall(straight.stdout)] == [1, 2, 3]
    assert re.search(
        r"^Epoch =  2: .*\nSafety net: the target was met 2 of 3 epochs in a row when the 2-epoch "
        r"budget ended; training on for up to 2 more epoch",
        straight.stdout,
        re.M,
    ), straight.stdout
    assert "Early stopping after epoch 3 (1 safety-net epoch(s) after the 2-epoch budget)" in straight.stdout
    _, epochs = read_log(tmp_path / "a.jsonl")
    assert epochs[1]["safety_net"]["extra_epochs"] == 2 and epochs[2]["extra_epoch"] == 1
    assert epochs[2]["cumulative_time"] == pytest.approx(sum(e["epoch_time"] for e in epochs))


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_the_net_does_not_fire_when_the_criterion_is_out_of_reach(cifar_dir, tmp_path, trainer):
    """The same run with patience 4: 2 passing epochs + 1 extra cannot make 4 in a row, so the budget ends it."""
    result = launcher(trainer, cifar_dir, tmp_path / "ck")(
        "--patience", 4, "--set", "extra_epochs=1", "--log-json", tmp_path / "log.jsonl"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(n) for n in EPOCH_LINE.findall(result.stdout)] == [1, 2] and "Safety net" not in result.stdout
    assert "Target accuracy 0.0 not reached 4 epochs in a row within 2 epochs\n" in result.stdout
    _, epochs = read_log(tmp_path / "log.jsonl")
    assert not any("safety_net" in e or "extra_epoch" in e for e in epochs)
