"""cifar_wrn/report.py: the scaling arithmetic against hand-computed values, report.md, figures, and the
report without matplotlib; bad input files end in one clear line and exit status 2."""
import json
import subprocess
import sys

import pytest

from cifar_wrn import report
from conftest import REPO, TINY, raw_ddp

EXACT = 1e-9


def write_log(path, nodes, gpus, epochs, target=0.85, patience=2, **header):
    """A log as the trainers write it. epochs: (epoch_time, images_per_sec, val_accuracy[, profile])."""
    records = [{"kind": "header", "world_size": nodes * gpus, "num_nodes": nodes, "num_gpus": gpus,
                "backend": "nccl", "device": "cuda", "git_commit": "abc1234", "train_images": 50000,
                "recipe": {"target_accuracy": target, "patience": patience, "batch_size": 32}, **header}]
    cumulative = 0.0
    for i, (epoch_time, ips, accuracy, *profile) in enumerate(epochs, 1):
        cumulative += epoch_time
        record = {"kind": "epoch", "epoch": i, "cumulative_time": cumulative, "epoch_time": epoch_time,
                  "images_per_sec": ips, "val_loss": 2.0 - accuracy, "val_accuracy": accuracy}
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
    return {"one": write_log(tmp_path / "one.jsonl", 1, 1, ONE),
            "two": write_log(tmp_path / "two.jsonl", 1, 2, TWO),
            "four": write_log(tmp_path / "four.jsonl", 2, 2, FOUR)}


def rows_by_p(runs):
    report.label_runs(runs)
    sc = report.scaling(runs)
    return sc, {row["p"]: row for row in sc.rows}


# ----------------------------------------------------------------------------- the arithmetic

def test_formulas_against_hand_computed_values():
    # S = 300 / 240 = 1.25 on p = 2: E = 0.625, e = (1/1.25 - 1/2) / (1 - 1/2) = (0.8 - 0.5) / 0.5 = 0.6
    assert abs(report.speedup_by_time(300.0, 240.0) - 1.25) < EXACT
    assert abs(report.parallel_efficiency(1.25, 2) - 0.625) < EXACT
    assert abs(report.karp_flatt(1.25, 2) - 0.6) < EXACT
    # Amdahl from e = 0.6: S(2) = 1/0.8, S(4) = 1/(0.6 + 0.1) = 1/0.7, S(8) = 1/(0.6 + 0.05) = 1/0.65
    assert abs(report.amdahl_speedup(0.6, 2) - 1.25) < EXACT
    assert abs(report.amdahl_speedup(0.6, 4) - 1 / 0.7) < EXACT
    assert abs(report.amdahl_speedup(0.6, 8) - 1 / 0.65) < EXACT
    # perfect scaling: e = 0 and Amdahl gives back n; no speedup at all: e = 1 and Amdahl gives 1
    assert abs(report.karp_flatt(4.0, 4)) < EXACT and abs(report.amdahl_speedup(0.0, 8) - 8) < EXACT
    assert abs(report.karp_flatt(1.0, 8) - 1.0) < EXACT and abs(report.amdahl_speedup(1.0, 8) - 1) < EXACT
    # throughput: 950 / 500 = 1.9 on p = 2: e = (1/1.9 - 1/2) / (1/2) = 2/1.9 - 1 = 1/19
    assert abs(report.speedup_by_throughput(500.0, 950.0) - 1.9) < EXACT
    assert abs(report.karp_flatt(1.9, 2) - 1 / 19) < EXACT
    with pytest.raises(ValueError):
        report.karp_flatt(1.0, 1)  # undefined for one process
    assert report.global_rank(1, 4, 2) == 6


def test_time_to_target_and_not_reached():
    epochs = lambda accs: [{"cumulative_time": 10.0 * (i + 1), "val_accuracy": a} for i, a in enumerate(accs)]
    assert report.time_to_target(epochs([0.5, 0.86, 0.87, 0.9]), 0.85, 2) == 30.0
    assert report.time_to_target(epochs([0.86, 0.84, 0.86, 0.88]), 0.85, 2) == 40.0  # the streak restarts
    assert report.time_to_target(epochs([0.5, 0.85]), 0.85, 1) == 20.0  # >= : exactly the target counts
    assert report.time_to_target(epochs([0.86, 0.84, 0.86]), 0.85, 2) is None
    assert report.time_to_target([], 0.85, 2) is None
    assert report.stopping_epoch([0.9, 0.9, 0.9], 0.85, 3) == 2
    assert report.mean_images_per_sec([{"images_per_sec": v} for v in (900.0, 950.0, 1000.0, 950.0)]) == 950.0


def test_scaling_by_time_when_every_run_reached_the_target(logs):
    sc, rows = rows_by_p([report.read_run(logs["two"]), report.read_run(logs["one"])])
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
    runs = [report.read_run(logs[k]) for k in ("one", "two", "four")]
    sc, rows = rows_by_p(runs)
    assert sc.basis == "throughput"
    assert rows[4]["time_to_target"] is None
    assert abs(rows[2]["speedup"] - 1.9) < EXACT and abs(rows[2]["karp_flatt"] - 1 / 19) < EXACT
    # 1600 / 500 = 3.2 on p = 4: E = 0.8, e = (1/3.2 - 1/4) / (3/4) = 0.0625 / 0.75 = 1/12
    assert abs(rows[4]["speedup"] - 3.2) < EXACT
    assert abs(rows[4]["efficiency"] - 0.8) < EXACT
    assert abs(rows[4]["karp_flatt"] - 1 / 12) < EXACT
    assert abs(rows[4]["amdahl"][8] - 1 / (1 / 12 + (11 / 12) / 8)) < EXACT

    path, _, _ = report.write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert "Speedup basis: mean Images/sec" in text and "not reached" in text
    assert "| speedup (images/sec) |" in text
    scaling_rows = [line for line in text.splitlines() if line.startswith("| four |")]
    assert scaling_rows and "| 4 | 2 x 2 | not reached | 1600.0 | 0.8400 | 3.200 | 0.800 | 0.0833 |" \
        in scaling_rows[0]


def test_report_markdown_holds_tables_topology_and_header_facts(logs, tmp_path):
    runs = [report.read_run(logs[k]) for k in ("one", "two", "four")]
    runs = [runs[0], runs[1]]
    path, figures, skipped = report.write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert figures == [] and skipped
    assert "Speedup basis: Cumulative Time to target" in text and "| speedup (time to target) |" in text
    assert "| two | 2 | 1 x 2 | 240.000 | 950.0 | 0.8800 | 1.250 | 0.625 | 0.6000 | 1.250 | 1.429 | 1.538 |" in text
    assert "| one | 1 | 1 x 1 | 300.000 | 500.0 | 0.9000 | 1.000 | 1.000 | – |" in text
    # each run's epoch log, with the stopping epoch marked, and the header facts
    assert "| 4 | 240.000 | 60.000 | 950.0 | 1.1200 | 0.8800 | 2/2, stop |" in text
    assert "| 3 | 300.000 | 100.000 | 490.0 | 1.1300 | 0.8700 | 2/2, stop |" in text
    for fact in ("| world size (processes) | 2 |", "| nodes | 1 |", "| GPUs per node | 2 |", "| backend | nccl |",
                 "| device | cuda |", "| commit | abc1234 |"):
        assert fact in text
    assert "node 0: [cuda:0 local_rank 0 = rank 0] [cuda:1 local_rank 1 = rank 1]" in text
    assert "ring: 0 -> 1 -> 0" in text


def test_topology_text_ranks_and_ring():
    text = report.topology_text(2, 4, "nccl", "cuda")
    assert "node 1: [cuda:0 local_rank 0 = rank 4] [cuda:1 local_rank 1 = rank 5] [cuda:2 local_rank 2 = rank 6] " \
           "[cuda:3 local_rank 3 = rank 7]" in text
    assert "ring: 0 -> 1 -> 2 -> 3 => 4 -> 5 -> 6 -> 7 => 0" in text  # => crosses between nodes
    assert "world size 8" in text
    assert "no all-reduce" in report.topology_text(1, 1, "gloo", "cpu")


def test_no_one_process_run_means_no_speedup_columns(logs, tmp_path):
    runs = [report.read_run(logs["two"]), report.read_run(logs["four"])]
    path, _, _ = report.write_report(runs, tmp_path / "out", figures=False)
    text = path.read_text()
    assert "no 1-process run" in text
    assert "speedup" not in text.split("## Scaling")[1].split("\n\n")[1]  # the table has no speedup column
    assert "Karp-Flatt e" not in text


def test_runs_that_differ_are_flagged(logs, tmp_path):
    other = write_log(tmp_path / "other.jsonl", 1, 2, TWO, target=0.9)
    path, _, _ = report.write_report([report.read_run(logs["one"]), report.read_run(other)], tmp_path / "out",
                                     figures=False)
    assert "Warning: the runs differ in recipe (target_accuracy)" in path.read_text()


def test_profile_table(tmp_path):
    prof = [(10.0, 100.0, 0.5, {"data": 1.0, "forward": 3.0, "backward": 5.0, "comm_estimate": 1.0,
                                "note": "text is ignored"}),
            (10.0, 100.0, 0.6, {"data": 3.0, "forward": 3.0, "backward": 5.0, "comm_estimate": 1.0})]
    run = report.read_run(write_log(tmp_path / "p.jsonl", 1, 1, prof))
    assert report.profile_parts(run.epochs) == {"data": 2.0, "forward": 3.0, "backward": 5.0, "comm_estimate": 1.0}
    path, _, _ = report.write_report([run], tmp_path / "out", figures=False)
    assert "| p | 2.000 | 3.000 | 5.000 | 1.000 | 11.000 |" in path.read_text()


# ----------------------------------------------------------------------------- figures, with and without matplotlib

PNG = b"\x89PNG\r\n\x1a\n"


def test_figures_are_written(logs, tmp_path):
    pytest.importorskip("matplotlib")  # the `plot` extra; CI installs it with the test extra
    prof = [(10.0, 100.0, 0.5, {"data": 1.0, "forward": 3.0, "backward": 5.0}),
            (10.0, 100.0, 0.6, {"data": 1.0, "forward": 3.0, "backward": 5.0, "optimizer": 0.5})]
    profiled = write_log(tmp_path / "prof.jsonl", 1, 1, prof)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "cifar_wrn.report", logs["one"], logs["two"], logs["four"],
                             profiled, "--out", out], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names = {"accuracy_vs_time.png", "images_per_sec.png", "profile.png", "topology_1x1_nccl_cuda.png",
             "topology_1x2_nccl_cuda.png", "topology_2x2_nccl_cuda.png"}
    assert {p.name for p in out.glob("*.png")} == names
    for name in names:
        data = (out / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG), name
    text = (out / "report.md").read_text()
    for name in names:
        assert f"]({name})" in text, name
    assert "skipped" not in text
    assert f"wrote {out / 'report.md'} and 6 figure(s)" in result.stdout


def test_report_without_matplotlib(logs, tmp_path):
    """matplotlib made unimportable (None in sys.modules): the tables are still written, with a note."""
    out = tmp_path / "out"
    code = ("import sys; sys.modules['matplotlib'] = None; from cifar_wrn.report import main; "
            f"sys.exit(main([{str(logs['one'])!r}, {str(logs['two'])!r}, '--out', {str(out)!r}]))")
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
    assert report.load_matplotlib() is None
    path, figures, skipped = report.write_report([report.read_run(logs["one"])], tmp_path / "out")
    assert figures == [] and "matplotlib is missing" in skipped
    assert "Figures skipped" in path.read_text()


# ----------------------------------------------------------------------------- bad input

def bad_inputs(tmp_path):
    good_header = {"kind": "header", "world_size": 1, "num_nodes": 1, "num_gpus": 1, "backend": "gloo",
                   "device": "cpu", "recipe": {"target_accuracy": 0.85, "patience": 2}}
    files = {
        "missing": (tmp_path / "nope.jsonl", "no such file"),
        "folder": (tmp_path, "is a folder"),
        "binary": (tmp_path / "weights.pt", "not a text file"),
        "not json": (tmp_path / "notes.txt", "line 1: not JSON"),
        "no header": (tmp_path / "noheader.jsonl", "no header record"),
        "epoch first": (tmp_path / "epochfirst.jsonl", "line 1: an epoch record before the header"),
        "json list": (tmp_path / "list.json", "line 1: not a JSON object"),
        "empty": (tmp_path / "empty.jsonl", "no header record"),
        "bad header": (tmp_path / "badheader.jsonl", "lacks backend"),
        "bad epoch": (tmp_path / "badepoch.jsonl", "line 2: the epoch record lacks numeric val_accuracy"),
        "no recipe": (tmp_path / "norecipe.jsonl", "no recipe with target_accuracy and patience"),
    }
    (tmp_path / "weights.pt").write_bytes(b"\x80\x02\xff\xfe" * 100)
    (tmp_path / "notes.txt").write_text("Epoch =  1: Cumulative Time = 1.0\n")
    (tmp_path / "noheader.jsonl").write_text(json.dumps({"loss": 1.0}) + "\n")
    (tmp_path / "epochfirst.jsonl").write_text(json.dumps({"kind": "epoch", "epoch": 1}) + "\n")
    (tmp_path / "list.json").write_text("[1, 2, 3]\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "badheader.jsonl").write_text(json.dumps({k: v for k, v in good_header.items() if k != "backend"}))
    (tmp_path / "badepoch.jsonl").write_text(json.dumps(good_header) + "\n" + json.dumps(
        {"kind": "epoch", "epoch": 1, "cumulative_time": 1.0, "epoch_time": 1.0, "images_per_sec": 1.0,
         "val_loss": 1.0}) + "\n")
    (tmp_path / "norecipe.jsonl").write_text(json.dumps({k: v for k, v in good_header.items() if k != "recipe"}))
    return files


def test_bad_files_give_one_clear_line_and_exit_2(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for what, (path, message) in bad_inputs(logs).items():
        result = subprocess.run([sys.executable, "-m", "cifar_wrn.report", path, "--out", tmp_path / "out"],
                                cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, (what, result.stderr)
        assert result.stderr.startswith("error: ") and message in result.stderr, (what, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, what
    assert not (tmp_path / "out" / "report.md").exists()


def test_run_without_epochs_is_reported_not_fatal(logs, tmp_path):
    """A run that crashed before its first epoch still has a header: it is listed, without speedups."""
    empty = write_log(tmp_path / "crashed.jsonl", 1, 2, [])
    path, _, _ = report.write_report([report.read_run(logs["one"]), report.read_run(empty)], tmp_path / "out",
                                     figures=False)
    text = path.read_text()
    assert "| crashed | 2 | 1 x 2 | not reached | – | – |" in text
    assert "A run has no epoch records: no speedup columns." in text and "_No epoch records" in text


def test_read_run_rejects_inconsistent_header(tmp_path):
    path = write_log(tmp_path / "x.jsonl", 2, 2, ONE)
    path.write_text(path.read_text().replace('"world_size": 4', '"world_size": 3'))
    with pytest.raises(report.LogError, match="not num_nodes x num_gpus"):
        report.read_run(path)


# ----------------------------------------------------------------------------- a real log

def test_report_reads_what_raw_ddp_writes(cifar_dir, tmp_path):
    log = tmp_path / "real.jsonl"
    result = raw_ddp("--num-gpus", "1", *TINY, "--data-dir", cifar_dir, "--train-subset", 64, "--val-subset", 32,
                     "--epochs", 2, "--target-accuracy", 0.0, "--patience", 1, "--log-json", log)
    assert result.returncode == 0, result.stderr
    run = report.read_run(log)
    assert run.world_size == 1 and len(run.epochs) == 1  # target 0 with patience 1: stops after epoch 1
    path, _, _ = report.write_report([run], tmp_path / "out", figures=False)
    text = path.read_text()
    assert f"| {run.epochs[0]['cumulative_time']:.3f} |" in text and "1/1, stop" in text
    assert "| backend | gloo |" in text and "| model width | 4 |" in text
