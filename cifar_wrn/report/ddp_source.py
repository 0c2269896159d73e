"""Reading the raw_ddp.py next to the package (the checkout's, or the one `pip install .` put beside cifar_wrn/):
the lines of each `# R1.<n>` tag, and statements quoted as they stand, so the report cites wherever the code is now
(line numbers move with it)."""

import ast
import re
from pathlib import Path

from ..errors import UserError
from .content import Code

RAW_DDP = Path(__file__).resolve().parents[2] / "raw_ddp.py"  # a top-level module installed beside cifar_wrn/
TAG = re.compile(r"#\s*(R1\.\d+\b.*)$")
STEP = re.compile(r"R1\.\d+\b")


def _read(source: Path | None) -> str:
    return (source or RAW_DDP).read_text(encoding="utf-8")


def ddp_steps(source: Path | None = None) -> list[tuple[str, list[int]]]:
    """(step, line numbers) for each `# R1.<n>` tag in `source` (the shipped raw_ddp.py), by step number. A line
    cites every step its comment names ("# R1.2, R1.3, R1.7" on a call counts for all three)."""
    lines: dict[str, list[int]] = {}
    for number, text in enumerate(_read(source).splitlines(), 1):
        tag = TAG.search(text)
        for step in STEP.findall(tag.group(1)) if tag else []:
            lines.setdefault(step, []).append(number)
    return [(step, lines[step]) for step in sorted(lines, key=lambda step: int(step.split(".")[1]))]


def shipped_steps() -> list[tuple[str, list[int]]]:
    """ddp_steps of the shipped raw_ddp.py, or a UserError naming where the report looked for it. The report
    asks first, before it writes anything."""
    try:
        return ddp_steps()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise UserError(
            f"{RAW_DDP}: cannot be read ({why}): the report quotes the raw_ddp.py beside the cifar_wrn package; "
            "reinstall it (pip install .) or run the report from a checkout"
        ) from None


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def code_lines(step: str, source: Path | None = None) -> list[str]:
    """The code lines (not the comment-only ones) tagged `step`, as 'NNN: code', quoted as they stand in the
    shipped file."""
    text = _read(source).splitlines()
    numbers = dict(ddp_steps(source)).get(step, [])
    return [f"{n}: {text[n - 1].strip()}" for n in numbers if not _is_comment(text[n - 1])]


COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try)


def statement_lines(opening: str, source: Path | None = None) -> list[str]:
    """Each simple statement whose first line contains `opening`, whole, as 'NNN: code' (Python's own parse
    gives where it ends): the DDP wrap quoted however the formatter splits it."""
    code = _read(source)
    text, out = code.splitlines(), []
    statements = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.stmt) and not isinstance(n, COMPOUND)]
    for node in sorted(statements, key=lambda n: n.lineno):
        if opening in text[node.lineno - 1]:
            out += [f"{m}: {text[m - 1].strip()}" for m in range(node.lineno, node.end_lineno + 1)]
    return out


def code_block(lines: list[str], name: str = "raw_ddp.py") -> Code:
    """Quoted lines 'NNN: code' in file order, each once, under a line naming the file they quote."""
    lines = sorted(set(lines), key=lambda line: int(line.split(":")[0]))
    return Code([f"# quoted from {name} (line: code)"] + (lines or [f"(no such line in {name})"]))
