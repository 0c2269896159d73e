"""The report refuses what a log cannot truly hold (impossible numbers, header values of another type), shows every
string from a log as itself in markdown, names the long sections of a PDF over the course's pages, and shows
only like beside like: the figures and tables of the featured run's recipe, the unmet criterion first, the
profile in the PDF, the sections that the text points to, a warning for runs too short to time, the folders of
its outputs made, DDP's buckets counted."""

import html
import json

import pytest
from test_report import ONE, TWO, pdf_text, write_log

from cifar_wrn.report.cli import check_outputs, main
from cifar_wrn.report.logs import LogError, read_run
from cifar_wrn.report.markdown import write_report

PROFILE = {"data": 1.0, "forward": 20.0, "backward": 30.0, "optimizer": 4.0, "other": 1.0}


def edited(path, line: int, **values):
    """The log at `path` with `values` set in its record on `line` (1-based); the path."""
    records = [json.loads(text) for text in path.read_text().splitlines()]
    records[line - 1].update(values)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------- what cannot be true


@pytest.mark.parametrize(
    "key, value",
    [
        ("val_accuracy", float("nan")),
        ("val_accuracy", float("inf")),
        ("val_accuracy", 1.5),
        ("val_accuracy", -0.1),
        ("train_accuracy", 2.0),
        ("epoch_time", -1.0),
        ("cumulative_time", float("inf")),
        ("images_per_sec", float("inf")),
        ("images_per_sec", -5.0),
        ("val_loss", float("nan")),
        ("comm_estimate", float("-inf")),
        ("profile", {"forward": float("nan")}),
    ],
)
def test_an_impossible_number_is_refused_naming_the_file_and_line(tmp_path, capsys, key, value):
    path = edited(write_log(tmp_path / "bad.jsonl", 1, 2, TWO), 3, **{key: value})  # line 3: epoch 2
    with pytest.raises(LogError, match=rf"^{tmp_path / 'bad.jsonl'}, line 3: .*{key}"):
        read_run(path)
    assert main([str(path), "--out", str(tmp_path / "out"), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}, line 3:") and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value",
    [
        ("device", ["cuda", "cpu"]),
        ("backend", 7),
        ("hostname", {"a": 1}),
        ("model_parameters", "many"),
        ("steps_per_epoch", 2.5),
        ("lr", float("nan")),
        ("recipe", {"target_accuracy": 1.5, "patience": 2}),
    ],
)
def test_a_header_value_of_another_type_is_refused_in_one_line(tmp_path, capsys, key, value):
    path = edited(write_log(tmp_path / "bad.jsonl", 1, 1, ONE), 1, **{key: value})
    with pytest.raises(LogError, match=rf"^{tmp_path / 'bad.jsonl'}, line 1: "):
        read_run(path)
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2  # figures too: a list-valued device crashed them
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}, line 1:")


def test_every_string_from_a_log_shows_as_itself_in_markdown(tmp_path):
    """HTML in a host name, pipes in a commit, a backtick and markup in a log's name: rendered (Python-Markdown,
    with tables), each reads exactly as it is in the log, and every table keeps its columns."""
    markdown = pytest.importorskip("markdown")
    name = "we`ird_*run*_[x]"
    path = write_log(tmp_path / f"{name}.jsonl", 1, 2, TWO, hostname="<b>node</b>", git_commit="a|b&lt;")
    one = write_log(tmp_path / "one.jsonl", 1, 1, ONE, hostname="<b>node</b>", git_commit="a|b&lt;")
    text = write_report([read_run(one), read_run(path)], tmp_path / "out", figures=False)[0].read_text()
    rendered = markdown.markdown(text, extensions=["tables"])
    assert "<b>" not in rendered and "&amp;lt;" in rendered  # shown as text, the entity too
    assert f"<td>{html.escape('<b>node</b>')}</td>" in rendered
    assert f"<td>{html.escape('a|b&lt;')}</td>" in rendered  # the pipe did not split the cell
    assert f"<code>{html.escape(name)}</code>" in rendered  # the code span holds the whole name
    assert f"<h3>{html.escape(name)}</h3>" in rendered  # the run's heading: no emphasis, no link
    for table in rendered.split("<table>")[1:]:  # every row as many cells as the heading
        head = table.split("</thead>")[0].count("<th>")
        assert all(row.count("<td>") == head for row in table.split("<tbody>")[1].split("<tr>")[1:])


@pytest.mark.slow  # the PDF names its commit: report.main starts git
def test_a_pdf_over_the_pages_names_its_long_sections_and_exits_2(tmp_path, monkeypatch, capsys):
    """Long notes make a PDF of more pages than the course's: written, then one line naming the longest
    sections (the ones with the notes first), exit 2."""
    pytest.importorskip("fpdf")
    one = write_log(tmp_path / "one.jsonl", 1, 1, [e[:2] + (0.5,) for e in ONE])
    two = write_log(tmp_path / "two.jsonl", 1, 2, [e[:2] + (0.5,) for e in TWO])
    notes = tmp_path / "notes.yaml"
    words = " ".join(["This step matters because every process must agree."] * 60)
    notes.write_text("steps:\n" + "".join(f"  R1.{n}: {words}\n" for n in range(1, 12)))
    pdf = tmp_path / "r.pdf"
    args = [str(one), str(two), "--out", str(tmp_path / "out"), "--no-figures", "--pdf", str(pdf)]
    assert main(args + ["--notes", str(notes)]) == 2
    out, err = capsys.readouterr()
    pages = pdf_text(pdf)[0]
    assert pages > 4 and f"wrote {pdf} ({pages} pages)" in out
    assert err.count("\n") == 1 and f"{pages} pages, more than the course's 4; the longest sections: 1. The DDP" in err
    assert main(args) == 0  # without the notes it fits


# ----------------------------------------------------------------------------- an honest report


def test_the_figures_the_profile_and_demonstrate_4_show_only_the_featured_runs_recipe(tmp_path, monkeypatch):
    from cifar_wrn.report import figures

    drawn = []
    monkeypatch.setattr(figures, "load_matplotlib", lambda: (None, None))
    for name in ("plot_accuracy", "plot_throughput", "plot_profile"):
        monkeypatch.setattr(figures, name, lambda mpl, runs, path: drawn.append([r.label for r in runs]) or path)
    monkeypatch.setattr(figures, "plot_topology", lambda mpl, *config: config[-1])
    profiled = [(*epoch, PROFILE) for epoch in ONE]
    one = write_log(tmp_path / "one.jsonl", 1, 1, profiled)
    two = write_log(tmp_path / "two.jsonl", 1, 2, [(*epoch, PROFILE) for epoch in TWO])
    other = write_log(tmp_path / "big.jsonl", 1, 1, profiled)
    edited(other, 1, recipe={"target_accuracy": 0.85, "patience": 2, "batch_size": 512})
    text = write_report([read_run(p) for p in (other, one, two)], tmp_path / "out")[0].read_text()
    assert drawn == [["one", "two"]] * 3  # accuracy, images/sec, profile: not `big`
    d4 = text.split("## Demonstrate 4")[1].split("## Demonstrate 5")[0]
    profile = text.split("## Time profile")[1].split("\n## ")[0]
    assert "| two |" in d4 and "| one |" in d4 and "| big |" not in d4
    assert "| one |" in profile and "| big |" not in profile
    assert "Demonstrate 4 (its recipe, data, model and device): `one`; not `big` (recipe (batch_size))." in text


def test_a_report_where_no_run_meets_the_criterion_says_so_first(tmp_path):
    short = [epoch[:2] + (0.5,) for epoch in TWO]
    path = write_log(tmp_path / "two.jsonl", 1, 2, short)
    lines = write_report([read_run(path)], tmp_path / "out", figures=False)[0].read_text().splitlines()
    assert lines[2].startswith(
        "**No run here meets the stopping criterion** (validation accuracy >= 0.85 for 2 epoch(s) in a row)"
    )
    met = write_report([read_run(write_log(tmp_path / "met.jsonl", 1, 2, TWO))], tmp_path / "met", figures=False)
    assert "No run here meets" not in met[0].read_text()


def test_a_run_of_a_few_steps_an_epoch_is_warned_of(tmp_path):
    short = write_log(tmp_path / "short.jsonl", 1, 2, TWO, steps_per_epoch=2)
    long = write_log(tmp_path / "long.jsonl", 1, 1, ONE, steps_per_epoch=781)
    text = write_report([read_run(short), read_run(long)], tmp_path / "out", figures=False)[0].read_text()
    scaling = text.split("## Scaling")[1].split("\n## ")[0]
    assert "**Warning: `short` has 2 steps an epoch**, too few for its times to mean anything" in scaling
    assert "`long` has" not in text


def test_the_buckets_are_ddps_count_for_the_course_model(tmp_path):
    """17,117,754 parameters of the course's width-160 model: 3 buckets, as docs/ddp_walkthrough.md measured them
    on 2 ranks (model._get_ddp_logging_data()["rebuilt_bucket_sizes"]); the cap arithmetic said ~4."""
    from cifar_wrn.model import ARCHITECTURE

    header = dict(model_width=160, architecture=ARCHITECTURE, model_parameters=17117754)
    path = write_log(tmp_path / "two.jsonl", 1, 2, TWO, **header)
    text = write_report([read_run(path)], tmp_path / "out", figures=False)[0].read_text()
    assert "| two | 17117754 | fp32 | 65.3 MiB | 3 | 65.3 MiB |" in text


def test_the_buckets_follow_the_runs_ddp_bucket_cap_mb(tmp_path):
    """A run with the recipe key ddp_bucket_cap_mb 100: DDP's first bucket of 1 MiB, then the other 64.3 MiB in one."""
    from cifar_wrn.model import ARCHITECTURE

    recipe = {"target_accuracy": 0.85, "patience": 2, "batch_size": 32, "ddp_bucket_cap_mb": 100.0}
    header = dict(model_width=160, architecture=ARCHITECTURE, model_parameters=17117754, recipe=recipe)
    path = write_log(tmp_path / "two.jsonl", 1, 2, TWO, **header)
    text = write_report([read_run(path)], tmp_path / "out", figures=False)[0].read_text()
    assert "| two | 17117754 | fp32 | 65.3 MiB | 2 | 65.3 MiB |" in text


def test_the_report_makes_the_folders_of_its_outputs(tmp_path):
    check_outputs(tmp_path / "report", tmp_path / "report" / "report.pdf")  # README's command, in a bare folder
    check_outputs(tmp_path / "a", tmp_path / "b" / "c" / "r.pdf")
    (tmp_path / "file").write_text("")
    with pytest.raises(Exception, match="is not a folder"):
        check_outputs(tmp_path / "a", tmp_path / "file" / "r.pdf")


@pytest.mark.slow  # the PDF names its commit: report.main starts git
def test_the_pdf_keeps_the_profile_and_the_sections_the_text_points_to(tmp_path):
    """The PDF holds the time profile's table; each section Demonstrate 5 names is a heading of report.md and of
    the PDF; the unmet criterion is on page 1, under the title; the PDF's folder is made."""
    pytest.importorskip("fpdf")
    one = write_log(tmp_path / "one.jsonl", 1, 1, [(*e[:2], 0.5, PROFILE) for e in ONE])
    two = write_log(tmp_path / "two.jsonl", 1, 2, [(*e[:2], 0.5, PROFILE) for e in TWO])
    pdf = tmp_path / "report" / "report.pdf"
    assert main([str(one), str(two), "--out", str(tmp_path / "report"), "--no-figures", "--pdf", str(pdf)]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    lines = pdf_text(pdf)[1].splitlines()
    assert "Time profile" in lines and any(line.startswith("two 1.000 20.000 30.000 4.000 1.000") for line in lines)
    d5 = text.split("## Demonstrate 5")[1].split("\n## ")[0]
    named = d5.split('the section "')[1:]
    assert len(named) == 2
    for name in (part.split('"')[0] for part in named):
        assert any(line.startswith(f"## {name}") for line in text.splitlines()), name
        assert any(line.startswith((name, f"3. {name}")) for line in lines), name
    title = lines.index("Distributed data-parallel training of a WideResNet on CIFAR-10: report")
    assert lines[title + 1].startswith("No run here meets the stopping criterion")


def test_the_final_line_of_a_log_whose_recipe_lacks_its_epoch_budget(tmp_path):
    """A log whose recipe has no `epochs` (an older trainer's, or a hand-made one) that met the criterion: its
    final line, not a TypeError from the missing budget."""
    from cifar_wrn.report.featured import printed_lines

    assert printed_lines(read_run(write_log(tmp_path / "two.jsonl", 1, 2, TWO)))[-1] == "Early stopping after epoch 4"
