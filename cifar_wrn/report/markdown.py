"""report.md: the report's sections laid out as markdown, with the figures next to it."""

import re
from pathlib import Path

from ..errors import UserError
from .content import Bullets, Code, Image, Section, Slot, Table, Text, code, md_text
from .demonstrate import demonstrate
from .featured import beside_text, featured_group, featured_text, unmet_text
from .figures import Figures, draw_figures
from .logs import Run, label_runs
from .scaling import scaling
from .student_source import Source, shipped_source
from .tables import epoch_table, header_facts, profile_section, scaling_section, steps_table
from .topology import topology_text


def md_cell(cell) -> str:
    """A table cell: a value (from a log) escaped; the student's own text as they wrote it, on one line."""
    return str(cell).replace("|", "\\|").replace("\n", " ") if isinstance(cell, Slot) else md_text(cell)


def md_table(head: list, rows: list[list]) -> str:
    lines = ["| " + " | ".join(md_cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def block_lines(block) -> list[str]:
    """One block as markdown lines, a blank line after it."""
    if isinstance(block, Section):
        return [f"{'#' * block.level} {md_text(block.title)}", ""] + blocks_markdown(block.blocks)
    if isinstance(block, Text):
        return [block.text, ""]
    if isinstance(block, Table):
        return [md_table(block.head, block.rows), ""]
    if isinstance(block, Code):
        runs = [len(run) for line in block.lines for run in re.findall("`+", line)]
        fence = "`" * max([3] + [n + 1 for n in runs])  # longer than any run of backticks in the lines
        return [fence, *block.lines, fence, ""]
    if isinstance(block, Bullets):
        return [f"- {item}" for item in block.items] + [""]
    if isinstance(block, Image):
        return [f"![{md_cell(block.alt)}]({block.path})", ""]
    raise TypeError(f"not a block of the report: {block!r}")


def blocks_markdown(blocks: list) -> list[str]:
    return [line for block in blocks for line in block_lines(block)]


def _what(run: Run) -> str:
    """'docs/x.jsonl: 2 processes on cpu, 1600 training images': the log and what ran, in a few words."""
    images = run.header.get("train_images")
    return (
        f"{md_text(run.path)}: {run.world_size} process{'es' if run.world_size > 1 else ''} on "
        + md_text(run.header["device"])
        + (f", {images} training images" if images else "")
    )


def _opening(runs: list[Run], figures: Figures, out_dir: Path) -> list:
    """The title, the runs, the featured one, the figures (or why none), and what is the student's to write."""
    blocks: list = [Text(unmet_text(runs))] if unmet_text(runs) else []
    blocks += [Text(f"{len(runs)} run(s): " + ", ".join(f"{code(r.label)} ({_what(r)})" for r in runs) + ".")]
    if len(runs) > 1:
        blocks += [Text(text) for text in (featured_text(runs), beside_text(runs)) if text]
    if figures.skipped is None:
        profile = ", [time profile](profile.png)" if figures.has(out_dir / "profile.png") else ""
        blocks.append(
            Text(
                "Figures: [accuracy against time](accuracy_vs_time.png), [images/sec](images_per_sec.png)"
                + profile
                + ", and a topology diagram per configuration (in each run's section)."
            )
        )
    else:
        blocks.append(
            Text(f"**Figures skipped: {figures.skipped}.** The tables and the text topology below are complete.")
        )
    blocks.append(
        Text(
            "Text marked `[you write: ...]` is yours to write (or give it with `--notes notes.yaml`): this report "
            "states facts from the logs and the code, never the explanations."
        )
    )
    return blocks


def steps_section(notes: dict, source: Source) -> Section:
    if source.shipped:
        text = (
            "The line numbers of each `# R1.<n>` tag in the raw_ddp.py next to this report (they move with the code)."
        )
    else:
        text = f"Where each step is in `{source.name}`: its `# R1.<n>` tag, or else the call the step names."
    blocks = [Text(text), steps_table(notes, source)]
    if source.missing:
        blocks += [Text(f"**Not found in `{source.name}`**, to do:"), Bullets(source.checklist())]
    return Section("R1", f"The DDP steps (R1) in {source.name}", blocks)


def run_section(run: Run, figures: Figures) -> Section:
    """One run: its log, header facts, topology (text and diagram), epoch log and notes on the log."""
    blocks: list = [
        Text(f"Log: {code(run.path)}"),
        Table(["", ""], header_facts(run)),
        Text("Process topology:"),
        Code(topology_text(*run.config).split("\n")),
    ]
    if run.config in figures.topology:
        blocks.append(Image(figures.topology[run.config].name, f"process topology of {run.label}"))
    blocks.append(epoch_table(run))
    if run.notes:
        blocks.append(Bullets(run.notes))
    return Section("run", run.label, blocks, level=3)


def report_blocks(runs: list[Run], figures: Figures, out_dir: Path, notes: dict, compare: list, source: Source) -> list:
    """Every block of report.md, in order."""
    blocks = _opening(runs, figures, out_dir) + [steps_section(notes, source), scaling_section(scaling(runs), runs)]
    if figures.skipped is None and any(r.epochs for r in runs):
        blocks.append(Image("accuracy_vs_time.png", "validation accuracy against Cumulative Time"))
        blocks.append(Image("images_per_sec.png", "images/sec per epoch"))
    profile = profile_section(featured_group(runs)[0], runs)
    if profile:
        if figures.skipped is None:
            profile.blocks.append(Image("profile.png", "time profile per run"))
        blocks.append(profile)
    blocks += demonstrate(runs, notes, compare, source)
    blocks.append(Section("runs", "Runs"))
    return blocks + [run_section(run, figures) for run in runs]


def write_report(
    runs: list[Run],
    out_dir,
    figures: bool = True,
    notes: dict | None = None,
    compare: list[tuple[Run, Run]] = (),
    source: Source | None = None,
) -> tuple[Path, list[Path], str | None]:
    """Write out_dir/report.md (and the PNGs). Returns (report path, figure paths, why figures were skipped).
    `source`: the file the R1 table and the listings quote (student_source.read_source); the shipped raw_ddp.py
    by default."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot create the folder ({exc.strerror or exc})") from None
    label_runs(runs)
    for pair in compare:  # named apart from the reported runs: a before/after may be one of them
        label_runs(list(pair))
    drawn = draw_figures(runs, featured_group(runs)[0], out_dir, figures)
    lines = ["# Training report", ""] + blocks_markdown(
        report_blocks(runs, drawn, out_dir, notes or {}, list(compare), source or shipped_source())
    )
    report = out_dir / "report.md"
    try:
        report.write_text("\n".join(lines) + "\n")
    except OSError as exc:
        raise UserError(f"{report}: cannot write ({exc.strerror or exc})") from None
    return report, drawn.written, drawn.skipped
