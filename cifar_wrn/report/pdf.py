"""The course's R3 report as a PDF of at most 4 pages (`python -m cifar_wrn.report ... --pdf report.pdf`).

In R3's order: the DDP steps (where each `# R1.<n>` tag sits in raw_ddp.py, and why), the two-process
run's epoch log exactly as rank 0 printed it, the Cumulative Time at which the criterion was met, the 1 vs N
process table (speedup, efficiency, Karp-Flatt, Amdahl) with the accuracy-against-time figure and the
topology diagram, then the course's Demonstrate items 1-6 (the blocks report.md shows too). What only the
student can write (every explanation) is a marked slot, or the student's own text from --notes. Everything
else comes from the logs and the code: cli.py computes it (pdf_content, the dataclasses of content.py) and
passes it in, so this module only lays it out and imports nothing of the report but content.py and columns.py
(each table's column widths, from its content).

fpdf2 (the optional extra `pdf`) draws it rather than reportlab: both are pure Python and well kept, but
fpdf2's one object with tables and PNGs built in keeps this file short, its core fonts need no font file
(a small PDF), and the PDF's text stays extractable, so the tests read it back (pypdf).
"""

import re
from pathlib import Path

from ..errors import UserError
from .columns import CELL_PADDING, fitting
from .content import Bullets, Code, Image, PdfContent, Section, Slot, Table, Text

MAX_PAGES = 4  # the course's limit
INSTALL_HINT = "pip install fpdf2, or pip install -e '.[pdf]'"
GREY, RED, DARK = (110, 110, 110), (170, 40, 40), (30, 30, 30)
# The PDF's core fonts (no font files to embed: a small PDF) cover Latin-1; the few other characters the
# report uses are spelled out.
PLAIN = str.maketrans(
    {
        "–": "-",
        "—": "-",
        "−": "-",
        "≥": ">=",
        "≤": "<=",
        "×": "x",
        "→": "->",
        "⇒": "=>",
        "…": "...",
        "’": "'",
        "“": '"',
        "”": '"',
    }
)


def latin1(text) -> str:
    return str(text).translate(PLAIN).encode("latin-1", "replace").decode("latin-1")


def load_fpdf():
    """The FPDF class, or a UserError saying how to install it."""
    try:
        from fpdf import FPDF
    except ImportError:
        raise UserError(f"--pdf needs the fpdf2 package, which is not installed: {INSTALL_HINT}") from None
    return FPDF


class Layout:
    """Sizes in mm and points; `compact` shrinks them when the normal ones need more than MAX_PAGES."""

    def __init__(self, compact: bool):
        self.body = 8.5 if compact else 9.0  # body text, points
        self.table = 7.0 if compact else 7.5  # table text, points
        self.line = 3.6 if compact else 4.0  # a line of text, mm
        self.accuracy_w = 96 if compact else 104  # accuracy figure width, mm
        self.topology_w = 66 if compact else 74  # topology figure width, mm


def _document(FPDF):
    class Report(FPDF):
        def footer(self):
            self.set_y(-10)
            self.set_font("Helvetica", "", 7)
            self.set_text_color(*GREY)
            self.cell(
                0, 4, f"python -m cifar_wrn.report (the command: page 1)  |  page {self.page_no()} of {{nb}}", align="C"
            )

    pdf = Report(format="A4", unit="mm")
    pdf.set_margins(14, 12, 14)
    pdf.set_auto_page_break(True, margin=14)
    pdf.set_title("Course report: distributed data-parallel training of a WideResNet on CIFAR-10")
    pdf.set_creator("python -m cifar_wrn.report (cifar-wrn-ddp)")
    pdf.add_page()
    pdf.starts = [("the opening (title, runs, caption)", 1, pdf.get_y())]
    return pdf


def section_pages(pdf) -> list[tuple[str, float]]:
    """(heading, pages) of each section of a built document, longest first: from its heading to the next."""
    body = pdf.h - pdf.t_margin - pdf.b_margin
    ends = pdf.starts[1:] + [("", pdf.page_no(), pdf.get_y())]
    spans = [(title, end[1] - page + (end[2] - y) / body) for (title, page, y), end in zip(pdf.starts, ends)]
    return sorted(spans, key=lambda span: -span[1])


def _heading(pdf, text: str) -> None:
    if pdf.get_y() > pdf.h - 40:  # never a heading alone at the foot of a page
        pdf.add_page()
    pdf.starts.append((text, pdf.page_no(), pdf.get_y()))  # where each section starts: section_pages
    pdf.ln(2)
    pdf.set_font("Helvetica", "B", 11.5)
    pdf.set_text_color(*DARK)
    pdf.multi_cell(0, 6, latin1(text), new_x="LMARGIN", new_y="NEXT", align="L")
    pdf.ln(0.5)


def _text(pdf, lay: Layout, text: str, style: str = "", color=DARK, size=None) -> None:
    pdf.set_font("Helvetica", style, size or lay.body)
    pdf.set_text_color(*color)
    pdf.multi_cell(0, lay.line, latin1(text), new_x="LMARGIN", new_y="NEXT", align="L")  # not justified: no wide gaps


def _is_slot(cell) -> bool:
    """A slot the student has not written yet: marked in the table."""
    return isinstance(cell, Slot) and not cell.written


def _styled(head: list, rows: list[list]) -> list[list[tuple[str, str]]]:
    """The table's columns as (text, font style) cells, as they will be drawn: headings bold, slots italic."""
    columns = []
    for i, heading in enumerate(head):
        cells = [(latin1(row[i]), "I" if _is_slot(row[i]) else "") for row in rows if i < len(row)]
        columns.append([(latin1(heading), "B")] + cells)
    return columns


def _table(pdf, lay: Layout, head: list, rows: list[list], size: float | None = None) -> None:
    """A table with `head` as headings, its column widths from its content (set smaller where its widest words
    would not fit side by side); a slot the student has not written yet is marked."""
    from fpdf.fonts import FontFace

    size, widths = fitting(pdf, _styled(head, rows), size or lay.table)  # smaller, if words would break
    pdf.set_font("Helvetica", "", size)
    pdf.set_text_color(*DARK)
    mine = FontFace(emphasis="ITALICS", color=RED)
    with pdf.table(
        col_widths=widths,
        text_align="LEFT",
        line_height=size * 0.47,
        padding=CELL_PADDING,
        headings_style=FontFace(emphasis="BOLD", fill_color=(228, 234, 242)),
    ) as table:
        row = table.row()
        for cell in head:
            row.cell(latin1(cell))
        for cells in rows:
            row = table.row()
            for cell in cells:
                row.cell(latin1(cell), style=mine if _is_slot(cell) else None)
    pdf.ln(1.5)


def _printed_log(pdf, lay: Layout, run, lines: list[str]) -> None:
    """The epoch lines as printed, in a monospace font sized so the longest fits on one line; where the run
    was resumed, a marked note (not part of the printed output) between them."""
    longest = max((len(line) for line in lines), default=1)
    size = min(8.0, pdf.epw / (0.6 * longest) * 72 / 25.4)  # Courier: every character is 0.6 em wide
    resumes = list(run.resumes)
    for i, line in enumerate(lines):
        epoch = run.epochs[i] if i < len(run.epochs) else None
        while resumes and (epoch is None or resumes[0].line < epoch["log_line"]):
            _resume_note(pdf, lay, resumes.pop(0))
        pdf.set_font("Courier", "", size)
        pdf.set_text_color(*DARK)
        pdf.set_fill_color(244, 244, 244)
        for printed in line.split("\n"):  # an epoch line may carry the safety net's note on a line of its own
            pdf.cell(0, size * 0.45, latin1(printed), new_x="LMARGIN", new_y="NEXT", fill=True)
    for segment in resumes:
        _resume_note(pdf, lay, segment)
    if len(lines) == len(run.epochs):  # no final line
        _text(
            pdf,
            lay,
            "[the log ends here, with no final line: the run had not finished, or it was stopped]",
            "I",
            GREY,
            size=lay.table,
        )


def _resume_note(pdf, lay: Layout, segment) -> None:
    pdf.set_font("Helvetica", "I", lay.table)
    pdf.set_text_color(*GREY)
    pdf.cell(
        0,
        lay.table * 0.47,
        latin1(
            f"    [not printed by the run: stopped here, resumed at {segment.where()} "
            f"(log line {segment.line}); the resumed process printed its "
            f"'Resuming from ...' line here]"
        ),
        new_x="LMARGIN",
        new_y="NEXT",
    )


def _figures(pdf, lay: Layout, figures: dict, skipped: str | None) -> None:
    """The accuracy figure and the topology diagram side by side, on a new page if they do not fit; the
    figures report.md has besides them named, with where they are."""
    accuracy, topology, others = figures.get("accuracy"), figures.get("topology"), figures.get("others", [])
    if skipped or not (accuracy or topology):
        _text(pdf, lay, f"Figures skipped: {skipped or 'no epoch records'}.", "I", RED)
        return
    from PIL import Image  # matplotlib, which drew them, depends on Pillow

    sized = []
    for path, width in ((accuracy, lay.accuracy_w), (topology, lay.topology_w)):
        if path:
            with Image.open(path) as image:
                sized.append((path, width, width * image.height / image.width))
    height = max(h for _, _, h in sized)
    if pdf.get_y() + height > pdf.page_break_trigger:
        pdf.add_page()
    x, y = pdf.l_margin, pdf.get_y()
    for path, width, h in sized:
        pdf.image(str(path), x=x, y=y + (height - h) / 2, w=width)
        x += width + 4
    pdf.set_y(y + height + 2)
    if others:
        folder = others[0].parent
        names = ", ".join(path.name for path in others)
        _text(
            pdf,
            lay,
            f"Not in this PDF (the course's {MAX_PAGES} pages), in {folder} with report.md: {names}.",
            "I",
            GREY,
        )


def _code(pdf, lines: list[str]) -> None:
    """Quoted source lines in a monospace font sized so the longest fits on one line."""
    size = min(7.0, pdf.epw / (0.6 * max(map(len, lines))) * 72 / 25.4)  # Courier: every character is 0.6 em
    pdf.set_font("Courier", "", size)
    pdf.set_text_color(*DARK)
    pdf.set_fill_color(244, 244, 244)
    for line in lines:
        pdf.cell(0, size * 0.45, latin1(line), new_x="LMARGIN", new_y="NEXT", fill=True)
    pdf.ln(1)


def _plain_cell(cell):
    return cell if isinstance(cell, Slot) else _plain(str(cell))


def _blocks(pdf, lay: Layout, blocks: list) -> None:
    """Sections that report.md shows too: headings, text, tables, quoted code."""
    for block in blocks:
        if isinstance(block, Section):
            _heading(pdf, block.title)
            _blocks(pdf, lay, block.blocks)
        elif isinstance(block, Text):
            _text(pdf, lay, _plain(block.text), size=lay.table + 0.5)
        elif isinstance(block, Table):
            rows = [[_plain_cell(c) for c in row] for row in block.rows]
            _table(pdf, lay, block.head, rows, size=lay.table - 0.5)
        elif isinstance(block, Code):
            _code(pdf, block.lines)
        elif isinstance(block, Bullets):
            for item in block.items:
                _text(pdf, lay, "- " + _plain(item), size=lay.table + 0.5)
        elif not isinstance(block, Image):  # report.md's figures: the PDF shows its own (_figures)
            raise TypeError(f"not a block of the report: {block!r}")


# markdown's code spans, escapes and bold (content.code, md_text): what the PDF shows is their text
MARKDOWN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)|\\([!-/:-@\[-`{-~])|&(lt|amp);|\*\*")


def _unmarked(match) -> str:
    if match.group(1):
        inner = match.group(2)
        return inner[1:-1] if len(inner) > 2 and inner[0] == inner[-1] == " " else inner
    return match.group(3) or {"lt": "<", "amp": "&"}.get(match.group(4), "")


def _plain(markdown: str) -> str:
    return MARKDOWN.sub(_unmarked, markdown)


def _opening(pdf, lay: Layout, content: PdfContent, command: str, caption: str | None) -> None:
    """The title, the command that made the PDF, the runs, the caption, and what is the student's to write."""
    pdf.set_font("Helvetica", "B", 14)
    pdf.set_text_color(*DARK)
    title = "Distributed data-parallel training of a WideResNet on CIFAR-10: report"
    pdf.multi_cell(0, 7, title, new_x="LMARGIN", new_y="NEXT", align="L")
    if content.unmet:
        _text(pdf, lay, _plain(content.unmet), "B", RED)
    _text(pdf, lay, f"Made by: {command}", color=GREY, size=lay.table)
    runs = ", ".join(f"{r.label} ({r.path})" for r in content.runs)
    _text(pdf, lay, f"From the run logs {runs}. " + _plain(content.featured), color=GREY)
    if caption:
        _text(pdf, lay, caption, "B")
    _text(
        pdf,
        lay,
        "Text marked [you write: ...] is yours to write (or give it with --notes notes.yaml): this "
        "report states facts from the logs and the code, never the explanations.",
        "I",
        RED,
    )


def _steps(pdf, lay: Layout, content: PdfContent) -> None:
    """R3's first part: where each R1 step is in raw_ddp.py (or the student's --source), and the student's why."""
    source = content.source
    name = source.name if source else "raw_ddp.py"
    _heading(pdf, f"1. The DDP steps (R1): where they are in {name}, and why each is needed")
    where = (
        f"Line numbers of the raw_ddp.py this report ships with (commit {content.commit}; the run's log names "
        f"commit {content.run_commit})"
        if source is None or source.shipped
        else f"Line numbers in {name}: each step's # R1.<n> tag, or else the call it names"
    )
    pin = "Each process is pinned to its GPU at R1.7; the group is formed at R1.3, from the ranks of R1.2."
    _text(pdf, lay, f"{where}. {pin}")
    pdf.ln(1)
    _table(pdf, lay, ["step", "where", "why"], [[step.id, step.where, step.why] for step in content.steps])
    for item in source.checklist() if source else []:
        _text(pdf, lay, _plain(item), "B", RED)


def _epoch_log(pdf, lay: Layout, content: PdfContent) -> None:
    """R3's second part: the featured run's epoch log as rank 0 printed it, and the criterion."""
    run = content.run
    cuda = run.header["device"] == "cuda"
    who = "two-GPU" if run.world_size == 2 and cuda else f"{run.world_size}-process ({run.header['device']})"
    _heading(pdf, f"2. The {who} run's epoch log, as printed by rank 0")
    per_node = "GPU(s)" if cuda else "CPU process(es)"
    _text(
        pdf,
        lay,
        f"{run.label}: {run.num_nodes} node(s) x {run.num_gpus} {per_node} per node = world size "
        f"{run.world_size}, {run.header['backend']} on {run.header['device']}; log {run.path}."
        + (f" Resumed {content.resumed}." if content.resumed else ""),
    )
    for note in run.notes:
        _text(pdf, lay, f"Note: {note}.", "I")
    pdf.ln(1)
    _printed_log(pdf, lay, run, content.printed)
    pdf.ln(1.5)
    _text(pdf, lay, content.criterion, "B", size=lay.body + 0.5)


def _scaling(pdf, lay: Layout, section: Section, figures: dict, skipped: str | None) -> None:
    """R3's third part: the scaling table, what it means, and the figures."""
    _heading(pdf, f"3. {section.title}")
    for block in section.blocks:
        if isinstance(block, Table):
            _table(pdf, lay, block.head, block.rows, size=lay.table - 0.7)
        elif isinstance(block, Bullets):
            for item in block.items:
                _text(pdf, lay, "- " + _plain(item), size=lay.table + 0.5)
    pdf.ln(1.5)
    _figures(pdf, lay, figures, skipped)


def build(content, figures: dict, skipped: str | None, compact: bool, command: str, caption: str | None = None):
    """The whole document (an FPDF object, not yet written), from the texts and tables of cli.pdf_content."""
    lay = Layout(compact)
    pdf = _document(load_fpdf())
    _opening(pdf, lay, content, command, caption)
    _steps(pdf, lay, content)
    _epoch_log(pdf, lay, content)
    _scaling(pdf, lay, content.scaling, figures, skipped)
    _blocks(pdf, lay, [content.profile] if content.profile else [])
    _blocks(pdf, lay, content.demonstrate)
    return pdf


def write_pdf(content, path, figures: dict, skipped: str | None, caption: str | None = None, command: str = ""):
    """Write the report to `path`; its number of pages and section_pages. Tries the normal sizes, then the
    compact ones when the normal need more than MAX_PAGES (many runs, many recipe changes). `command`: what made
    it, shown in full on page 1."""
    path = Path(path)
    command = command or "python -m cifar_wrn.report " + " ".join(str(r.path) for r in content.runs)
    for compact in (False, True):
        pdf = build(content, figures, skipped, compact, latin1(command), caption)
        if pdf.page_no() <= MAX_PAGES:
            break
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pdf.output(str(path))
    except OSError as exc:
        raise UserError(f"--pdf {path}: cannot write ({exc.strerror or exc})") from None
    return pdf.page_no(), section_pages(pdf)
