"""The program the report quotes: the shipped raw_ddp.py, or the student's own file (--source FILE). In the
student's file each of the eleven steps is found by its `# R1.<n>` tag, or else by the call the step names
(comments and docstrings aside); what is not found becomes a checklist the student can act on."""

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .content import Code, where_text
from .ddp_source import COMPOUND, RAW_DDP, code_block, code_lines, ddp_steps, shipped_steps, statement_lines
from .logs import read_text

TITLES = {
    "R1.1": "the command line: --num-nodes --node-id --num-gpus",
    "R1.2": "world size and global rank",
    "R1.3": "init_process_group: nccl on GPU, gloo on CPU",
    "R1.4": "download on one process per node, then a barrier",
    "R1.5": "DistributedSampler: a disjoint shard per rank",
    "R1.6": "set_epoch: a new shuffle every epoch",
    "R1.7": "one GPU per process: cuda:<local_rank>",
    "R1.8": "DistributedDataParallel",
    "R1.9": "reduce images/sec, all_reduce(AVG) validation",
    "R1.10": "only rank 0 prints",
    "R1.11": "torch.multiprocessing.spawn under __main__",
}
# What finds an untagged step: (what the student should see, the pattern starting on a code line, read with the rest
# of its statement: (?s) where a call may be split over lines); every part must be found.
CALLS = {
    "R1.1": [
        (f"an argparse `{flag}`", rf"(?s)add_argument\(.*['\"]{flag}['\"]")
        for flag in ("--num-nodes", "--node-id", "--num-gpus")
    ],
    "R1.2": [
        ("`world_size = <nodes> * <GPUs>`", r"\bworld_size\s*=(?!=)[^=]*\*"),
        ("`rank = <node> * <GPUs> + <local rank>`", r"\b(?:global_)?rank\s*=(?!=)(?=[^=]*\*)(?=[^=]*\+)"),
    ],
    "R1.3": [("`init_process_group(`", r"\binit_process_group\(")],
    "R1.4": [("`barrier(`", r"\bbarrier\(")],
    "R1.5": [("`DistributedSampler(`", r"\bDistributedSampler\(")],
    "R1.6": [("`<sampler>.set_epoch(epoch)`", r"sampler\w*\.set_epoch\(")],
    "R1.7": [
        ("`cuda:<local_rank>` or `torch.cuda.set_device(`", r"\bset_device\(|cuda:(\{|%|['\"]\s*\+)|['\"]cuda['\"]\s*,")
    ],
    "R1.8": [("`DistributedDataParallel(` (or `DDP(`)", r"\b(?:DDP|DistributedDataParallel)\(")],
    "R1.9": [
        ("`dist.reduce(` of images/sec", r"\breduce\("),
        ("`all_reduce(..., AVG)`", r"(?s)\ball_reduce\(.*\bAVG\b"),
    ],
    "R1.10": [("`if rank == 0:` before a `print(`", r"\bif\b.*\b(?:global_)?rank\s*==\s*0\b")],
    "R1.11": [("`mp.spawn(`", r"\bspawn\(")],
}
PRINTS_NEXT = "R1.10"  # its `if` counts only with a print on the same or the next code line


@dataclass
class Source:
    """The file the report quotes, and where each step is in it."""

    path: Path
    name: str  # as the report cites it: raw_ddp.py, or --source as given
    steps: dict[str, list[int]]  # step -> its lines
    untagged: set[str] = field(default_factory=set)  # steps found by their call, not their tag
    missing: dict[str, list[str]] = field(default_factory=dict)  # step -> the parts not found
    tree: ast.Module | None = None  # the student's file parsed; None for the shipped raw_ddp.py

    @property
    def shipped(self) -> bool:
        return self.tree is None

    def where(self, step: str) -> str:
        lines = self.steps.get(step)
        if not lines:
            return f"not found in {self.name}"
        return where_text(self.name, lines) + (" (by its call, untagged)" if step in self.untagged else "")

    def quote(self, steps: tuple, statement: str = "") -> Code:
        """The lines of `steps` as they stand; in raw_ddp.py the whole statement opening with `statement` too
        (its step is then the last of `steps`, quoted by that statement alone)."""
        if self.shipped:
            tagged = steps[:-1] if statement else steps
            lines = [line for step in tagged for line in code_lines(step)]
            return code_block(lines + (statement_lines(statement) if statement else []), self.name)
        return code_block(self._statements([n for step in steps for n in self.steps.get(step, [])]), self.name)

    def _statements(self, numbers: list[int]) -> list[str]:
        """Each code line cited, as the whole simple statement that holds it (a compound one's line alone)."""
        text, spans = self.path.read_text(encoding="utf-8").splitlines(), statement_spans(self.tree)
        out = []
        for n in (n for n in numbers if not text[n - 1].lstrip().startswith("#")):
            first, last = spans.get(n, (n, n))
            out += [f"{m}: {text[m - 1].strip()}" for m in range(first, last + 1)]
        return out

    def checklist(self) -> list[str]:
        """One item per step not wholly found: what is missing, and what to do."""
        return [
            f"[ ] {step} ({TITLES[step]}): no {' and no '.join(parts)} in {self.name}: add it, or tag the line that "
            f"does it `# {step}`"
            for step, parts in self.missing.items()
        ]


def shipped_source() -> Source:
    return Source(RAW_DDP, "raw_ddp.py", dict(shipped_steps()))


def code_only(text: str, tree: ast.Module) -> list[str]:
    """The file's lines with comments and bare strings (docstrings) blanked: a call named there is no call."""
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines[node.lineno - 1 : node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            lines[row - 1] = lines[row - 1][:column]
    return lines


def statement_spans(tree: ast.Module) -> dict[int, tuple[int, int]]:
    """Each line of a simple statement (not an if, for, def, ...) -> the statement's first and last line."""
    simple = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not isinstance(n, COMPOUND)]
    return {n: (s.lineno, s.end_lineno) for s in simple for n in range(s.lineno, s.end_lineno + 1)}


def _found(step: str, pattern: str, code: list[str], spans: dict) -> list[int]:
    """The lines where `pattern` starts, read with the rest of their statement (a call split over lines)."""
    rest = lambda n: "\n".join(code[n - 1 : spans.get(n, (n, n))[1]])
    hits = [n for n, line in enumerate(code, 1) if (m := re.search(pattern, rest(n))) and m.start() < len(line)]
    if step == PRINTS_NEXT:
        following = lambda n: next((line for line in code[n:] if line.strip()), "")
        hits = [n for n in hits if "print(" in code[n - 1] + following(n)]
    return hits


def _read(path: Path) -> tuple[str, ast.Module]:
    text = read_text(path, f"--source {path}", "a Python file", UserError)
    try:
        return text, ast.parse(text)
    except SyntaxError as exc:
        raise UserError(f"--source {path}, line {exc.lineno}: not Python ({exc.msg})") from None


def read_source(path) -> Source:
    """The shipped raw_ddp.py (no --source), or the student's file with each step found by tag or by call."""
    if path is None:
        return shipped_source()
    path = Path(path)
    text, tree = _read(path)
    tagged, code, spans = dict(ddp_steps(path)), code_only(text, tree), statement_spans(tree)
    source = Source(path, str(path), {}, tree=tree)
    for step, calls in CALLS.items():
        if tagged.get(step):
            source.steps[step] = tagged[step]
            continue
        found = {what: _found(step, pattern, code, spans) for what, pattern in calls}
        lines = sorted({n for hits in found.values() for n in hits})
        if lines:
            source.steps[step] = lines
            source.untagged.add(step)
        if not all(found.values()):
            source.missing[step] = [what for what, hits in found.items() if not hits]
    return source
