"""The command line: `cifar-wrn-report RUN... --out DIR [--pdf FILE] [--notes NOTES.yaml] ...` (main; also
`python -m cifar_wrn.report`)."""

import argparse
import os
import shlex
import sys
from pathlib import Path

from ..errors import UserError
from .content import PdfContent, code
from .demonstrate import demonstrate
from .featured import (
    beside_text,
    criterion_text,
    featured_group,
    featured_text,
    main_run,
    printed_lines,
    unmet_text,
)
from .logs import Run
from .markdown import write_report
from .notes import EXAMPLE_NOTES, NOTES_HELP, read_notes
from .scaling import scaling
from .student_source import Source, read_source
from .tables import profile_section, resume_text, scaling_section, short_commit, steps
from .textlog import read_runs
from .topology import topology_name


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="cifar-wrn-report",
        description="The course's report (R3, Demonstrate 1-6) from run logs: tables, scaling numbers and figures.",
    )
    p.add_argument(
        "logs",
        nargs="+",
        metavar="RUN",
        help="a run folder (runs/<name>/, holding the log.jsonl the trainers write, or a job's train.log), a log "
        "file (--log-json PATH), or a text log: rank 0's printed epoch lines (runs/<job id>/train.log); one run each",
    )
    p.add_argument(
        "--source",
        metavar="FILE",
        help="your own script: the R1 table and the code listings quote it (each step by its `# R1.<n>` tag, or "
        "else by its call), and the steps not found are listed; default: the shipped raw_ddp.py",
    )
    p.add_argument(
        "--world-size",
        action="append",
        default=[],
        metavar="N|NODESxN",
        help="the processes of a text log without a job banner: one per such log, in the order given (the RUNs, "
        "then --compare's)",
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="what the text logs without a job banner ran on (default cuda)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for report.md and the PNG figures")
    p.add_argument("--no-figures", action="store_true", help="tables only, even when matplotlib is installed")
    p.add_argument(
        "--pdf",
        metavar="FILE",
        help="also write the course's R3 report, at most 4 pages, to FILE (needs "
        "fpdf2, the extra `pdf`; the figures need matplotlib)",
    )
    p.add_argument(
        "--caption", metavar="TEXT", help="with --pdf: a line under the title (what the runs are, where they ran)"
    )
    p.add_argument(
        "--notes",
        metavar="NOTES.yaml",
        help=f"your own explanations for the report's slots ({NOTES_HELP}); {EXAMPLE_NOTES} shows the form",
    )
    p.add_argument(
        "--compare",
        nargs=2,
        action="append",
        default=[],
        metavar=("BEFORE", "AFTER"),
        help="an optimisation's before/after: your runs (folders or logs) without and with it (repeatable)",
    )
    return p.parse_args(argv)


def pdf_content(runs: list[Run], notes: dict, compare: list, source: Source | None = None) -> PdfContent:
    """Every text and table the PDF shows, computed here so that report/pdf.py only lays them out."""
    from ..runlog import git_commit

    run = main_run(runs)
    return PdfContent(
        runs=runs,
        run=run,
        unmet=unmet_text(runs),
        featured=" ".join(
            filter(
                None,
                [
                    featured_text(runs) or f"The run shown in section 2 and Demonstrate 6: {code(run.label)}.",
                    beside_text(runs),
                ],
            )
        ),
        printed=printed_lines(run),
        criterion=criterion_text(run),
        steps=steps(notes, source),
        commit=short_commit(git_commit()),
        run_commit=short_commit(run.header.get("git_commit", "not logged")),
        resumed=resume_text(run),
        scaling=scaling_section(scaling(runs), runs),
        profile=profile_section(featured_group(runs)[0], runs),
        demonstrate=demonstrate(runs, notes, compare, source),
        source=source,
    )


def _write_pdf(args, argv, runs: list[Run], notes: dict, compare: list, report, figures, skipped, source) -> None:
    from .pdf import MAX_PAGES, write_pdf

    shown = {
        "accuracy": report.parent / "accuracy_vs_time.png",
        "topology": report.parent / topology_name(main_run(runs).config),
    }
    pages, sections = write_pdf(
        pdf_content(runs, notes, compare, source),
        args.pdf,
        {k: v for k, v in shown.items() if v in figures} | {"others": [f for f in figures if f not in shown.values()]},
        skipped,
        args.caption,
        "python -m cifar_wrn.report " + shlex.join(sys.argv[1:] if argv is None else map(str, argv)),
    )
    print(f"wrote {args.pdf} ({pages} page{'s' if pages > 1 else ''})")
    if pages > MAX_PAGES:  # written, so the student sees where: the longest sections, to shorten
        long = "; ".join(f"{title} ({length:.1f} pages)" for title, length in sections[:3])
        raise UserError(
            f"--pdf {args.pdf}: {pages} pages, more than the course's {MAX_PAGES}; the longest sections: {long}: "
            "shorten their notes, or report fewer runs at a time"
        )


def _writable_folder(flag: str, path: Path, folder: Path) -> None:
    """A UserError unless `folder` is, or can be made, a folder this process writes in: its nearest existing
    part is a writable folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: cannot write in {existing} (permission denied)")


def check_outputs(out, pdf) -> None:
    """Where the report writes, checked before anything is: --out a folder, --pdf a file in a folder, each
    one it can make (the report makes the folders) or write in."""
    _writable_folder("--out", Path(out), Path(out))
    if pdf:
        pdf = Path(pdf)
        if pdf.is_dir():
            raise UserError(f"--pdf {pdf}: is a folder; give a file name (report.pdf)")
        _writable_folder("--pdf", pdf, pdf.parent)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.caption and not args.pdf:
            raise UserError("--caption is for the PDF: give --pdf FILE too")
        if args.pdf:
            from .pdf import load_fpdf

            load_fpdf()  # before any work: without fpdf2, one line saying how to install it
        # every input read and every output checked before the first file is written
        given = read_runs(args.logs + [log for pair in args.compare for log in pair], args.world_size, args.device)
        runs, pairs = given[: len(args.logs)], given[len(args.logs) :]
        compare = list(zip(pairs[::2], pairs[1::2]))
        source = read_source(args.source)  # the file the report quotes: raw_ddp.py, or --source
        notes = read_notes(args.notes, runs)
        check_outputs(args.out, args.pdf)
        report, figures, skipped = write_report(
            runs, args.out, figures=not args.no_figures, notes=notes, compare=compare, source=source
        )
        print(
            f"wrote {report}"
            + (f" and {len(figures)} figure(s)" if figures else "")
            + (f" (figures skipped: {skipped})" if skipped else "")
        )
        if args.pdf:
            _write_pdf(args, argv, runs, notes, compare, report, figures, skipped, source)
        if source.missing:
            print(f"{source.name}: {len(source.missing)} of the 11 steps not (wholly) found; to do (also in {report}):")
            print("\n".join(f"  {item}" for item in source.checklist()))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
