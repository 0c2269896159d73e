"""cifar_wrn/report/: the scaling arithmetic against hand-computed values, report.md, figures, and the
report without matplotlib; bad input files end in one clear line and exit status 2."""

import json
import re
import subprocess
import sys

import pytest
from helpers import REPO, TINY, raw_ddp

from cifar_wrn.errors import UserError
from cifar_wrn.report.changes import optimisations, recipe_changes
from cifar_wrn.report.cli import main
from cifar_wrn.report.content import where_text
from cifar_wrn.report.ddp_source import code_lines, ddp_steps, statement_lines
from cifar_wrn.report.featured import featured_text, main_run, printed_lines
from cifar_wrn.report.figures import load_matplotlib
from cifar_wrn.report.logs import LogError, label_runs, read_run
from cifar_wrn.report.markdown import write_report
from cifar_wrn.report.notes import EXPLAIN, read_notes
from cifar_wrn.report.scaling import (
    amdahl_speedup,
    karp_flatt,
    mean_images_per_sec,
    parallel_efficiency,
    profile_parts,
    run_rule,
    run_stop,
    run_time_to_target,
    scaling,
    speedup_by_throughput,
    speedup_by_time,
    stopping_epoch,
    time_to_target,
)
from cifar_wrn.report.sharding import accelerate_shards, gradient_bytes, shards
from cifar_wrn.report.topology import global_rank, topology_text

EXACT = 1e-9


def run_report(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m cifar_wrn.report ARGS` from the checkout, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "cifar_wrn.report", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def write_log(path, nodes, gpus, epochs, target=0.85, patience=2, train_accuracy=True, **header):
    """A log as the trainers write it (train_accuracy=False: as they wrote it before it was counted).
    epochs: (epoch_time, images_per_sec, val_accuracy[, profile]); training accuracy 0.1 below validation."""
    records = [
        {
            "kind": "header",
            "world_size": nodes * gpus,
            "num_nodes": nodes,
            "num_gpus": gpus,
            "backend": "nccl",
            "device": "cuda",
            "git_commit": "abc1234",
            "train_images": 50000,
            "recipe": {"target_accuracy": target, "patience": patience, "batch_size": 32},
            **header,
        }
    ]
    cumulative = 0.0
    for i, (epoch_time, ips, accuracy, *profile) in enumerate(epochs, 1):
        cumulative += epoch_time
        record = {
            "kind": "epoch",
            "epoch": i,
            "cumulative_time": cumulative,
            "epoch_time": epoch_time,
            "images_per_sec": ips,
            "val_loss": 2.0 - accuracy,
            "val_accuracy": accuracy,
        }
        if train_accuracy:
            record["train_accuracy"] = accuracy - 0.1
        if profile:
            record["profile"] = profile[0]
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Known numbers. 1 process: 100 s epochs; accuracy reaches 0.85 at epochs 2 and 3 -> stops at epoch 3,
# T = 300 s; images/sec 500, 510, 490, 500 -> mean 500.
ONE = [(100.0, 500.0, 0.50), (100.0, 510.0, 0.86), (100.0, 490.0, 0.87), (100.0, 500.0, 0.90)]
# 2 processes (1 node x 2): 60 s epochs; 0.86, 0.84 (streak broken), 0.86, 0.88 -> stops at epoch 4,
# T = 240 s; images/sec mean (900 + 950 + 1000 + 950) / 4 = 950.
TWO = [(60.0, 900.0, 0.86), (60.0, 950.0, 0.84), (60.0, 1000.0, 0.86), (60.0, 950.0, 0.88)]
# 4 processes (2 nodes x 2): never reaches the target; images/sec mean 1600.
FOUR = [(40.0, 1500.0, 0.70), (40.0, 1700.0, 0.80), (40.0, 1600.0, 0.84)]


@pytest.fixture
def logs(tmp_path):
    return {
        "one": write_log(tmp_path / "one.jsonl", 1, 1, ONE),
        "two": write_log(tmp_path / "two.jsonl", 1, 2, TWO),
        "four": write_log(tmp_path / "four.jsonl", 2, 2, FOUR),
    }


def rows_by_p(runs):
    label_runs(runs)
    sc = scaling(runs)
    return sc, {row["p"]: row for row in sc.rows}


# ----------------------------------------------------------------------------- the arithmetic


def test_formulas_against_hand_computed_values():
    # S = 300 / 240 = 1.25 on p = 2: E = 0.625, e = (1/1.25 - 1/2) / (1 - 1/2) = (0.8 - 0.5) / 0.5 = 0.6
    assert abs(speedup_by_time(300.0, 240.0) - 1.25) < EXACT
    assert abs(parallel_efficiency(1.25, 2) - 0.625) < EXACT
    assert abs(karp_flatt(1.25, 2) - 0.6) < EXACT
    # Amdahl from e = 0.6: S(2) = 1/0.8, S(4) = 1/(0.6 + 0.1) = 1/0.7, S(8) = 1/(0.6 + 0.05) = 1/0.65
    assert abs(amdahl_speedup(0.6, 2) - 1.25) < EXACT
    assert abs(amdahl_speedup(0.6, 4) - 1 / 0.7) < EXACT
    assert abs(amdahl_speedup(0.6, 8) - 1 / 0.65) < EXACT
    # perfect scaling: e = 0 and Amdahl gives back n; no speedup at all: e = 1 and Amdahl gives 1
    assert abs(karp_flatt(4.0, 4)) < EXACT and abs(amdahl_speedup(0.0, 8) - 8) < EXACT
    assert abs(karp_flatt(1.0, 8) - 1.0) < EXACT and abs(amdahl_speedup(1.0, 8) - 1) < EXACT
    # throughput: 950 / 500 = 1.9 on p = 2: e = (1/1.9 - 1/2) / (1/2) = 2/1.9 - 1 = 1/19
    assert abs(speedup_by_throughput(500.0, 950.0) - 1.9) < EXACT
    assert abs(karp_flatt(1.9, 2) - 1 / 19) < EXACT
    with pytest.raises(ValueError):
        karp_flatt(1.0, 1)  # undefined for one process
    assert global_rank(1, 4, 2) == 6


def test_time_to_target_and_not_reached():
    epochs = lambda accs: [{"cumulative_time": 10.0 * (i + 1), "val_accuracy": a} for i, a in enumerate(accs)]
    assert time_to_target(epochs([0.5, 0.86, 0.87, 0.9]), 0.85, 2) == 30.0
    assert time_to_target(epochs([0.86, 0.84, 0.86, 0.88]), 0.85, 2) == 40.0  # the streak restarts
    assert time_to_target(epochs([0.5, 0.85]), 0.85, 1) == 20.0  # >= : exactly the target counts
    assert time_to_target(epochs([0.86, 0.84, 0.86]), 0.85, 2) is None
    assert time_to_target([], 0.85, 2) is None
    assert stopping_epoch([0.9, 0.9, 0.9], 0.85, 3) == 2
    assert mean_images_per_sec([{"images_per_sec": v} for v in (900.0, 950.0, 1000.0, 950.0)]) == 950.0


def test_scaling_by_time_when_every_run_reached_the_target(logs):
    sc, rows = rows_by_p([read_run(logs["two"]), read_run(logs["one"])])
    assert sc.basis == "time" and sc.baseline.label == "one"
    assert [row["p"] for row in sc.rows] == [1, 2]  # ordered by world size
    assert rows[1]["time_to_target"] == 300.0 and rows[2]["time_to_target"] == 240.0
    assert abs(rows[1]["speedup"] - 1.0) < EXACT and "karp_flatt" not in rows[1]
    assert abs(rows[2]["speedup"] - 1.25) < EXACT
    assert abs(rows[2]["efficiency"] - 0.625) < EXACT
    assert abs(rows[2]["karp_flatt"] - 0.6) < EXACT
    assert abs(rows[2]["amdahl"][4] - 1 / 0.7) < EXACT and abs(rows[2]["amdahl"][8] - 1 / 0.65) < EXACT
    assert rows[2]["images_per_sec"] == 950.0 and rows[2]["final_accuracy"] == 0.88


def test_scaling_falls_back_to_throughput_when_a_run_misses_the_target(logs, tmp_path):
    runs = [read_run(logs[k]) for k in ("one", "two", "four")]
    sc, rows = rows_by_p(runs)
    assert sc.basis == "throughput"
    assert rows[4]["time_to_target"] is None
    assert abs(rows[2]["speedup"] - 1.9) < EXACT and abs(rows[2]["karp_flatt"] - 1 / 19) < EXACT
    # 1600 / 500 = 3.2 on p = 4: E = 0.8, e = (1/3.2 - 1/4) / (3/4) = 0.0625 / 0.75 = 1/12
    assert abs(rows[4]["speedup"] - 3.2) < EXACT
    assert abs(rows[4]["efficiency"] - 0.8) < EXACT
    assert abs(rows[4]["karp_flatt"] - 1 / 12) < EXACT
    assert abs(rows[4]["amdahl"][8] - 1 / (1 / 12 + (11 / 12) / 8)) < EXACT

    path, _, _ = write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert "Speedup basis: mean Images/sec" in text and "not reached" in text
    assert "| speedup (images/sec) |" in text
    scaling_rows = [line for line in text.splitlines() if line.startswith("| four |")]
    assert (
        scaling_rows
        and "| 4 | 2 x 2 | not reached | 1600.0 | 0.8400 | one | 3.200 | 0.800 | 0.0833 |" in scaling_rows[0]
    )


def test_report_markdown_holds_tables_topology_and_header_facts(logs, tmp_path):
    runs = [read_run(logs[k]) for k in ("one", "two", "four")]
    runs = [runs[0], runs[1]]
    path, figures, skipped = write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert figures == [] and skipped
    assert "Speedup basis: Cumulative Time to target" in text and "| speedup (time to target) |" in text
    assert (
        "| two | 2 | 1 x 2 | 240.000 | 950.0 | 0.8800 | one | 1.250 | 0.625 | 0.6000 | 1.250 | 1.429 | 1.538 |" in text
    )
    assert "| one | 1 | 1 x 1 | 300.000 | 500.0 | 0.9000 | one | 1.000 | 1.000 | – |" in text
    # each run's epoch log, with the stopping epoch marked, and the header facts
    assert "| 4 | 240.000 | 60.000 | 950.0 | 0.7800 | 1.1200 | 0.8800 | 2/2, stop |" in text
    assert "| 3 | 300.000 | 100.000 | 490.0 | 0.7700 | 1.1300 | 0.8700 | 2/2, stop |" in text
    assert "| Epoch | Cumulative Time (s) | Epoch Time (s) | Images/sec | Train accuracy | Val loss |" in text
    for fact in (
        "| world size (processes) | 2 |",
        "| nodes | 1 |",
        "| GPUs per node | 2 |",
        "| backend | nccl |",
        "| device | cuda |",
        "| commit | abc1234 |",
    ):
        assert fact in text
    assert "node 0: [cuda:0 local_rank 0 = rank 0] [cuda:1 local_rank 1 = rank 1]" in text
    assert "ring: 0 -> 1 -> 0" in text


def test_topology_text_ranks_and_ring():
    text = topology_text(2, 4, "nccl", "cuda")
    assert (
        "node 1: [cuda:0 local_rank 0 = rank 4] [cuda:1 local_rank 1 = rank 5] [cuda:2 local_rank 2 = rank 6] "
        "[cuda:3 local_rank 3 = rank 7]" in text
    )
    assert "ring: 0 -> 1 -> 2 -> 3 => 4 -> 5 -> 6 -> 7 => 0" in text  # => crosses between nodes
    assert "world size 8" in text
    assert "no all-reduce" in topology_text(1, 1, "gloo", "cpu")


def test_no_one_process_run_means_no_speedup_columns(logs, tmp_path):
    runs = [read_run(logs["two"]), read_run(logs["four"])]
    path, _, _ = write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert "no 1-process run" in text
    assert "speedup" not in text.split("## Scaling")[1].split("\n\n")[1]  # the table has no speedup column
    assert "Karp-Flatt e" not in text


def test_runs_that_differ_are_not_compared_and_say_why(logs, tmp_path):
    other = write_log(tmp_path / "other.jsonl", 1, 2, TWO, target=0.9)
    runs = [read_run(logs["one"]), read_run(other)]
    sc, rows = rows_by_p(runs)
    assert sc.basis is None and "speedup" not in rows[2] and "karp_flatt" not in rows[2]
    path, _, _ = write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert (
        "**`other` is not compared with a 1-process run**: against `one` it differs in the stopping rule in force "
        "at the target (target_accuracy 0.85 vs 0.9), so no speedup, efficiency, Karp-Flatt or Amdahl is computed"
        in text
    )
    assert "Karp-Flatt e |" not in text


def scaling_cells(path) -> list[str]:
    """A shipped log's first cells in the scaling table, worked out here from the log itself: world size,
    nodes x per node, the Cumulative Time of the epoch where the target held for `patience` epochs in a row (or
    "not reached"), the mean of the epochs' images/sec, the last epoch's accuracy. A resumed run's log repeats
    the epochs from the one it resumed in: the later record of an epoch counts."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    header = records[0]
    epochs = sorted({r["epoch"]: r for r in records if r["kind"] == "epoch"}.values(), key=lambda r: r["epoch"])
    target, patience = header["recipe"]["target_accuracy"], header["recipe"]["patience"]
    streak, reached = 0, []
    for e in epochs:
        streak = streak + 1 if e["val_accuracy"] >= target else 0
        reached += [e] if streak >= patience else []
    return [
        str(header["world_size"]),
        f"{header['num_nodes']} x {header['num_gpus']}",
        f"{reached[0]['cumulative_time']:.3f}" if reached else "not reached",
        f"{sum(e['images_per_sec'] for e in epochs) / len(epochs):.1f}",
        f"{epochs[-1]['val_accuracy']:.4f}",
    ]


@pytest.mark.slow
def test_the_gpu_and_cpu_logs_of_this_project_get_no_speedup(tmp_path):
    """h200-fast (1 H200 GPU, an older fast.yaml) and fast8 (2 CPU processes): no pair, and the report says why;
    fast8's row holds only what its own log gives (scaling_cells), no speedup columns."""
    out = tmp_path / "out"
    result = run_report(RUNS / "h200-fast.jsonl", RUNS / "fast8.jsonl", "--out", out, "--no-figures")
    assert result.returncode == 0, result.stderr
    text = (out / "report.md").read_text()
    section = text.split("## Scaling")[1].split("## Demonstrate 1")[0]
    assert f"| fast8 | {' | '.join(scaling_cells(RUNS / 'fast8.jsonl'))} |\n" in section
    assert "speedup" not in section.split("\n\n")[1]
    assert (
        "differs in recipe (base_lr, batch_size, bn_lr_scale, bn_recalibration, label_smoothing); device (cuda vs "
        "cpu), so no speedup, efficiency, Karp-Flatt or Amdahl is computed" in section
    )
    assert "Karp-Flatt e" not in text and "Amdahl S(" not in text


def test_a_comparable_pair_among_others_is_compared_and_a_slowdown_is_flagged(logs, tmp_path):
    """A GPU run of the same recipe is left alone; the two CPU runs are compared, and the 2-process one is
    slower: S = 400 / 500 = 0.8 < 1, E = 0.4, e = (1/0.8 - 1/2) / (1/2) = 1.5 (outside [0, 1]: no Amdahl)."""
    cpu = dict(backend="gloo", device="cpu")
    one = write_log(tmp_path / "cpu1.jsonl", 1, 1, [(10.0, 500.0, 0.5)], **cpu)
    two = write_log(tmp_path / "cpu2.jsonl", 1, 2, [(10.0, 400.0, 0.5)], **cpu)
    runs = [read_run(logs["one"]), read_run(one), read_run(two)]
    sc, _ = rows_by_p(runs)
    row = {r["run"].label: r for r in sc.rows}
    assert row["cpu2"]["reference"].label == "cpu1" and sc.basis == "throughput"
    assert abs(row["cpu2"]["speedup"] - 0.8) < EXACT and abs(row["cpu2"]["efficiency"] - 0.4) < EXACT
    assert abs(row["cpu2"]["karp_flatt"] - 1.5) < EXACT and "amdahl" not in row["cpu2"]
    assert "speedup" not in row["one"]  # the GPU run is no one's reference
    text = write_report(runs, tmp_path / "out", figures=False)[0].read_text()
    assert "| cpu2 | 2 | 1 x 2 | not reached | 400.0 | 0.5000 | cpu1 | 0.800 | 0.400 | 1.5000 | – | – | – |" in text
    assert "| one | 1 | 1 x 1 | 300.000 | 500.0 | 0.9000 | none comparable | – |" in text
    assert "**Flag: `cpu2` is slower than `cpu1`** (speedup 0.800 < 1)" in text
    assert "**Flag: `cpu2`'s serial fraction e = 1.5000 is outside [0, 1]**" in text


def test_profile_table(tmp_path):
    prof = [
        (
            10.0,
            100.0,
            0.5,
            {"data": 1.0, "forward": 3.0, "backward": 5.0, "comm_estimate": 1.0, "note": "text is ignored"},
        ),
        (10.0, 100.0, 0.6, {"data": 3.0, "forward": 3.0, "backward": 5.0, "comm_estimate": 1.0}),
    ]
    run = read_run(write_log(tmp_path / "p.jsonl", 1, 1, prof))
    assert profile_parts(run.epochs) == {"data": 2.0, "forward": 3.0, "backward": 5.0, "comm_estimate": 1.0}
    path, _, _ = write_report([run], tmp_path / "out", figures=False)
    assert "| p | 2.000 | 3.000 | 5.000 | 1.000 | 11.000 |" in path.read_text()


# ----------------------------------------------------------------------------- figures, with and without matplotlib

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_figures_are_written(logs, tmp_path):
    pytest.importorskip("matplotlib")  # the `plot` extra; CI installs it with the test extra
    prof = [
        (10.0, 100.0, 0.5, {"data": 1.0, "forward": 3.0, "backward": 5.0}),
        (10.0, 100.0, 0.6, {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 0.5}),
    ]
    profiled = write_log(tmp_path / "prof.jsonl", 1, 1, prof)
    out = tmp_path / "out"
    result = run_report(logs["one"], logs["two"], logs["four"], profiled, "--out", out)
    assert result.returncode == 0, result.stderr
    names = {
        "accuracy_vs_time.png",
        "images_per_sec.png",
        "profile.png",
        "topology_1x1_nccl_cuda.png",
        "topology_1x2_nccl_cuda.png",
        "topology_2x2_nccl_cuda.png",
    }
    assert {p.name for p in out.glob("*.png")} == names
    for name in names:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG), name
    text = (out / "report.md").read_text()
    for name in names:
        assert f"]({name})" in text, name
    assert "skipped" not in text
    assert f"wrote {out / 'report.md'} and 6 figure(s)" in result.stdout


@pytest.mark.slow
def test_report_without_matplotlib(logs, tmp_path):
    """matplotlib made unimportable (None in sys.modules): the tables are still written, with a note."""
    out = tmp_path / "out"
    code = (
        "import sys; sys.modules['matplotlib'] = None; from cifar_wrn.report.cli import main; "
        f"sys.exit(main([{str(logs['one'])!r}, {str(logs['two'])!r}, '--out', {str(out)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "figures skipped: matplotlib is missing" in result.stdout
    text = (out / "report.md").read_text()
    assert "Figures skipped: matplotlib is missing" in text
    assert "| two | 2 | 1 x 2 | 240.000 | 950.0 |" in text  # the scaling table
    assert "| 1 | 100.000 | 100.000 | 500.0 |" in text  # an epoch table
    assert "ring: 0 -> 1 -> 0" in text  # the text topology
    assert "![" not in text and not list(out.glob("*.png"))


def test_report_without_matplotlib_in_process(logs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert load_matplotlib() is None
    path, figures, skipped = write_report([read_run(logs["one"])], tmp_path / "out")
    assert figures == [] and "matplotlib is missing" in skipped
    assert "Figures skipped" in path.read_text()


# ----------------------------------------------------------------------------- bad input


def bad_inputs(tmp_path):
    good_header = {
        "kind": "header",
        "world_size": 1,
        "num_nodes": 1,
        "num_gpus": 1,
        "backend": "gloo",
        "device": "cpu",
        "recipe": {"target_accuracy": 0.85, "patience": 2},
    }
    files = {
        "missing": (tmp_path / "nope.jsonl", "no such file"),
        "folder": (tmp_path, "a folder without log.jsonl: give a run log or a run folder that holds one"),
        "binary": (tmp_path / "weights.pt", "not a text file"),
        "not json": (tmp_path / "notes.jsonl", "line 1: not JSON"),
        # not named .jsonl and not starting with '{': a text log of printed lines (textlog.py), this one cut short
        "text cut short": (tmp_path / "notes.txt", "notes.txt, line 1: an epoch line without Epoch Time"),
        "no header": (tmp_path / "noheader.jsonl", "no header record"),
        "epoch first": (tmp_path / "epochfirst.jsonl", "line 1: an epoch record before the header"),
        "json list": (tmp_path / "list.json", "line 1: not a JSON object"),
        "empty": (tmp_path / "empty.jsonl", "no header record"),
        "bad header": (tmp_path / "badheader.jsonl", "lacks backend"),
        "bad epoch": (tmp_path / "badepoch.jsonl", "line 2: the epoch record lacks numeric val_accuracy"),
        "no recipe": (tmp_path / "norecipe.jsonl", "no recipe with target_accuracy and patience"),
    }
    (tmp_path / "weights.pt").write_bytes(b"\x80\x02\xff\xfe" * 100)
    (tmp_path / "notes.jsonl").write_text("Epoch =  1: Cumulative Time = 1.0\n")
    (tmp_path / "notes.txt").write_text("Epoch =  1: Cumulative Time = 1.0\n")
    (tmp_path / "noheader.jsonl").write_text(json.dumps({"loss": 1.0}) + "\n")
    (tmp_path / "epochfirst.jsonl").write_text(json.dumps({"kind": "epoch", "epoch": 1}) + "\n")
    (tmp_path / "list.json").write_text("[1, 2, 3]\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "badheader.jsonl").write_text(json.dumps({k: v for k, v in good_header.items() if k != "backend"}))
    (tmp_path / "badepoch.jsonl").write_text(
        json.dumps(good_header)
        + "\n"
        + json.dumps(
            {
                "kind": "epoch",
                "epoch": 1,
                "cumulative_time": 1.0,
                "epoch_time": 1.0,
                "images_per_sec": 1.0,
                "val_loss": 1.0,
            }
        )
        + "\n"
    )
    (tmp_path / "norecipe.jsonl").write_text(json.dumps({k: v for k, v in good_header.items() if k != "recipe"}))
    return files


@pytest.mark.slow
def test_bad_files_give_one_clear_line_and_exit_2(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for what, (path, message) in bad_inputs(logs).items():
        result = run_report(path, "--out", tmp_path / "out", timeout=60)
        assert result.returncode == 2, (what, result.stderr)
        assert result.stderr.startswith("error: ") and message in result.stderr, (what, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, what
    assert not (tmp_path / "out" / "report.md").exists()


def test_run_without_epochs_is_reported_not_fatal(logs, tmp_path):
    """A run that crashed before its first epoch still has a header: it is listed, without speedups."""
    empty = write_log(tmp_path / "crashed.jsonl", 1, 2, [])
    path, _, _ = write_report([read_run(logs["one"]), read_run(empty)], tmp_path / "out", figures=False)
    text = path.read_text()
    assert "| crashed | 2 | 1 x 2 | not reached | – | – |" in text
    assert "A run has no epoch records: no speedup columns." in text and "_No epoch records" in text


def test_read_run_rejects_inconsistent_header(tmp_path):
    path = write_log(tmp_path / "x.jsonl", 2, 2, ONE)
    path.write_text(path.read_text().replace('"world_size": 4', '"world_size": 3'))
    with pytest.raises(LogError, match="not num_nodes x num_gpus"):
        read_run(path)


# ----------------------------------------------------------------------------- a real log


@pytest.mark.slow
def test_report_reads_what_raw_ddp_writes(cifar_dir, tmp_path):
    log = tmp_path / "real.jsonl"
    result = raw_ddp(
        "--num-gpus",
        "1",
        *TINY,
        "--data-dir",
        cifar_dir,
        "--train-subset",
        64,
        "--val-subset",
        32,
        "--epochs",
        2,
        "--target-accuracy",
        0.0,
        "--patience",
        1,
        "--log-json",
        log,
    )
    assert result.returncode == 0, result.stderr
    run = read_run(log)
    assert run.world_size == 1 and len(run.epochs) == 1  # target 0 with patience 1: stops after epoch 1
    path, _, _ = write_report([run], tmp_path / "out", figures=False)
    text = path.read_text()
    assert f"| {run.epochs[0]['cumulative_time']:.3f} |" in text and "1/1, stop" in text
    assert "| backend | gloo |" in text and "| model width | 4 |" in text


# ----------------------------------------------------------------------------- resumed runs: one run per log

RUNS = REPO / "docs" / "runs"


def resumed_log(path, headers_before: dict, edits: dict | None = None):
    """A 1 x 2 run of ONE's epochs whose log has a header before epoch record i for each i in headers_before
    (i = 0: the start); a resume's header carries resumed_at = headers_before[i], as the trainers write it.
    edits: header entries to change in the header before record i ({i: {key: value}}), to make it another run."""
    lines = (
        write_log(
            path,
            1,
            2,
            ONE,
            train_accuracy=False,
            model_width=160,
            train_images=50000,
            val_images=10000,
            resumed_at=None,
        )
        .read_text()
        .splitlines()
    )
    header, records = json.loads(lines[0]), lines[1:]
    out = []
    for i, record in enumerate(records + [None]):
        if i in headers_before:
            h = dict(header, resumed_at=headers_before[i], **(edits or {}).get(i, {}))
            h["recipe"] = dict(header["recipe"], **h.pop("recipe_edits", {}))
            out.append(json.dumps(h))
        if record:
            out.append(record)
    path.write_text("\n".join(out) + "\n")
    return path


def test_a_run_resumed_twice_is_one_run_with_continuing_cumulative_time(tmp_path):
    # stopped in epoch 2 at step 40, then again at the end of epoch 3 (resumed at epoch 4, step 0)
    path = resumed_log(tmp_path / "resumed.jsonl", {0: None, 1: {"epoch": 2, "step": 40}, 3: {"epoch": 4, "step": 0}})
    assert path.read_text().count('"kind": "header"') == 3
    run = read_run(path)
    assert [s.line for s in run.segments] == [1, 3, 6] and [s.line for s in run.resumes] == [3, 6]
    assert [e["epoch"] for e in run.epochs] == [1, 2, 3, 4]
    assert [e["cumulative_time"] for e in run.epochs] == [100.0, 200.0, 300.0, 400.0]
    assert time_to_target(run.epochs, run.target, run.patience) == 300.0 and run.notes == []
    out, _, _ = write_report([run], tmp_path / "out", figures=False)
    text = out.read_text()
    assert (
        "| resumed | 2 times: at epoch 2 step 40 (line 3, commit abc1234); at epoch 4 step 0 (line 6, commit "
        "abc1234); Cumulative Time continues across the resumes" in text
    )
    # a log made before training accuracy was counted: its column says so ("–"), nothing is invented
    assert "| 3 | 300.000 | 100.000 | 490.0 | – | 1.1300 | 0.8700 | 2/2, stop |" in text
    assert "| 4 | 400.000 |" in text


def test_a_resume_from_an_older_checkpoint_replaces_the_epochs_trained_again(tmp_path):
    """Epochs 1-3 logged, then a resume at epoch 3 (its checkpoint was older): the later epoch 3 counts."""
    path = resumed_log(tmp_path / "again.jsonl", {0: None})
    lines = path.read_text().splitlines()
    again = json.loads(lines[3])
    again.update(val_accuracy=0.80, val_loss=1.2)  # the retrained epoch 3 is worse: the streak restarts
    header = dict(json.loads(lines[0]), resumed_at={"epoch": 3, "step": 0})
    path.write_text("\n".join(lines[:4] + [json.dumps(header), json.dumps(again)]) + "\n")
    run = read_run(path)
    assert [(e["epoch"], e["val_accuracy"]) for e in run.epochs] == [(1, 0.5), (2, 0.86), (3, 0.80)]
    assert run.notes and "line 5 resumes at epoch 3 step 0, before epoch(s) 3 already logged" in run.notes[0]
    assert time_to_target(run.epochs, run.target, run.patience) is None


@pytest.mark.parametrize(
    "what, headers, edits, message",
    [
        (
            "a new run appended",
            {0: None, 2: None},
            None,
            "line 4: a second header without resumed_at: a new run starts here, not a resume of the run of line 1",
        ),
        (
            "other processes",
            {0: None, 2: {"epoch": 3, "step": 0}},
            {2: {"world_size": 4, "num_nodes": 2}},
            "line 4: this header is not a resume of the run of line 1 (the checkpoint was written by 2 processes, "
            "this run has 4",
        ),
        (
            "another recipe",
            {0: None, 2: {"epoch": 3, "step": 0}},
            {2: {"recipe_edits": {"batch_size": 64}}},
            "line 4: this header is not a resume of the run of line 1 (the recipe differs from the checkpoint's in "
            "batch_size (32 -> 64))",
        ),
        (
            "other data",
            {0: None, 2: {"epoch": 3, "step": 0}},
            {2: {"train_images": 10240}},
            "line 4: this header is not a resume of the run of line 1 (the checkpoint's run had train images = 50000, "
            "this run has 10240",
        ),
    ],
)
def test_two_different_runs_in_one_file_are_refused_naming_the_line(tmp_path, what, headers, edits, message):
    path = resumed_log(tmp_path / "two.jsonl", headers, edits)
    with pytest.raises(LogError) as refused:
        read_run(path)
    assert str(refused.value).startswith(f"{path}, ") and message in str(refused.value), what
    assert str(refused.value).endswith("; one run per file"), what


@pytest.mark.slow
def test_two_runs_in_one_file_end_in_one_error_line(tmp_path):
    path = resumed_log(
        tmp_path / "two.jsonl", {0: None, 2: {"epoch": 3, "step": 0}}, {2: {"recipe_edits": {"base_lr": 0.1}}}
    )
    result = run_report(path, "--out", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr == (
        f"error: {path}, line 4: this header is not a resume of the run of line 1 (the recipe "
        f"differs from the checkpoint's in base_lr (0.01 -> 0.1)); one run per file\n"
    )
    assert not (tmp_path / "out").exists()


def test_epochs_going_back_without_a_resume_are_refused(tmp_path):
    path = write_log(tmp_path / "x.jsonl", 1, 1, ONE)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines[1:3]) + "\n")  # epochs 1-4, then 1 and 2 again with no header
    with pytest.raises(LogError, match=r"line 6: epoch 1 after epoch 4 with no resume between them"):
        read_run(path)


def test_a_resume_may_change_the_stopping_rule_and_a_key_newer_than_the_first_header(tmp_path):
    """What the trainers accept as a resume is one run: patience may change (RESUMABLE_CHANGES), and a
    recipe key the first header lacks had its default then (fast6noaug.jsonl: crop_padding, bn_lr_scale)."""
    path = resumed_log(
        tmp_path / "r.jsonl",
        {0: None, 2: {"epoch": 3, "step": 0}},
        {2: {"recipe_edits": {"patience": 1, "crop_padding": 4}}},
    )
    run = read_run(path)
    assert run.patience == 1 and len(run.epochs) == 4  # the rule the run ended with
    # each epoch under the rule in force when it was logged, as the trainers stopped: epoch 2 (0.86) was one of
    # 2 in a row; the resumed run's epoch 3 (0.87) meets patience 1 (the final rule alone would say epoch 2)
    assert time_to_target(run.epochs, *run.rules) == 300.0


def test_data_partitioning_of_an_accelerate_dataloader_run_is_accelerates_not_the_samplers(tmp_path):
    """accel_train.py's DataLoader path has no DistributedSampler: Accelerate cuts the shuffled loader's batches
    (the short last one dropped) and deals them out, rank r taking batches r, r + W, ... (a last incomplete
    round of W dropped too); validation batches the same way, a last short round completed by repeats that
    gather_for_metrics drops. 50,000 / 32 = 1,562 batches: 781 per rank, 16 images unused; 10,000 / 500 = 20."""
    recipe = {"target_accuracy": 0.85, "patience": 2, "batch_size": 32, "data_pipeline": "dataloader"}
    log = write_log(
        tmp_path / "accel.jsonl", 1, 2, TWO, trainer="accelerate", val_images=10000, per_device_batch_size=32
    )
    log.write_text(log.read_text().replace('"batch_size": 32}', json.dumps(recipe)[1:]))
    text = write_report([read_run(log)], tmp_path / "out", figures=False)[0].read_text()
    assert (
        "| accel | train | 50000 | 2 | 24992 | 0 | none | 781 x 32 (16 unused: the short batch and the last round) |"
        in (text)
    ), text[text.index("Demonstrate 2") : text.index("Demonstrate 3")]
    assert "| accel | validation | 10000 | 2 | 5000 | 0 | none | – |" in text
    assert "Accelerate's prepare() (A1.5)" in text
    raw = write_log(tmp_path / "raw.jsonl", 1, 2, TWO, val_images=10000, per_device_batch_size=32)
    text = write_report([read_run(raw)], tmp_path / "out_raw", figures=False)[0].read_text()
    assert "| raw | train | 50000 | 2 | 25000 | 0 | none | 781 x 32 (8 dropped) |" in text


@pytest.mark.parametrize(
    "n, world, batch, drop_last",
    [(50000, 2, 32, True), (101, 2, 32, True), (320, 3, 32, True), (101, 2, 32, False), (1000, 3, 128, False)],
)
def test_accelerate_shards_is_what_accelerates_batch_sampler_shard_deals(n, world, batch, drop_last):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(n)), batch, drop_last=drop_last)
    ranks = [list(BatchSamplerShard(batches, num_processes=world, process_index=r)) for r in range(world)]
    images = [[i for b in rank for i in b] for rank in ranks]
    seen = [i for rank in images for i in rank]
    dealt = accelerate_shards(n, world, batch, drop_last)
    assert (dealt["shard"], dealt["steps"]) == (max(map(len, images)), len(ranks[0]))
    assert dealt["padding"] == len(seen) - len(set(seen)) and dealt["unused"] == n - len(set(seen))
    repeats = [r for r in range(world) if any(seen.index(i) < sum(map(len, images[:r])) for i in images[r])]
    assert dealt["padded_ranks"] == repeats


def test_no_quoted_code_box_is_empty_and_demonstrate_3_quotes_the_ddp_wrap():
    """Every code box of the committed example quotes lines of raw_ddp.py; Demonstrate 3 shows the whole
    `model = DDP(...)` statement, however the formatter splits it, with the GPU it is given."""
    text = (EXAMPLE / "report.md").read_text()
    assert "(no such tagged line" not in text
    section = text[text.index("Demonstrate 3") : text.index("Demonstrate 4")]
    wrap = statement_lines("= DDP(")
    assert wrap[0].split(": ", 1)[1].startswith("model = DDP(") and wrap[-1].split("  #")[0].endswith(")")
    assert all(line in section for line in wrap) and any("device_ids=" in line for line in wrap)


def test_a_resume_with_a_lower_target_is_met_where_the_trainer_stopped(tmp_path):
    """Epochs 1-2 under target 0.9 (0.50, 0.86: no stop); resumed at epoch 3 under 0.85: the trainer stops at
    epoch 3 (its last two, 0.86 and 0.87, >= 0.85), not at epoch 2, where 0.9 was in force."""
    path = resumed_log(
        tmp_path / "r.jsonl",
        {0: None, 2: {"epoch": 3, "step": 0}},
        {0: {"recipe_edits": {"target_accuracy": 0.9}}},
    )
    run = read_run(path)
    assert run.rules == ([0.9, 0.9, 0.85, 0.85], [2, 2, 2, 2])
    assert stopping_epoch([e["val_accuracy"] for e in run.epochs], *run.rules) == 2
    text = write_report([run], tmp_path / "out", figures=False)[0].read_text()
    assert "| 3 | 300.000 | 100.000 | 490.0 | – | 1.1300 | 0.8700 | 2/2, stop |" in text
    assert "| 2 | 200.000 | 100.000 | 510.0 | – | 1.1400 | 0.8600 |  |" in text  # 0.86 < 0.9 then


def resume_at(path, epoch: int, **recipe):
    """Insert into the log at `path`, before the record of `epoch`, the header a resume at the start of that
    epoch writes: the first header with resumed_at and the recipe keys given changed."""
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    resume = dict(header, resumed_at={"epoch": epoch, "step": 0}, recipe=dict(header["recipe"], **recipe))
    lines.insert(epoch, json.dumps(resume))
    path.write_text("\n".join(lines) + "\n")
    return path


# 1 process at patience 3: 0.86, 0.87, 0.90 from epoch 2 -> stops at epoch 4, T = 400 s.
# 2 processes: 0.50, 0.86 under patience 3, then resumed at epoch 3 under patience 1: 0.87 -> stops at epoch 3,
# T = 180 s. Compared, S = 400 / 180 = 2.22 on p = 2 (superlinear), but only because it stopped under a laxer rule.
PATIENT = [(60.0, 900.0, 0.50), (60.0, 950.0, 0.86), (60.0, 1000.0, 0.87), (60.0, 950.0, 0.90)]


def test_runs_whose_rule_in_force_at_the_target_differs_are_not_compared_and_say_why(tmp_path):
    """Both logs start with the same recipe (patience 3), but the 2-process run was resumed under patience 1 and
    met that: their times to target measure different rules, so no speedup, and one line says which."""
    one = write_log(tmp_path / "one.jsonl", 1, 1, ONE, patience=3)
    two = resume_at(write_log(tmp_path / "two.jsonl", 1, 2, PATIENT, patience=3), 3, patience=1)
    runs = [read_run(one), read_run(two)]
    assert runs[1].rules == ([0.85] * 4, [3, 3, 1, 1])
    sc, rows = rows_by_p(runs)
    assert rows[1]["time_to_target"] == 400.0 and rows[2]["time_to_target"] == 180.0
    assert sc.basis is None and "speedup" not in rows[2] and "karp_flatt" not in rows[2]
    text = write_report(runs, tmp_path / "out", figures=False)[0].read_text()
    assert (
        "**`two` is not compared with a 1-process run**: against `one` it differs in the stopping rule in force "
        "at the target (patience 3 vs 1), so no speedup, efficiency, Karp-Flatt or Amdahl is computed" in text
    )
    assert "Karp-Flatt e |" not in text


def test_a_resume_that_brings_the_rule_in_line_is_compared_under_the_rule_in_force(tmp_path):
    """The 2-process run started at patience 1 but was resumed at epoch 2 under patience 3, the 1-process run's
    rule, before it met either: it stopped under patience 3 at epoch 4 (T = 240 s), so the pair is compared:
    S = 400 / 240 on p = 2."""
    one = write_log(tmp_path / "one.jsonl", 1, 1, ONE, patience=3)
    two = resume_at(write_log(tmp_path / "two.jsonl", 1, 2, PATIENT, patience=1), 2, patience=3)
    sc, rows = rows_by_p([read_run(one), read_run(two)])
    assert sc.basis == "time" and rows[2]["reference"].label == "one"
    assert abs(rows[2]["speedup"] - 400.0 / 240.0) < EXACT


def test_the_committed_resumed_logs_are_each_one_run():
    """The project's own proof runs, resumed once or twice on a CPU machine (docs/runs/README.md)."""
    resumes = {
        "fast8": ["epoch 3 step 60"],
        "fast7": ["epoch 4 step 10", "epoch 4 step 180"],
        "fast6noaug": ["epoch 4 step 30"],
        "fast4": ["epoch 1 step 97", "epoch 3 step 10"],
        "fast4b128": ["epoch 1 step 90"],
    }
    for name, where in resumes.items():
        run = read_run(RUNS / f"{name}.jsonl")
        assert [s.where() for s in run.resumes] == where, name
        assert [e["epoch"] for e in run.epochs] == [1, 2, 3, 4] and not run.notes, name
        times = [e["cumulative_time"] for e in run.epochs]
        assert times == sorted(times) and times[-1] > 7000, name


@pytest.mark.slow
def test_report_on_run_8_shows_all_four_epochs_and_the_criterion_at_7560(tmp_path):
    result = run_report(RUNS / "fast8.jsonl", "--out", tmp_path, "--no-figures")
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "report.md").read_text()
    for row in (
        "| 1 | 1844.956 | 1844.956 | 27.1 | – | 0.8511 | 0.7540 |  |",
        "| 2 | 3726.691 | 1881.734 | 26.5 | – | 0.6629 | 0.8231 |  |",
        "| 3 | 5629.463 | 1902.772 | 26.2 | – | 0.5846 | 0.8503 | 1/2 |",
        "| 4 | 7560.028 | 1930.565 | 25.9 | – | 0.5483 | 0.8656 | 2/2, stop |",
    ):
        assert row in text, row
    assert "| fast8 | 2 | 1 x 2 | 7560.028 |" in text  # the scaling table's Cumulative Time to target
    assert "| resumed | once: at epoch 3 step 60 (line 4, started 2026-12-01T06:27:38+0000, commit f01bc54)" in text
    run = read_run(RUNS / "fast8.jsonl")
    assert round(time_to_target(run.epochs, run.target, run.patience), 1) == 7560.0


# ----------------------------------------------------------------------------- the course's PDF (R3)


def r1_tags(source) -> dict[str, list[int]]:
    """The lines of each `# R1.<n>` step, read here independently of cifar_wrn/report/: every R1.<n> in
    the comment that starts at a '# R1.' on the line."""
    tags = {}
    for number, line in enumerate(source.read_text().splitlines(), 1):
        if "# R1." in line:
            for n in re.findall(r"R1\.(\d+)", line[line.index("# R1.") :]):
                tags.setdefault(f"R1.{n}", []).append(number)
    return tags


def test_ddp_steps_are_read_from_the_tags(tmp_path):
    source = tmp_path / "code.py"
    source.write_text(
        'import x\ndef f():  # R1.1\n    y = 1  # R1.10: one\n    # R1.2, R1.3 and R1.1 here\n    s = "# R1.<n>"\n'
    )
    steps = ddp_steps(source)
    assert steps == [("R1.1", [2, 4]), ("R1.2", [4]), ("R1.3", [4]), ("R1.10", [3])]
    assert where_text("raw_ddp.py", [2, 4]) == "raw_ddp.py:2,4"
    assert code_lines("R1.1", source=source) == ["2: def f():  # R1.1"]  # the comment-only line 4 left out
    shipped = ddp_steps()
    assert dict(shipped) == r1_tags(REPO / "raw_ddp.py") and len(shipped) == 11


def pdf_text(path) -> tuple[int, str, int]:
    """(pages, text, images) of a PDF, read back with pypdf."""
    pypdf = pytest.importorskip("pypdf")
    reader = pypdf.PdfReader(path)
    images = 0
    for page in reader.pages:
        xobjects = page["/Resources"].get("/XObject")
        images += sum(1 for x in (xobjects or {}).values() if x.get_object()["/Subtype"] == "/Image")
    return len(reader.pages), "\n".join(page.extract_text() for page in reader.pages), images


@pytest.mark.slow
def test_pdf_holds_what_the_course_asks_for_in_at_most_4_pages(tmp_path):
    pytest.importorskip("fpdf")  # the `pdf` extra; CI installs it with the test extra
    pytest.importorskip("matplotlib")
    notes = tmp_path / "notes.yaml"
    notes.write_text(
        "optimisations:\n  bn_recalibration: my own words on recalibration\nsteps:\n  R1.7: my pinning words\n"
    )
    pdf = tmp_path / "report.pdf"
    result = run_report(
        RUNS / "h200-fast.jsonl",
        RUNS / "fast8.jsonl",
        "--out",
        tmp_path / "out",
        "--pdf",
        pdf,
        "--notes",
        notes,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    pages, text, images = pdf_text(pdf)
    assert f"wrote {pdf} ({pages} pages)" in result.stdout
    assert pages <= 4 and images >= 2  # the accuracy figure and the topology diagram
    # 2: the epoch log exactly as printed (the trainers' lines), then the Cumulative Time at the criterion
    printed = [
        "Epoch =  1: Cumulative Time = 1844.956, Epoch Time = 1844.956, Images/sec = 27.1, Validation Loss = "
        "0.851, Validation Accuracy = 0.754",
        "Epoch =  4: Cumulative Time = 7560.028, Epoch Time = 1930.565, Images/sec = 25.9, Validation Loss = "
        "0.548, Validation Accuracy = 0.866",
        "Early stopping after epoch 4",
    ]
    lines = text.splitlines()
    for line in printed:
        assert line in lines, line
    assert lines.index(printed[0]) < lines.index(printed[1]) < lines.index(printed[2])
    assert "resumed at epoch 3 step 60 (log line 4)" in text
    flat = " ".join(text.split())
    # the whole command on page 1 (the footer only points there); every figure of report.md not in the PDF named
    assert f"Made by: python -m cifar_wrn.report {RUNS / 'h200-fast.jsonl'} {RUNS / 'fast8.jsonl'}" in flat
    assert f"--pdf {pdf} --notes {notes}" in flat and flat.count("(the command: page 1)") == pages
    shown = ("accuracy_vs_time.png", "topology_1x2_gloo_cpu.png")  # fast8's: the featured run (2 processes)
    left_out = sorted(p.name for p in (tmp_path / "out").glob("*.png") if p.name not in shown)
    assert left_out == ["images_per_sec.png", "topology_1x1_nccl_cuda.png"] and images == 2
    assert f"Not in this PDF (the course's 4 pages), in {tmp_path / 'out'} with report.md: " in flat
    assert all(name in flat.split("with report.md: ")[1][:300] for name in left_out), left_out
    assert "Cumulative Time at the criterion: 7560.028 s, after epoch 4" in flat
    # 3: a GPU run and a CPU run of other recipes: no speedup, and why
    for name in ("h200-fast", "fast8"):
        assert " ".join([name, *scaling_cells(RUNS / f"{name}.jsonl")]) in flat, name
    assert "fast8 is not compared with a 1-process run: against h200-fast it differs in recipe" in flat
    assert "Karp-Flatt e" not in flat
    # 1: each step's file:line as tagged in the shipped raw_ddp.py, the why the student's
    tags = r1_tags(REPO / "raw_ddp.py")
    for step, numbers in tags.items():
        why = "my pinning words" if step == "R1.7" else f"[you write: why {step} is needed]"
        assert f"{step} raw_ddp.py:{','.join(map(str, numbers))} {why}" in flat, step
    # Demonstrate 1-6, each with its slot; the R1.9 lines quoted as they stand
    source = (REPO / "raw_ddp.py").read_text().splitlines()
    for n in tags["R1.9"]:
        if not source[n - 1].lstrip().startswith("#"):
            assert f"{n}: {source[n - 1].strip()}" in text, n
    for item, what in EXPLAIN.items():
        assert f"[you write: {what}]" in flat, item
    # 6: the optimisations: key, baseline, used; the why a slot, or the student's from --notes
    assert "bn_recalibration 0 5000 my own words on recalibration" in flat
    changed = optimisations(read_run(RUNS / "fast8.jsonl"))
    # fast8 against today's baseline (the course script's): momentum is the same now (0.9), normalization and
    # augmentation (the course's vs crop and flip, unused as augment is off) differ
    assert len(changed) == 22 and ("lr_schedule", "constant", "warmup_linear") in changed
    assert ("normalization", "course", "cifar") in changed and not any(k == "momentum" for k, *_ in changed)
    for key, baseline, used in changed:
        if key != "bn_recalibration":
            assert f"{key} {baseline} {used} [you write: why]" in flat, key


def test_pdf_column_widths_share_the_page_by_content():
    """Widths in proportion to each column's text, none under its widest word, summing to the page's width."""
    from cifar_wrn.report.columns import column_widths, share_widths

    assert share_widths([10.0, 30.0], [0.0, 0.0], 80.0, minimum=0.0) == [20.0, 60.0]
    held = share_widths([1.0, 100.0, 99.0], [15.0, 0.0, 0.0], 100.0, minimum=5.0)
    assert held[0] == 15.0 and abs(sum(held) - 100.0) < EXACT and abs(held[1] / held[2] - 100 / 99) < EXACT
    assert share_widths([10.0, 10.0], [60.0, 60.0], 100.0) == [50.0, 50.0]  # the floors do not fit: shrunk alike
    fpdf = pytest.importorskip("fpdf")
    pdf = fpdf.FPDF(format="A4", unit="mm")
    pdf.add_page()
    where = "raw_ddp.py:" + ",".join(map(str, range(100, 130)))
    columns = [[("step", "B"), ("R1.1", "")], [("where", "B"), (where, "")], [("why", "B"), ("a why " * 40, "I")]]
    widths = column_widths(pdf, columns, 7.5)
    pdf.set_font("Helvetica", "", 7.5)
    assert abs(sum(widths) - pdf.epw) < 1e-6 and widths[1] > pdf.get_string_width(where)  # one line: no break
    assert widths[2] > widths[0]  # the long text gets the room


def test_a_crowded_pdf_table_keeps_every_word_whole():
    """The scaling table of runs named as the trainers name them: 13 columns whose widest words do not fit side by
    side at the table's size. The words drawn (fpdf's uncompressed text operators) are the words given: none is
    broken across lines ("processe s", "Amda hl" before); the table is set smaller instead."""
    import re

    pytest.importorskip("fpdf")
    from cifar_wrn.report.pdf import Layout, _document, _table, load_fpdf

    pdf = _document(load_fpdf())
    pdf.set_compression(False)
    head = ["run", "processes (world size)", "nodes x per node", "Cumulative Time to target (s)", "mean Images/sec"]
    head += [
        "final val accuracy",
        "compared with",
        "speedup (images/sec)",
        "efficiency",
        "Karp-Flatt serial fraction e",
    ]
    head += ["Amdahl S(2)", "Amdahl S(4)", "Amdahl S(8)"]
    row = ["baseline-2x4-20261207-060608", "8", "2x4", "not reached", "10956.8", "0.8629"]
    row += ["baseline-1x1-20261207-060608", "1.215", "0.608", "0.6459", "1.215", "1.362", "1.449"]
    lay = Layout(compact=True)
    _table(pdf, lay, head, [row], size=lay.table - 0.7)
    drawn = [
        text.replace(rb"\(", b"(").replace(rb"\)", b")") for text in re.findall(rb"\((.*?)\) ?Tj", bytes(pdf.output()))
    ]
    words = {word for text in drawn for word in text.decode("latin-1").split()}
    assert {word for cell in head + row for word in cell.split()} - words == set()


def test_the_sections_and_steps_carry_the_course_item_they_answer(logs):
    """Layouts find a requirement's section by its id, and a slot by its type, never by the words."""
    from cifar_wrn.report.content import Slot, Table
    from cifar_wrn.report.demonstrate import demonstrate
    from cifar_wrn.report.tables import steps

    sections = demonstrate([read_run(logs["two"])], {"steps": {"R1.7": "mine"}}, [])
    assert [s.id for s in sections] == ["D1", "D2", "D3", "D4", "D5", "D6"]
    shown = steps({"steps": {"R1.7": "mine"}})
    assert [(s.id, s.lines) for s in shown] == ddp_steps()
    assert all(isinstance(s.why, Slot) and s.why.written == (s.id == "R1.7") for s in shown)
    optimisations_table = [b for b in sections[-1].blocks if isinstance(b, Table)]
    assert all(isinstance(row[-1], Slot) for table in optimisations_table for row in table.rows)


@pytest.mark.slow
def test_pdf_without_fpdf2_says_how_to_install_it(logs, tmp_path):
    code = (
        "import sys; sys.modules['fpdf'] = None; from cifar_wrn.report.cli import main; "
        f"sys.exit(main([{str(logs['one'])!r}, '--out', {str(tmp_path / 'out')!r}, '--pdf', 'r.pdf']))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (
        "error: --pdf needs the fpdf2 package, which is not installed: pip install fpdf2, or pip install -e '.[pdf]'\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ("bogus:\n  x: y\n", "expected steps: {R1.<n>: why}, explain: {topology, "),
        ("optimisations:\n  bogus: x\n", "optimisations: 'bogus' is not one of epochs, batch_size, base_lr, "),
        ("steps:\n  R1.99: x\n", "steps: 'R1.99' is not one of R1.1, R1.2, "),
        ("explain:\n  topology: ''\n", "explain: topology: expected your text"),
        ("explain:\n  - a list\n", "explain: expected KEY: TEXT entries"),
        ("a: [\n", "cannot be read as YAML at line 2 ("),  # PyYAML's own words follow
    ],
)
def test_bad_notes_are_refused(tmp_path, content, message):
    notes = tmp_path / "notes.yaml"
    notes.write_text(content)
    runs = [read_run(RUNS / "fast8.jsonl")]
    with pytest.raises(UserError) as refused:
        read_notes(notes, runs)
    assert str(refused.value).startswith(f"--notes {notes}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value)
    assert read_notes(None, runs) == {}


@pytest.mark.slow
def test_bad_notes_are_refused_before_any_output(tmp_path):
    notes = tmp_path / "notes.yaml"
    notes.write_text("bogus:\n  why: x\n")
    result = run_report(RUNS / "fast8.jsonl", "--out", tmp_path / "out", "--notes", notes)
    assert result.returncode == 2 and result.stderr.startswith(f"error: --notes {notes}: expected steps:")
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_notes_fill_the_slots_they_name_and_leave_the_others_marked(logs, tmp_path):
    notes = tmp_path / "notes.yaml"
    notes.write_text("steps:\n  R1.6: my set_epoch words\nexplain:\n  aggregation: |\n    my words\n    on SUM\n")
    runs = [read_run(logs["one"]), read_run(logs["two"])]
    assert (
        main(
            [str(logs["one"]), str(logs["two"]), "--out", str(tmp_path / "out"), "--no-figures", "--notes", str(notes)]
        )
        == 0
    )
    text = (tmp_path / "out" / "report.md").read_text()
    assert (
        f"| R1.6 | raw_ddp.py:{','.join(map(str, r1_tags(REPO / 'raw_ddp.py')['R1.6']))} | my set_epoch words |" in text
    )
    assert "**Explanation:** my words on SUM" in text and "[you write: why R1.6 is needed]" not in text
    assert "[you write: why R1.7 is needed]" in text and f"[you write: {EXPLAIN['scaling']}]" in text
    assert read_notes(notes, runs)["explain"] == {"aggregation": "my words on SUM"}


def test_caption_needs_pdf(logs, tmp_path, capsys):
    assert main([str(logs["one"]), "--out", str(tmp_path / "out"), "--caption", "x"]) == 2
    assert capsys.readouterr().err == "error: --caption is for the PDF: give --pdf FILE too\n"
    assert not (tmp_path / "out").exists()


def test_run_folders_are_read_as_their_log(logs, tmp_path):
    folder = tmp_path / "runs" / "baseline-1x2-20261202-130000"
    folder.mkdir(parents=True)
    (folder / "log.jsonl").write_text(logs["two"].read_text())
    out = tmp_path / "out"
    assert main([str(logs["one"]), str(folder), "--out", str(out), "--no-figures"]) == 0
    text = (out / "report.md").read_text()
    assert "| baseline-1x2-20261202-130000 | 2 | 1 x 2 | 240.000 | 950.0 | 0.8800 | one | 1.250 |" in text
    assert f"Log: `{folder / 'log.jsonl'}`" in text
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    with pytest.raises(LogError, match="a folder without log.jsonl"):
        read_run(empty)


def test_compare_fills_before_and_after_from_the_students_logs(logs, tmp_path):
    """Before: ONE's epochs with batch 32; after: batch 64 and 1.5 times the throughput, the target met sooner."""
    after = write_log(tmp_path / "after.jsonl", 1, 1, [(60.0, 750.0, 0.86), (60.0, 760.0, 0.87)])
    after.write_text(after.read_text().replace('"batch_size": 32', '"batch_size": 64'))
    other = write_log(tmp_path / "cpu.jsonl", 1, 2, TWO, device="cpu")
    out = tmp_path / "out"
    assert (
        main(
            [
                str(logs["two"]),
                "--out",
                str(out),
                "--no-figures",
                "--compare",
                str(logs["one"]),
                str(after),
                "--compare",
                str(logs["one"]),
                str(other),
            ]
        )
        == 0
    )
    text = (out / "report.md").read_text()
    assert f"**Before/after** (`--compare {logs['one']} {after}`):" in text
    assert "| before: one | batch_size: 32 -> 64 | 300.000 | 500.0 | 0.9000 | 4 |" in text
    assert "| after: after |  | 120.000 | 755.0 | 0.8700 | 2 |" in text
    assert "not like for like: they also differ in device (cuda vs cpu); world size (1 vs 2)" in text
    assert "[you measure:" not in text
    bare = write_report([read_run(logs["two"])], tmp_path / "bare", figures=False)[0].read_text()
    assert "**Before/after:** [you measure: pass the logs of a run without and with the change" in bare


def test_demonstrate_facts_from_the_header(tmp_path):
    """1001 images on 2 ranks: ceil = 501 each, 1 padded (rank 1 holds the repeat); batch 32: 15 steps, 21 left
    over; 17,117,754 fp32 parameters = 68,471,016 bytes = 65.3 MiB per step, buckets 1 + ceil(64.3 / 25) = 4,
    a ring sends 2 x 1/2 of them per rank; with --profile the measured all-reduce, 2 s of a 10 s epoch."""
    assert shards(1001, 2, 32) == {"shard": 501, "padding": 1, "padded_ranks": [1], "steps": 15, "dropped": 21}
    assert shards(10, 4, None)["padded_ranks"] == [2, 3]  # 3 each = 12: two repeats
    path = write_log(
        tmp_path / "two.jsonl",
        1,
        2,
        [(10.0, 400.0, 0.5)],
        train_images=1001,
        val_images=10,
        per_device_batch_size=32,
        model_parameters=17117754,
        steps_per_epoch=15,
    )
    path.write_text(path.read_text().replace('"val_accuracy": 0.5,', '"val_accuracy": 0.5, "comm_estimate": 2.0,'))
    assert '"comm_estimate": 2.0' in path.read_text()
    run = read_run(path)
    assert gradient_bytes(run) == (68471016, 4)
    text = write_report([run], tmp_path / "out", figures=False)[0].read_text()
    assert "| two | train | 1001 | 2 | 501 | 1 | 1 | 15 x 32 (21 dropped) |" in text
    assert "| two | validation | 10 | 2 | 5 | 0 | none | – |" in text
    assert "| two | 17117754 | fp32 | 65.3 MiB | ~4 | 65.3 MiB | 2.000 s/epoch (20.0% of the epoch) |" in text
    assert "| two | 1 | 400.0 | 200.0 | 1.5000 | 0.5000 |" in text  # SUM, SUM / N, AVG, AVG


EXAMPLE = REPO / "docs" / "report-example"


@pytest.mark.slow
def test_the_example_report_is_regenerated_by_its_documented_command(tmp_path):
    """docs/report-example/README.md's command, run into a fresh folder, writes the committed report.md."""
    pytest.importorskip("matplotlib")  # the committed report.md names its figures
    import shlex

    readme = EXAMPLE.joinpath("README.md").read_text()
    command = re.search(r"```bash\n(python -m cifar_wrn\.report .*?)\n```", readme, re.S).group(1)
    args = shlex.split(command.replace("\\\n", " "))
    assert args[args.index("--out") + 1] == "docs/report-example"
    args[args.index("--out") + 1] = str(tmp_path)
    for flag in ("--pdf", "--caption"):  # the PDF is not compared: leave it out
        if flag in args:
            del args[args.index(flag) : args.index(flag) + 2]
    result = subprocess.run([sys.executable, *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "report.md").read_text() == EXAMPLE.joinpath("report.md").read_text(), (
        "docs/report-example/report.md is stale: run the command in docs/report-example/README.md"
    )


@pytest.mark.slow  # report.main starts a process inside the project's code
def test_pdf_over_the_page_limit_is_compacted_then_flagged(tmp_path, monkeypatch, capsys):
    """Over the limit, the compact layout is tried; still over it, the PDF is written, then one line naming its
    longest sections, exit 2."""
    pytest.importorskip("fpdf")
    from cifar_wrn.report import pdf as report_pdf

    built = []
    build = report_pdf.build
    monkeypatch.setattr(report_pdf, "build", lambda *args: built.append(args[3]) or build(*args))
    monkeypatch.setattr(report_pdf, "MAX_PAGES", 1)
    pdf = tmp_path / "r.pdf"
    assert main([str(RUNS / "fast8.jsonl"), "--out", str(tmp_path / "out"), "--no-figures", "--pdf", str(pdf)]) == 2
    assert built == [False, True]  # normal, then compact
    pages, _, images = pdf_text(pdf)
    assert pages > 1 and images == 0  # --no-figures: the PDF says so instead
    out, err = capsys.readouterr()
    assert f"wrote {pdf} ({pages} pages)" in out
    assert f"error: --pdf {pdf}: {pages} pages, more than the course's 1; the longest sections: " in err


def test_printed_lines_of_a_run_the_safety_net_extended(tmp_path):
    """A 2-epoch budget with extra_epochs 1: epoch 2 passed after epoch 1 missed, the net fired there, epoch 3
    passed. The lines are what rank 0 printed: the net's note after epoch 2, the final line naming the extra
    epoch; a log that ends at the net's epoch (the run still going) has no final line yet."""
    path = write_log(tmp_path / "net.jsonl", 1, 2, [(60.0, 900.0, 0.80), (60.0, 950.0, 0.86), (60.0, 990.0, 0.87)])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[0]["recipe"].update(epochs=2, extra_epochs=1)
    records[2]["safety_net"] = {"budget": 2, "extra_epochs": 1, "streak": 1, "patience": 2}
    records[3]["extra_epoch"] = 1
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = printed_lines(read_run(path))
    assert len(lines) == 4 and lines[1].splitlines()[1].startswith("Safety net: the target was met 1 of 2")
    assert lines[-1] == "Early stopping after epoch 3 (1 safety-net epoch(s) after the 2-epoch budget)"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    assert len(printed_lines(read_run(path))) == 2


def test_the_example_notes_file_is_accepted_and_fills_its_slots(logs, tmp_path):
    notes = read_notes(EXAMPLE / "notes.yaml", [read_run(logs["two"])])
    assert set(notes) == {"steps", "explain"} and set(notes["explain"]) == set(EXPLAIN)
    text = write_report([read_run(logs["two"])], tmp_path / "out", figures=False, notes=notes)[0].read_text()
    assert f"[you write: {EXPLAIN['topology']}]" not in text and "[you write: why R1.1 is needed]" in text


def baseline_log(path, nodes, gpus, records, **recipe):
    """A log of recipes/baseline.yaml as a trainer writes its header (the whole recipe), with `recipe` changed."""
    from cifar_wrn.recipe import as_dict, load_recipe

    return write_log(path, nodes, gpus, records, recipe={**as_dict(load_recipe("baseline")), **recipe})


@pytest.mark.parametrize("smoke_first", [True, False])
def test_the_featured_run_is_the_two_process_run_of_the_comparable_pair(tmp_path, smoke_first):
    """A 1-epoch smoke run matched by the same glob as the reported pair is not featured, whatever the order of
    the logs, though it met its own (patience 1) criterion; the report says which run and why."""
    one = baseline_log(tmp_path / "baseline-1x1.jsonl", 1, 1, ONE, epochs=4)
    two = baseline_log(tmp_path / "baseline-1x2.jsonl", 1, 2, TWO, epochs=4)
    smoke = baseline_log(tmp_path / "baseline-1x2-smoke.jsonl", 1, 2, TWO[:1], epochs=1, patience=1)
    paths = [smoke, one, two] if smoke_first else [one, two, smoke]
    runs = [read_run(p) for p in paths]
    label_runs(runs)
    assert main_run(runs).path == two
    assert featured_text(runs) == (
        "The featured run (its epoch log and Demonstrate 6): `baseline-1x2`: 2 processes, compared with a "
        "1-process run of the same recipe, data, model and device, met the criterion; chosen over "
        "`baseline-1x2-smoke` (no comparable 1-process run)."
    )
    assert main([*map(str, paths), "--out", str(tmp_path / "out"), "--no-figures"]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert featured_text(runs) in text
    assert "The recipe keys where `baseline-1x2`'s recipe differs" in text or "`baseline-1x2` trained with" in text


def test_a_run_length_cap_under_a_constant_schedule_is_no_optimisation(tmp_path):
    """The baseline with --epochs 2: epochs only caps the run (constant LR), so Demonstrate 6 lists no optimisation
    and says the baseline recipe is unchanged; where epochs sets a schedule it is one."""
    capped = read_run(baseline_log(tmp_path / "capped.jsonl", 1, 2, TWO[:2], epochs=2, seed=3))
    assert optimisations(capped) == []
    assert recipe_changes(capped) == [("epochs", "40", "2"), ("seed", "0", "3")]
    scheduled = read_run(
        baseline_log(tmp_path / "scheduled.jsonl", 1, 2, TWO[:2], epochs=2, lr_schedule="warmup_linear")
    )
    assert optimisations(scheduled) == [("epochs", "40", "2"), ("lr_schedule", "constant", "warmup_linear")]
    assert main([str(tmp_path / "capped.jsonl"), "--out", str(tmp_path / "out"), "--no-figures"]) == 0
    text = " ".join((tmp_path / "out" / "report.md").read_text().split())
    assert "None: `capped` trained with the baseline recipe, unchanged." in text
    assert "| epochs |" not in text
    assert "not what it computes): epochs 40 -> 2; seed 0 -> 3." in text


def test_keys_that_left_the_code_are_no_optimisation_at_their_old_defaults(tmp_path):
    """A log written before a recipe key left the code (docs/record/optimizations.md, "Where the code went") carries it
    at the value that meant "off": that is no change from the baseline. Turned on, it was one, and is listed."""
    retired = {"lookahead_steps": 0, "lookahead_alpha": 0.5, "anneal_epochs": 0.0, "residual_bn_init": 1.0}
    old = read_run(baseline_log(tmp_path / "old.jsonl", 1, 2, TWO[:2], epochs=2, **retired))
    assert optimisations(old) == [] and recipe_changes(old) == [("epochs", "40", "2")]
    on = read_run(baseline_log(tmp_path / "on.jsonl", 1, 2, TWO[:2], epochs=2, **{**retired, "lookahead_steps": 5}))
    assert optimisations(on) == [("lookahead_steps", "(not a key of this code)", "5")]


@pytest.mark.slow  # pdf_content asks git for the commit
def test_pdf_text_is_left_aligned_never_justified(tmp_path, monkeypatch):
    """fpdf2's multi_cell justifies by default, which spread the title paragraph with wide gaps."""
    fpdf = pytest.importorskip("fpdf")
    aligns, multi_cell = [], fpdf.FPDF.multi_cell
    record = lambda self, *a, **k: aligns.append(str(k.get("align", "J"))) or multi_cell(self, *a, **k)
    monkeypatch.setattr(fpdf.FPDF, "multi_cell", record)
    out = [str(RUNS / "fast8.jsonl"), "--out", str(tmp_path / "out"), "--no-figures", "--pdf", str(tmp_path / "r.pdf")]
    assert main(out) == 0
    assert aligns and not [a for a in aligns if a.upper() not in ("L", "ALIGN.L", "LEFT")], sorted(set(aligns))


def test_the_startup_warm_up_is_listed_with_its_cost(tmp_path):
    """Demonstrate 6 lists startup_steps (fast.yaml's warm-up before the clock) with the seconds its header logged."""
    log = baseline_log(tmp_path / "warm.jsonl", 1, 2, TWO[:2], epochs=2, lr_schedule="warmup_linear", startup_steps=3)
    records = log.read_text().splitlines()
    log.write_text("\n".join([json.dumps({**json.loads(records[0]), "startup_seconds": 1.734}), *records[1:]]) + "\n")
    listed = optimisations(read_run(log))
    assert ("startup_steps", "0", "3 (1.7 s of warm-up, before the clock)") in listed


def test_a_resume_whose_rule_already_held_stopped_at_the_last_epoch_before_it(tmp_path):
    """Two epochs at target 0.9 (0.86, 0.87: unmet), resumed under 0.85: the trainer checks the rule before it
    trains, finds it held, and trains nothing. The report's stop, time to target and printed lines agree."""
    path = write_log(tmp_path / "r.jsonl", 1, 1, [(100.0, 500.0, 0.86), (100.0, 500.0, 0.87)], target=0.9)
    run = read_run(resume_at(path, 3, target_accuracy=0.85, epochs=5))
    assert stopping_epoch(run.accuracies, *run.rules) is None  # each epoch's own check, under 0.9, did not hold
    assert run_stop(run) == 1 and run_time_to_target(run) == 200.0
    assert run_rule(run) == {"target_accuracy": 0.85, "patience": 2}
    assert printed_lines(run)[-1] == "Early stopping after epoch 2"
