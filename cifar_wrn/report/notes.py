"""The student's own words (--notes notes.yaml; docs/report-example/notes.yaml shows the form, installed as
cifar_wrn/report/example/notes.yaml): each entry fills one slot; what is left out stays a [you write: ...] slot."""

from pathlib import Path

from ..errors import UserError
from .changes import optimisations
from .content import Slot
from .ddp_source import shipped_steps
from .featured import main_run
from .logs import Run

# What the course asks the student to explain, one slot per Demonstrate item (notes.yaml's `explain:`).
EXPLAIN = {
    "topology": "how the ranks map onto nodes and GPUs, and why each process is pinned to its own GPU",
    "partitioning": "why each rank gets a disjoint shard, why the sampler pads, and what set_epoch changes",
    "gradient_sync": "what DDP's all-reduce does during backward, and why every replica stays identical",
    "aggregation": "why images/sec is summed over the ranks while loss and accuracy are averaged",
    "scaling": "where the time goes (the bottleneck), and what Amdahl's law predicts for more GPUs",
    "optimisations": "why each change helps, judged from your before/after measurements",
}
# The example notes: installed in the package (pyproject.toml's package data), kept in the checkout's docs/.
_INSTALLED_EXAMPLE = Path(__file__).resolve().parent / "example" / "notes.yaml"
EXAMPLE_NOTES = str(_INSTALLED_EXAMPLE) if _INSTALLED_EXAMPLE.is_file() else "docs/report-example/notes.yaml"
NOTES_HELP = "steps: {R1.<n>: why}, explain: {" + ", ".join(EXPLAIN) + "}, optimisations: {recipe key: why}"


def slot(notes: dict, section: str, key: str, what: str) -> Slot:
    """The student's own text from --notes, or a marked slot saying what to write there."""
    return Slot(what, notes.get(section, {}).get(key) or "")


def _load(path):
    """The YAML of `path`, or a UserError naming where it cannot be read."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--notes {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    except yaml.YAMLError as exc:  # its message spans lines: keep where and what
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(
            f"--notes {path}: cannot be read as YAML{where} ({getattr(exc, 'problem', None) or 'not YAML'})"
        ) from None


def _check(path, raw, allowed: dict[str, list[str]]) -> None:
    if not isinstance(raw, dict) or not set(raw) <= set(allowed):
        raise UserError(f"--notes {path}: expected {NOTES_HELP}")
    for section, entries in raw.items():
        if not isinstance(entries, dict):
            raise UserError(f"--notes {path}: {section}: expected KEY: TEXT entries")
        for key, text in entries.items():
            if key not in allowed[section]:
                raise UserError(
                    f"--notes {path}: {section}: {key!r} is not one of "
                    f"{', '.join(allowed[section]) or 'none (the run used the baseline recipe)'}"
                )
            if not isinstance(text, str) or not text.strip():
                raise UserError(f"--notes {path}: {section}: {key}: expected your text")


def read_notes(path, runs: list[Run]) -> dict[str, dict[str, str]]:
    """The student's own words by section and key, each on one line; {} without a file."""
    if path is None:
        return {}
    raw = _load(path)
    allowed = {
        "steps": [step for step, _ in shipped_steps()],
        "explain": list(EXPLAIN),
        "optimisations": [key for key, _, _ in optimisations(main_run(runs))],
    }
    _check(path, raw, allowed)
    return {section: {key: " ".join(text.split()) for key, text in entries.items()} for section, entries in raw.items()}
