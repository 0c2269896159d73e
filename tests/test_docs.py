"""The docs' promises, each kept by a test: the word budgets, each document's first line (who it is for and
what it answers), and every markdown link and every backticked repository path resolving.

The documents: README.md and docs/*.md (the ones a student reads, counted together), and docs/record/ (the
maintainers' record, counted apart). Each checker takes the repository root and returns its problems, one line
each, so that the last tests here can hand it a deliberately broken copy in a temporary folder.

A file the record names that is gone from the tree is cited at the commit that had it, as git writes it:
`abc1234:bench/old_script.py` (`git show` prints it); a bare `bench/old_script.py` must exist."""

import os
import re
from glob import glob
from pathlib import Path
from urllib.parse import unquote

import pytest
from helpers import REPO

WORD_BUDGETS = {"README.md": 1_500, "docs/optimizations.md": 3_000, "docs/benchmarks.md": 3_000}
READ_TOTAL = 25_000  # README.md + docs/*.md
RECORD_TOTAL = 15_000  # docs/record/**/*.md
FIRST_LINE = re.compile(r"^\*Reader: .+\. Answers: .+\?\*$")
PATH_PREFIXES = ("cifar_wrn/", "bench/", "tests/", "docs/", "slurm/", "course/", "recipes/", "accelerate_configs/")
BARE_FILE = re.compile(r"^[\w.-]+\.(py|toml|yaml|yml|sh|sbatch|cfg)$")  # a file name without a folder
# Files of other projects that the docs name bare (Accelerate's sources, airbench's script): not this repository's.
OTHER_PROJECTS = {"accelerator.py", "data_loader.py", "state.py", "airbench94_muon.py"}
NOT_IN_TREE = {".git", ".venv", "runs", "data", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}


def words(path: Path) -> int:
    return len(path.read_text().split())


def read_docs(root: Path) -> list[Path]:
    """The documents a student reads: README.md and docs/*.md (not the subfolders)."""
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def record_docs(root: Path) -> list[Path]:
    return sorted((root / "docs" / "record").glob("**/*.md"))


def all_docs(root: Path) -> list[Path]:
    return read_docs(root) + record_docs(root)


def counts(root: Path, files: list[Path]) -> str:
    return "\n".join(f"{words(f):>7,}  {f.relative_to(root)}" for f in files)


def word_budget_problems(root: Path) -> list[str]:
    problems = []
    for name, budget in WORD_BUDGETS.items():
        if (root / name).is_file() and words(root / name) > budget:
            problems.append(f"{name}: {words(root / name):,} words, over its {budget:,}")
    for files, total, what in (
        (read_docs(root), READ_TOTAL, "README.md + docs/*.md"),
        (record_docs(root), RECORD_TOTAL, "docs/record/**/*.md"),
    ):
        if sum(map(words, files)) > total:
            problems.append(f"{what}: {sum(map(words, files)):,} words, over {total:,}:\n{counts(root, files)}")
    return problems


def first_line_problems(root: Path) -> list[str]:
    files = read_docs(root) + sorted((root / "docs" / "record").glob("*.md"))
    return [
        f"{f.relative_to(root)}: line 1 is {f.read_text().partition(chr(10))[0][:100]!r}"
        for f in files
        if not FIRST_LINE.match(f.read_text().partition("\n")[0])
    ]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with the inline code spans kept."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None:
            if re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                fence = None
        else:
            lines.append((number, line))
    return lines


def without_code_spans(line: str) -> str:
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", line)


def code_spans(line: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"(`+)(?!`)(.*?)(?<!`)\1(?!`)", line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links, emphasis and code marks dropped), lower case, every
    character but letters, digits, '_', '-' and spaces dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes in a markdown file (a repeated one gets -1, -2, ...), and HTML ids."""
    found, seen, previous = set(), {}, ""
    for _, line in prose_lines(path.read_text()):
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)(\s+#+)?\s*$", line)
        setext = re.match(r"^ {0,3}(=+|-+)\s*$", line) and previous.strip() and not previous.lstrip().startswith("|")
        text = heading.group(1) if heading else previous if setext else None
        if text is not None:
            base = slug(text)
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
        found.update(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", line))
        previous = line
    return found


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(\s|$)")


def link_problems(root: Path) -> list[str]:
    problems = []
    for doc in all_docs(root):
        for number, line in prose_lines(doc.read_text()):
            prose = without_code_spans(line)
            for target in LINK.findall(prose) + [m.group(1) for m in [REFERENCE.match(prose)] if m]:
                where = f"{doc.relative_to(root)}:{number}: ({target})"
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http(s), mailto: not checked
                    continue
                file_part, _, anchor = unquote(target).partition("#")
                if file_part:
                    path = root / file_part.lstrip("/") if file_part.startswith("/") else doc.parent / file_part
                else:
                    path = doc
                if not path.exists():
                    problems.append(f"{where}: no such file {os.path.relpath(path, root)}")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    problems.append(f"{where}: no heading #{anchor} in {os.path.relpath(path, root)}")
    return problems


def braces(pattern: str) -> list[str]:
    """Shell brace expansion, one level at a time: a{0,1}b -> a0b, a1b."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [
        expanded
        for choice in match.group(1).split(",")
        for expanded in braces(pattern[: match.start()] + choice + pattern[match.end() :])
    ]


def cited_paths(line: str) -> list[str]:
    """The repository paths a line names in backticks: tokens starting with one of PATH_PREFIXES (or a bare file
    name such as raw_ddp.py), without a trailing :line, ::test or #anchor; placeholders (<...>, ...) left out."""
    paths = []
    for span in code_spans(line):
        for token in re.split(r"[\s=]+", span):
            token = token.strip("\"'(),;")
            if not token or re.search(r"[<>]|\.\.\.|…", token):
                continue
            token = re.split(r"[:#]", token)[0].rstrip(".,;")
            if token.startswith(PATH_PREFIXES) or BARE_FILE.match(token):
                paths.append(token)
    return paths


def file_names(root: Path) -> set[str]:
    """The names of the files in the tree (outside .git, run outputs, data, caches)."""
    names = set()
    for _, subfolders, files in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in NOT_IN_TREE and not s.endswith(".egg-info")]
        names.update(files)
    return names


def cited_path_problems(root: Path) -> list[str]:
    problems, names = [], None
    for doc in all_docs(root):
        for number, line in prose_lines(doc.read_text()):
            for path in cited_paths(line):
                where = f"{doc.relative_to(root)}:{number}: `{path}`"
                if "/" not in path:  # a bare name: a top-level file, or one somewhere in the tree (model.py)
                    names = file_names(root) if names is None else names
                    if not (root / path).exists() and path not in names and path not in OTHER_PROJECTS:
                        problems.append(f"{where}: no file of that name in the repository")
                elif re.search(r"[*?\[{]", path):  # a glob: each of its {a,b} alternatives matches a file
                    if not all(glob(str(root / p), recursive=True) for p in braces(path)):
                        problems.append(f"{where}: the pattern matches nothing")
                elif not (root / path).exists():
                    problems.append(f"{where}: no such path")
    return problems


def report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


# The repository's own docs.


@pytest.mark.parametrize(
    "check",
    [word_budget_problems, first_line_problems, link_problems, cited_path_problems],
    ids=["word budgets", "first line: reader and question", "links resolve", "cited paths exist"],
)
def test_the_docs_pass_each_check(check):
    problems = check(REPO)
    assert not problems, report(problems)


# The checkers themselves, on a broken copy in a temporary folder: each problem is found, a sound doc passes.

GOOD_LINE = "*Reader: a student. Answers: what is this?*"


def small_repo(tmp_path: Path, readme: str, doc: str = "", record: str = "") -> Path:
    (tmp_path / "docs" / "record").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "real.py").write_text("")
    (tmp_path / "raw_ddp.py").write_text("")
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "docs" / "guide.md").write_text(doc or f"{GOOD_LINE}\n\n# Guide\n\n## The epoch line\n")
    (tmp_path / "docs" / "record" / "notes.md").write_text(record or f"{GOOD_LINE}\n\n# Notes\n")
    return tmp_path


def test_the_word_budgets_name_each_file_over_and_print_the_counts(tmp_path):
    root = small_repo(tmp_path, f"{GOOD_LINE}\n\n" + "word " * 1_400)
    assert word_budget_problems(root) == []
    (root / "README.md").write_text("word " * 1_501)
    (root / "docs" / "optimizations.md").write_text("word " * 3_001)
    (root / "docs" / "big.md").write_text("word " * 21_000)
    (root / "docs" / "record" / "run" / "story.md").parent.mkdir()
    (root / "docs" / "record" / "run" / "story.md").write_text("word " * 15_001)  # subfolders count in the record
    problems = word_budget_problems(root)
    assert problems[0] == "README.md: 1,501 words, over its 1,500"
    assert problems[1] == "docs/optimizations.md: 3,001 words, over its 3,000"
    assert problems[2].startswith("README.md + docs/*.md: 25,5") and " 21,000  docs/big.md" in problems[2]
    assert problems[3].startswith("docs/record/**/*.md: 15,0") and "docs/record/run/story.md" in problems[3]
    assert len(problems) == 4


def test_the_first_line_check_names_each_doc_without_its_reader_line(tmp_path):
    root = small_repo(tmp_path, f"{GOOD_LINE}\n\n# Title\n")
    assert first_line_problems(root) == []
    (root / "README.md").write_text("# Title\n")
    (root / "docs" / "record" / "notes.md").write_text("*Reader: a maintainer. Answers: what happened.*\n")
    assert first_line_problems(root) == [
        "README.md: line 1 is '# Title'",
        "docs/record/notes.md: line 1 is '*Reader: a maintainer. Answers: what happened.*'",
    ]


def test_the_link_check_finds_missing_files_and_headings_and_ignores_code(tmp_path):
    readme = f"""{GOOD_LINE}

# Title

## Install, then run: `raw_ddp.py`

[guide](docs/guide.md), [its epoch line](docs/guide.md#the-epoch-line), [install](#install-then-run-raw_ddppy),
[web](https://example.org/nowhere), [a folder](bench/), [`code` in text](raw_ddp.py)
`[not a link](gone.md)`
```text
[not a link either](gone.md)
```
"""
    root = small_repo(tmp_path, readme, record=f"{GOOD_LINE}\n\n[up](../guide.md#the-epoch-line)\n")
    assert link_problems(root) == []
    (root / "README.md").write_text(readme + "[a](docs/gone.md) [b](docs/guide.md#no-such) [c](#install)\n")
    assert link_problems(root) == [
        "README.md:13: (docs/gone.md): no such file docs/gone.md",
        "README.md:13: (docs/guide.md#no-such): no heading #no-such in docs/guide.md",
        "README.md:13: (#install): no heading #install in README.md",
    ]


def test_headings_slug_as_github_does(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text('# 6. Data on the GPU (`data_pipeline: device`)\n## Run 3\n## Run 3\nSetext\n---\n<a id="x"></a>\n')
    assert anchors(doc) == {"6-data-on-the-gpu-data_pipeline-device", "run-3", "run-3-1", "setext", "x"}


def test_the_cited_path_check_finds_missing_paths_globs_and_names(tmp_path):
    readme = f"""{GOOD_LINE}

Run `python bench/real.py --out x` (`bench/real.py:12`, `raw_ddp.py`, `bench/*.py`, `bench/{{real,re*}}.py`).
Placeholders and commits pass: `bench/<name>.py`, `docs/runs/...`, `abc1234:bench/retired.py`, `runs/x.jsonl`.
```bash
python bench/not_checked_in_code_blocks.py
```
"""
    root = small_repo(tmp_path, readme)
    assert cited_path_problems(root) == []
    (root / "README.md").write_text(
        readme + "`bench/gone.py`, `docs/runs/*.jsonl`, `bench/{real,gone}.py`, `train.py`\n"
    )
    assert cited_path_problems(root) == [
        "README.md:8: `bench/gone.py`: no such path",
        "README.md:8: `docs/runs/*.jsonl`: the pattern matches nothing",
        "README.md:8: `bench/{real,gone}.py`: the pattern matches nothing",
        "README.md:8: `train.py`: no file of that name in the repository",
    ]
