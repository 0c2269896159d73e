"""The document's content as data: sections of blocks (headings, text, tables, quoted code, lists, images),
the student's slots, the R1 steps, and what the PDF shows. markdown.py and pdf.py each lay these out; nothing
here imports the rest of the report, so pdf.py can read them without an import circle."""

import re
from dataclasses import dataclass, field

# What markdown would read as markup or HTML in a string from a log (a host name, a file name): < and & as HTML
# entities, the rest with a backslash; an underscore only where it could start or end emphasis (raw_ddp.py keeps
# its own), a tilde but before a digit (the report's "~4": about 4).
MARKUP = re.compile(r"[\\`*<&\[\]|]|~(?!\d)|(?<!\w)_|_(?!\w)")
ENTITIES = {"<": "&lt;", "&": "&amp;"}


def md_text(text) -> str:
    """A string from a log as markdown text that shows exactly it: markup and HTML escaped, on one line."""
    return MARKUP.sub(lambda m: ENTITIES.get(m.group(), "\\" + m.group()), str(text).replace("\n", " "))


def code(text) -> str:
    """A string from a log as a markdown code span, whatever backticks it holds (CommonMark: a fence of more
    backticks than any run in it, and a space inside where it starts or ends with one)."""
    text = str(text).replace("\n", " ")
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


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
    unmet: str  # where no run met the criterion, the first words under the title
    featured: str
    printed: list[str]  # what rank 0 printed
    criterion: str
    steps: list[Step]
    commit: str
    run_commit: str
    resumed: str
    scaling: Section  # its Table, then the Bullets that explain it
    profile: Section | None  # the time profile's table, where a run has one
    demonstrate: list[Section]
    source: object = None  # the file quoted (student_source.Source); None: the shipped raw_ddp.py
