"""The document's content as data: sections of blocks (headings, text, tables, quoted code, lists, images),
the student's slots, the R1 steps, and what the PDF shows. markdown.py and pdf.py each lay these out; nothing
here imports the rest of the report, so pdf.py can read them without an import circle."""

from dataclasses import dataclass, field


@dataclass
class Slot:
    """What the student writes: their own text from --notes, or a marked slot saying what to write there."""

    what: str
    text: str = ""

    @property
    def written(self) -> bool:
        return bool(self.text)

    def __str__(self) -> str:
        return self.text or f"[you write: {self.what}]"


@dataclass
class Text:
    text: str


@dataclass
class Table:
    head: list
    rows: list[list]  # cells: text, numbers or Slots


@dataclass
class Code:
    """Quoted lines of code, 'NNN: code'."""

    lines: list[str]


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Image:
    path: str
    alt: str


@dataclass
class Section:
    """A heading and its blocks. `id` names the course's item it answers ("R1", "D1".."D6", "scaling", ...),
    so a layout finds a section by what it is, not by its words."""

    id: str
    title: str
    blocks: list = field(default_factory=list)
    level: int = 2


def where_text(name: str, numbers: list[int]) -> str:
    """'raw_ddp.py:86,88,89': the file and the lines of one step, with no spaces (one token to grep)."""
    return f"{name}:" + ",".join(map(str, numbers))


@dataclass
class Step:
    """One DDP step of the course (R1.<n>): its lines in the file quoted (raw_ddp.py's tags, or the student's
    file: student_source.py), and the student's why."""

    id: str  # "R1.7"
    lines: list[int]
    why: Slot
    where: str  # 'raw_ddp.py:86,88' (where_text), or that it was not found


@dataclass
class PdfContent:
    """Every text and table the PDF shows, computed from the logs and the code so that pdf.py only lays them out."""

    runs: list
    run: object  # the featured run (logs.Run)
    featured: str
    printed: list[str]  # what rank 0 printed
    criterion: str
    steps: list[Step]
    commit: str
    run_commit: str
    resumed: str
    scaling: Section  # its Table, then the Bullets that explain it
    demonstrate: list[Section]
    source: object = None  # the file quoted (student_source.Source); None: the shipped raw_ddp.py
