"""Seeds as a measurement (issue 25): bench/seeds_summary.py on synthetic JSON logs, bench/seeds.py's plans, and
bench/sync_count.py's smoke run on the CPU (the GPU session relies on all three)."""

import json
import math
import sys

import pytest
from conftest import REPO, run

sys.path.insert(0, str(REPO / "bench"))
import seeds  # noqa: E402
import seeds_summary  # noqa: E402

RECIPE = {"epochs": 4, "target_accuracy": 0.85, "patience": 2, "extra_epochs": 1, "base_lr": 0.4}


def write_log(path, seed, accuracies, recipe=None, resumed_at=None):
    """A trainer's JSON log: a header, then one record per epoch; resumed_at=k appends a second header and the
    epochs from k on again (what a run resumed in epoch k writes; the earlier copy of epoch k is stale)."""
    header = {"kind": "header", "recipe": {**RECIPE, **(recipe or {}), "seed": seed}}
    records = [header] + [
        {"kind": "epoch", "epoch": i + 1, "val_accuracy": a, "cumulative_time": 10.0 * (i + 1)}
        for i, a in enumerate(accuracies)
    ]
    if resumed_at:
        records[resumed_at]["val_accuracy"] = 0.0  # stale: the resumed run redid this epoch
        records += [dict(header, resumed_at={"epoch": resumed_at, "step": 3})]
        records += [
            {"kind": "epoch", "epoch": i + 1, "val_accuracy": a, "cumulative_time": 10.0 * (i + 1)}
            for i, a in enumerate(accuracies)
            if i + 1 >= resumed_at
        ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_per_epoch_statistics_and_criterion_counts(tmp_path):
    logs = [
        write_log(tmp_path / "s0.jsonl", 0, [0.75, 0.82, 0.852, 0.866]),  # met at epoch 4
        write_log(tmp_path / "s1.jsonl", 1, [0.74, 0.86, 0.851]),  # met at epoch 3
        write_log(tmp_path / "s2.jsonl", 2, [0.76, 0.80, 0.849, 0.866, 0.86], resumed_at=3),
    ]  # the net
    runs, notes = seeds_summary.load_runs(logs)
    assert notes == [] and [len(r["epochs"]) for r in runs] == [4, 3, 5]  # the resumed log is one run
    rows = {row["epoch"]: row for row in seeds_summary.per_epoch(runs)}
    assert rows[3]["mean"] == pytest.approx((0.852 + 0.851 + 0.849) / 3)
    assert (rows[3]["min"], rows[3]["max"], rows[3]["n"]) == (0.849, 0.852, 3)
    assert rows[3]["std"] == pytest.approx(0.0015275, rel=1e-4)  # sample standard deviation (n - 1)
    assert [rows[k]["met"] for k in (1, 2, 3, 4, 5)] == [0, 0, 1, 2, 3]
    assert rows[5]["n"] == 1 and math.isnan(rows[5]["std"])
    text = seeds_summary.render(runs, notes)
    assert "| 3 | 3 | 0.8507 | 0.8490 | 0.8520 | 0.0015 | 1/3 |" in text
    assert "| s2 | 2 | 0.7600 / 0.8000 / 0.8490 / 0.8660 / 0.8600 | epoch 5 (safety net) | 50.00 |" in text
    assert "| s1 | 1 | 0.7400 / 0.8600 / 0.8510 | epoch 3 | 30.00 |" in text
    assert "note:" not in text


def test_other_recipes_and_unreadable_logs_are_named(tmp_path):
    write_log(tmp_path / "a.jsonl", 0, [0.8, 0.86, 0.87])
    write_log(tmp_path / "b.jsonl", 1, [0.8, 0.86, 0.87], recipe={"base_lr": 0.2})
    (tmp_path / "cut.jsonl").write_text('{"kind": "header", "recipe": {}}\n{"kind": "epo')  # killed mid-write
    (tmp_path / "empty.jsonl").write_text(json.dumps({"kind": "header", "recipe": RECIPE}) + "\n")
    runs, notes = seeds_summary.load_runs(seeds_summary.log_paths([tmp_path]))
    assert [r["name"] for r in runs] == ["a", "b"]
    assert [n.split(":")[0] for n in notes] == [str(tmp_path / "cut.jsonl"), str(tmp_path / "empty.jsonl")]
    assert "no epoch finished" in notes[1]
    assert "note: the runs differ in base_lr, not only in seed" in seeds_summary.render(runs, notes)


def test_group_summarises_each_recipe_apart(tmp_path):
    logs = [write_log(tmp_path / f"fast{k}.jsonl", k, [0.8, 0.85, 0.86]) for k in range(3)]
    logs += [write_log(tmp_path / f"muon{k}.jsonl", k, [0.8, 0.84, 0.86], recipe={"base_lr": 0.2}) for k in range(2)]
    groups = seeds_summary.by_recipe(seeds_summary.load_runs(logs)[0])
    assert [(name, len(runs)) for name, runs in groups] == [
        ("the reference recipe (the largest group)", 3),
        ("base_lr=0.2", 2),
    ]
    text = run([sys.executable, "bench/seeds_summary.py", "--group", tmp_path]).stdout
    assert "### base_lr=0.2\n" in text and "| 2 | 2 | 0.8400 |" in text and "| 2 | 3 | 0.8500 |" in text
    assert "not only in seed" not in text


def test_summary_command_line(tmp_path):
    write_log(tmp_path / "s0.jsonl", 0, [0.8, 0.86, 0.87])
    ok = run([sys.executable, "bench/seeds_summary.py", tmp_path])
    assert ok.returncode == 0 and "| 2 | 1 | 0.8600 |" in ok.stdout, ok.stderr
    missing = run([sys.executable, "bench/seeds_summary.py", tmp_path / "nope.jsonl"])
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_seed_plans():
    assert seeds.lever_lines(3, first=0, sets=[]) == ["seed=0", "seed=1", "seed=2"]
    assert seeds.lever_lines(2, first=5, sets=["ema_decay=0.98", "bn_lr_scale=8"]) == [
        "ema_decay=0.98 bn_lr_scale=8 seed=5",
        "ema_decay=0.98 bn_lr_scale=8 seed=6",
    ]
    commands = seeds.cpu_commands("fast", 2, first=1, sets=["batch_size=64"], out="o", extra=["--data-dir", "d"])
    assert [c[-1] for c in commands] == ["o/seed-1.jsonl", "o/seed-2.jsonl"]
    assert commands[0][:2] == [sys.executable, "raw_ddp.py"] and ["--set", "seed=1"] == commands[0][-4:-2]
    assert "--num-gpus" in commands[0] and "--auto-resume" in commands[0]


def test_cpu_seeds_run_one_after_another_and_are_summarised(cifar_dir, tmp_path):
    result = run(
        [
            sys.executable,
            "bench/seeds.py",
            "--seeds",
            2,
            "--first",
            3,
            "--recipe",
            "baseline",
            "--out",
            tmp_path,
            "--set",
            "eval_batch_size=64",
            "--num-gpus",
            2,
            "--device",
            "cpu",
            "--model-width",
            4,
            "--data-dir",
            cifar_dir,
            "--train-subset",
            64,
            "--val-subset",
            101,
            "--epochs",
            1,
        ],
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 runs;" in result.stdout and "| seed-3 | 3 |" in result.stdout and "| seed-4 | 4 |" in result.stdout
    assert "not only in seed" not in result.stdout  # the two runs differ only in seed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-seed-3", "ckpt-seed-4", "seed-3.jsonl", "seed-4.jsonl"]


def test_sync_counter_attributes_each_warning_to_its_phase_and_line():
    import warnings

    import sync_count

    def two_syncs():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # as set_sync_debug_mode("warn")
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
        return 7

    sync = sync_count.SyncCounter()
    assert sync("ema", two_syncs) == 7 and sync("optimizer", lambda: None) is None
    assert sync.counts == {"ema": 2}
    assert all(source.startswith("tests/test_seeds.py:") for source in sync.sources["ema"])
    assert sum(sync.sources["ema"].values()) == 2
    assert "| ema | 0.5 | tests/test_seeds.py:" in sync_count.report(sync, 4, "cuda")


def test_sync_count_runs_the_fast_step_on_the_cpu():
    """A smoke test for the GPU session: the script runs the whole step (DDP, EMA, StepGuard) and prints its table,
    a row per phase. (The counts themselves are CUDA's: on the CPU nothing is counted, so they are not checked here;
    test_sync_counter_attributes_each_warning_to_its_phase_and_line, above, checks the counting.)"""
    import sync_count

    result = run(
        [
            sys.executable,
            "bench/sync_count.py",
            "--device",
            "cpu",
            "--model-width",
            4,
            "--steps",
            2,
            "--warmup",
            1,
            "--set",
            "batch_size=8",
        ],
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    title = "# host synchronisations over 2 steps (cpu; torch "
    assert title in result.stdout, result.stdout
    table = result.stdout[result.stdout.index(title) :]
    phases = [line.split("|")[1].strip() for line in table.splitlines()[3:]]
    assert phases == [*sync_count.PHASES, "all"], table
    bad = run([sys.executable, "bench/sync_count.py", "--device", "cpu", "--set", "data_pipeline=dataloader"])
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


@pytest.mark.parametrize("levers", ["levers-44.txt"])
def test_every_lever_line_of_the_gpu_session_is_a_valid_recipe(levers):
    """bench/levers-*.txt feed bench/gpu_sweep.sh on a GPU lent for minutes: a bad key would cost a run there."""
    from cifar_wrn.recipe import load_recipe, parse_set

    lines = [line.split("#")[0].split() for line in (REPO / "bench" / levers).read_text().splitlines()]
    lines = [words for words in lines if words]
    assert len(lines) >= 10 and all(any(w.startswith("seed=") for w in words) for words in lines)
    for words in lines:
        load_recipe("fast", {**parse_set(words), "batch_size": "256"})  # raises RecipeError on a bad line


def test_the_startup_bench_times_both_variants(cifar_dir):
    """bench/startup.py (a GPU session step): the fast recipe for 2 epochs with startup_steps 0 and 3, a row each
    with the warm-up's seconds from the log header (0 without it) and both epochs' times."""
    result = run(
        [
            sys.executable,
            "bench/startup.py",
            "--data-dir",
            cifar_dir,
            "--model-width",
            4,
            "--train-subset",
            320,
            "--val-subset",
            101,
            "--rounds",
            1,
            "--set",
            "batch_size=16",
            "--set",
            "eval_batch_size=64",
        ],
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[0].strip() for row in rows[1:]] == ["0", "3"], result.stdout
    assert float(rows[1][1]) == 0 and float(rows[2][1]) > 0 and all(float(row[2]) > 0 for row in rows[1:])
