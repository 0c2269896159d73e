"""Reading the shipped raw_ddp.py: the lines of each `# R1.<n>` tag, and statements quoted as they stand, so the
report cites wherever the code is now (line numbers move with it)."""

import ast
import re
from pathlib import Path

from ..errors import UserError
from .content import Code

REPO = Path(__file__).resolve().parents[2]
RAW_DDP = REPO / "raw_ddp.py"
TAG = re.compile(r"#\s*(R1\.\d+\b.*)$")
STEP = re.compile(r"R1\.\d+\b")


def ddp_steps(source: Path = RAW_DDP) -> list[tuple[str, list[int]]]:
    """(step, line numbers) for each `# R1.<n>` tag in `source`, by step number. A line cites every step
    its comment names ("# R1.2, R1.3, R1.7" on a call counts for all three)."""
    lines: dict[str, list[int]] = {}
    for number, text in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        tag = TAG.search(text)
        for step in STEP.findall(tag.group(1)) if tag else []:
            lines.setdefault(step, []).append(number)
    return [(step, lines[step]) for step in sorted(lines, key=lambda step: int(step.split(".")[1]))]


def shipped_steps() -> list[tuple[str, list[int]]]:
    """ddp_steps of the shipped raw_ddp.py, or a UserError saying the report needs a checkout."""
    try:
        return ddp_steps()
    except OSError as exc:
        raise UserError(
            f"cannot read the raw_ddp.py whose step lines the report cites ({exc.strerror or exc}); "
            f"run it from a checkout of the project"
        ) from None


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def code_lines(step: str, source: Path = RAW_DDP) -> list[str]:
    """The code lines (not the comment-only ones) tagged `step`, as 'NNN: code', quoted as they stand in the
    shipped file."""
    text = source.read_text(encoding="utf-8").splitlines()
    numbers = dict(ddp_steps(source)).get(step, [])
    return [f"{n}: {text[n - 1].strip()}" for n in numbers if not _is_comment(text[n - 1])]


COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With, ast.Try)


def statement_lines(opening: str, source: Path = RAW_DDP) -> list[str]:
    """Each simple statement whose first line contains `opening`, whole, as 'NNN: code' (Python's own parse
    gives where it ends): the DDP wrap quoted however the formatter splits it."""
    code = source.read_text(encoding="utf-8")
    text, out = code.splitlines(), []
    statements = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.stmt) and not isinstance(n, COMPOUND)]
    for node in sorted(statements, key=lambda n: n.lineno):
        if opening in text[node.lineno - 1]:
            out += [f"{m}: {text[m - 1].strip()}" for m in range(node.lineno, node.end_lineno + 1)]
    return out


def code_block(lines: list[str]) -> Code:
    """Quoted lines 'NNN: code' in file order, each once."""
    lines = sorted(set(lines), key=lambda line: int(line.split(":")[0]))
    return Code(lines or ["(no such tagged line in raw_ddp.py)"])
