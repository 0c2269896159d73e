"""Seeds as a measurement: bench/time_to_target.py's --summary on synthetic JSON logs and its --seeds plans,
bench/sync_count.py's smoke run on the CPU, the lever lines of bench/gpu_session.sh and bench/gpu_speed.sh, and
the latter's dry run (the GPU sessions rely on all of them). Each runs as a user runs it, `python bench/NAME.py`
(the tests import nothing from bench/)."""

import json
import re
import sys

import pytest
from helpers import REPO, TESTS, cpu_env, pythonpath_with, run

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


def summary(*logs, flags=()) -> str:
    """What `python bench/time_to_target.py --summary LOGS... [flags]` prints."""
    result = run([sys.executable, "bench/time_to_target.py", "--summary", *logs, *flags])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table of `text` whose header row starts with `header`."""
    lines = text.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith(header)) + 2 :]
    rows = rows[: next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]
    return [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows]


@pytest.mark.slow
def test_per_epoch_statistics_and_criterion_counts(tmp_path):
    logs = [
        write_log(tmp_path / "s0.jsonl", 0, [0.75, 0.82, 0.852, 0.866]),  # met at epoch 4
        write_log(tmp_path / "s1.jsonl", 1, [0.74, 0.86, 0.851]),  # met at epoch 3
        write_log(tmp_path / "s2.jsonl", 2, [0.76, 0.80, 0.849, 0.866, 0.86], resumed_at=3),
    ]  # the net
    text = summary(*logs)
    assert "\n3 runs;" in text  # the resumed log is one run
    rows = table_rows(text, "| epoch |")
    assert [row[1] for row in rows] == ["3", "3", "3", "2", "1"]  # runs with each epoch
    # mean, min, max, sample standard deviation (n - 1: 0.0015; n would give 0.0012), met by epoch 3
    assert rows[2] == ["3", "3", "0.8507", "0.8490", "0.8520", "0.0015", "1/3"]
    assert [row[6] for row in rows] == ["0/3", "0/3", "1/3", "2/3", "3/3"]
    assert rows[4][5] == "–"  # one run: no standard deviation
    assert "| s2 | 2 | 0.7600 / 0.8000 / 0.8490 / 0.8660 / 0.8600 | epoch 5 (safety net) | 50.00 |" in text
    assert "| s1 | 1 | 0.7400 / 0.8600 / 0.8510 | epoch 3 | 30.00 |" in text
    assert "note:" not in text


@pytest.mark.slow
def test_other_recipes_and_unreadable_logs_are_named(tmp_path):
    write_log(tmp_path / "a.jsonl", 0, [0.8, 0.86, 0.87])
    write_log(tmp_path / "b.jsonl", 1, [0.8, 0.86, 0.87], recipe={"base_lr": 0.2})
    (tmp_path / "cut.jsonl").write_text('{"kind": "header", "recipe": {}}\n{"kind": "epo')  # killed mid-write
    (tmp_path / "empty.jsonl").write_text(json.dumps({"kind": "header", "recipe": RECIPE}) + "\n")
    text = summary(tmp_path)
    assert [row[0] for row in table_rows(text, "| run |")] == ["a", "b"]
    notes = [line.removeprefix("note: ") for line in text.splitlines() if line.startswith("note: ")]
    assert [n.split(":")[0] for n in notes[:2]] == [str(tmp_path / "cut.jsonl"), str(tmp_path / "empty.jsonl")]
    assert "no epoch finished" in notes[1]
    assert notes[2].startswith("the runs differ in base_lr, not only in seed")


@pytest.mark.slow
def test_group_summarises_each_recipe_apart(tmp_path):
    logs = [write_log(tmp_path / f"fast{k}.jsonl", k, [0.8, 0.85, 0.86]) for k in range(3)]
    logs += [write_log(tmp_path / f"muon{k}.jsonl", k, [0.8, 0.84, 0.86], recipe={"base_lr": 0.2}) for k in range(2)]
    text = summary(*logs, flags=["--group"])
    assert re.findall(r"^### (.*)\n\n(\d+) runs;", text, re.M) == [
        ("the reference recipe (the largest group)", "3"),
        ("base_lr=0.2", "2"),
    ]
    assert "### base_lr=0.2\n" in text and "| 2 | 2 | 0.8400 |" in text and "| 2 | 3 | 0.8500 |" in text
    assert "not only in seed" not in text


@pytest.mark.slow
def test_summary_command_line(tmp_path):
    write_log(tmp_path / "s0.jsonl", 0, [0.8, 0.86, 0.87])
    ok = run([sys.executable, "bench/time_to_target.py", "--summary", tmp_path])
    assert ok.returncode == 0 and "| 2 | 1 | 0.8600 |" in ok.stdout, ok.stderr
    missing = run([sys.executable, "bench/time_to_target.py", "--summary", tmp_path / "nope.jsonl"])
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_seed_plans():
    """The GPU session's lever lines (--emit); the CPU runs' commands: test_cpu_seeds_run_one_after_another..."""
    emit = [sys.executable, "bench/time_to_target.py", "--emit", "--seeds"]
    assert run([*emit, 3]).stdout.splitlines() == ["seed=0", "seed=1", "seed=2"]
    assert run([*emit, 2, "--first", 5, "--set", "ema_decay=0.98", "--set", "bn_lr_scale=8"]).stdout.splitlines() == [
        "ema_decay=0.98 bn_lr_scale=8 seed=5",
        "ema_decay=0.98 bn_lr_scale=8 seed=6",
    ]


@pytest.mark.slow
def test_cpu_seeds_run_one_after_another_and_are_summarised(cifar_dir, tmp_path):
    result = run(
        [
            sys.executable,
            "bench/time_to_target.py",
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
    commands = [line.removeprefix("$ ").split() for line in result.stdout.splitlines() if line.startswith("$ ")]
    assert [c[-1] for c in commands] == [f"{tmp_path.resolve()}/seed-{seed}.jsonl" for seed in (3, 4)]
    assert commands[0][:2] == [sys.executable, "raw_ddp.py"] and ["--set", "seed=3"] == commands[0][-4:-2]
    assert "--num-gpus" in commands[0] and "--auto-resume" in commands[0]
    assert "2 runs;" in result.stdout and "| seed-3 | 3 |" in result.stdout and "| seed-4 | 4 |" in result.stdout
    assert "not only in seed" not in result.stdout  # the two runs differ only in seed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-seed-3", "ckpt-seed-4", "seed-3.jsonl", "seed-4.jsonl"]


@pytest.mark.slow
def test_sync_count_runs_the_fast_step_on_the_cpu():
    """A smoke test for the GPU session: the script runs the whole step (DDP, EMA, StepGuard) and prints its table,
    a row per phase. CUDA's sync debug mode warns of nothing on the CPU: tests/sync_warnings/ makes each EMA update
    warn twice as it would (and once of something else), so the count per step and the source line are checked."""
    env = cpu_env()
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
        env={**env, "PYTHONPATH": pythonpath_with(TESTS / "sync_warnings", env=env)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "# host synchronisations over 2 steps (cpu; torch " in result.stdout, result.stdout
    rows = {row[0]: row[1:] for row in table_rows(result.stdout, "| phase |")}
    assert list(rows) == ["data", "forward", "backward", "clip", "optimizer", "scheduler", "ema", "guard", "all"]
    assert rows["ema"][0] == "2" and re.fullmatch(r"tests/sync_warnings/sitecustomize\.py:\d+ x4", rows["ema"][1])
    assert all(counts[0] == "0" for phase, counts in rows.items() if phase not in ("ema", "all")), rows
    assert rows["all"][0] == "2", rows
    bad = run([sys.executable, "bench/sync_count.py", "--device", "cpu", "--set", "data_pipeline=dataloader"])
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


def test_every_lever_line_of_the_gpu_session_is_a_valid_recipe():
    """bench/gpu_session.sh's EPOCH3_LEVERS feed its sweep on a GPU lent for minutes: a bad key costs a run there."""
    from cifar_wrn.recipe import load_recipe, parse_set

    script = (REPO / "bench" / "gpu_session.sh").read_text()
    lines = [line.split() for line in re.search(r"^EPOCH3_LEVERS='\n(.*?)^'$", script, re.S | re.M)[1].splitlines()]
    lines = [words for words in lines if words]
    assert len(lines) >= 10 and all(any(w.startswith("seed=") for w in words) for words in lines)
    for words in lines:
        load_recipe("fast", {**parse_set(words), "batch_size": "256"})  # raises RecipeError on a bad line


def gpu_speed_levers() -> list[tuple[str, list[str]]]:
    """bench/gpu_speed.sh's LEVERS: (name, raw_ddp.py flags) per line."""
    script = (REPO / "bench" / "gpu_speed.sh").read_text()
    lines = re.findall(r'^    "([^"|]+)\|([^"]*)"$', re.search(r"^LEVERS=\(\n(.*?)^\)$", script, re.S | re.M)[1], re.M)
    return [(name, flags.split()) for name, flags in lines]


def test_every_lever_of_the_gpu_speed_script_is_a_valid_recipe():
    """A bad key in bench/gpu_speed.sh's LEVERS would cost a run of a GPU lent for minutes."""
    from cifar_wrn.recipe import load_recipe, parse_set

    levers = gpu_speed_levers()
    assert len(levers) >= 6 and len({name for name, _ in levers}) == len(levers)
    for name, flags in levers:
        assert flags[::2] == ["--set"] * (len(flags) // 2), name
        load_recipe("fast", {**parse_set(flags[1::2]), "batch_size": "256"})  # raises RecipeError on a bad line


@pytest.mark.slow
def test_the_gpu_speed_dry_run_prints_every_table(tmp_path):
    """`bash bench/gpu_speed.sh --dry-run`: every step at tiny size on the CPU. It prints the FLOPs per image and the
    bf16 peak (unknown on a CPU), the cuDNN flag, fast.yaml per epoch (the split, TFLOP/s, accuracy with and without
    flip TTA, compiled frames) and its criterion both ways, the kernel table and its shares, and the A/B table with
    a row per lever, each run at least once; the flags and re-estimation column show each lever's effect; the logs
    come back as one tarball under docs/runs/DATE-gpu-speed/."""
    import tarfile

    result = run(["bash", "bench/gpu_speed.sh", "--dry-run"], timeout=540, env=cpu_env(OUT=tmp_path))
    out = result.stdout
    assert result.returncode == 0 and "=== done at" in out, (out + result.stderr)[-4000:]
    assert "FLOPs per image (FlopCounterMode): forward " in out and "peak: peak unknown" in out
    assert "cuDNN autotuning (torch.backends.cudnn.benchmark) as the clock starts: True" in out
    epochs = table_rows(out, "| epoch | epoch s | training steps s | re-estimation s |")
    assert [row[0] for row in epochs] == ["1", "2", "3", "4"] and all(float(row[8]) >= 0 for row in epochs), epochs
    assert "criterion with flip TTA: " in out and "criterion without TTA: " in out
    kernels, kinds = table_rows(out, "| kernel | calls | ms | share | kind |"), table_rows(out, "| kind | ms | share |")
    assert len(kernels) == 15 and {"convolution and matmul", "BatchNorm"} <= {row[0] for row in kinds}, kinds
    rows = {row[0]: row for row in table_rows(out, "| lever | runs | epoch 2 s | vs fast.yaml |")}
    assert list(rows) == ["fast.yaml", *(name for name, _ in gpu_speed_levers())], rows
    assert all(int(row[1]) >= 1 for row in rows.values()), rows
    assert rows["fast.yaml"][9] == "True" and rows["cudnn_benchmark off"][9] == "False", rows
    assert rows["no BatchNorm re-estimation"][6].startswith("0.000 ") and float(rows["fast.yaml"][6].split()[0]) > 0
    with tarfile.open(tmp_path / "logs.tar.gz") as logs:
        names = logs.getnames()
    files = {re.sub(r"\d{4}-\d\d-\d\d", "DATE", n).removeprefix("docs/runs/DATE-gpu-speed/") for n in names}
    assert {"fast.md", "kernels.md", "ab.md", "session.log", "fast.jsonl", "ab.json"} <= files, names
