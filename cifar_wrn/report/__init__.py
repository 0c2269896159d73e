"""The course's report from run logs: R3 and the Demonstrate items 1-6, tables, scaling numbers and figures.

    python -m cifar_wrn.report runs/baseline-1x1-20261202-130000 runs/baseline-1x2-20261202-131500 --out report
    python -m cifar_wrn.report runs/123456 runs/123457 --out report --pdf report.pdf --notes notes.yaml
    python -m cifar_wrn.report runs/123458/train.log runs/123459/train.log --source my_cifar10.py --out report

Each input is a run folder (raw_ddp.py writes runs/<recipe>-<nodes>x<procs>-<YYYYmmdd-HHMMSS>/log.jsonl,
accel_train.py runs/accel-<recipe>-..., a Slurm job runs/<job id>/log.jsonl) or a log file (--log-json
PATH), or a text log: rank 0's printed epoch lines (a job's train.log, or any file of them; the world size from
the job's banner or --world-size). A log is checked: a number no run can log (NaN, an accuracy outside [0, 1], a
negative time) or a header value of another type is refused in one line naming the file and line. It writes
DIR/report.md with PNG figures next to it (every string from a log escaped), saying first when no run met the
criterion:

- the DDP steps (R1): the line numbers of each `# R1.<n>` tag of the raw_ddp.py next to this package, or of
  each step in the student's own file (--source: by its tag, or else by its call; the missing ones listed);
- the scaling table: time to the stopping criterion, images/sec, final accuracy, and, only between
  comparable runs (same recipe, data, model and device type, differing in world size), speedup, parallel
  efficiency, the Karp-Flatt serial fraction and Amdahl's predictions; other runs are named with what differs;
- Demonstrate 1-6 as facts: topology and the pinning/init_process_group lines, each rank's shard and
  padding, the gradient bytes and DDP buckets per step (and the measured all-reduce with --profile), the
  R1.9 aggregation lines with the reduced values, and the recipe's differences from baseline.yaml with
  before/after from the student's own logs (--compare BEFORE AFTER);
- per run: the header facts, the process topology (text and diagram) and the epoch log as a table;
- figures (matplotlib, the optional extra `plot`); without it the tables are still written; the figures, the
  time profile and Demonstrate 4 show only the featured run's recipe, data, model and device;
- with `--pdf FILE`, the same in at most 4 pages (fpdf2); a longer one is written, then its longest sections
  are named and the exit status is 2.

Every explanation the course asks for is a marked slot, `[you write: ...]`, or the student's own text from
`--notes notes.yaml` (docs/report-example/notes.yaml shows the form). report.md holds nothing but what the
logs and the code give (no date, no absolute path unless given one), so the same inputs write the same file.

The modules, one job each:

- logs.py: reading and checking run logs (a resumed run read as one); textlog.py: text logs of printed lines;
- scaling.py: time to target (stopping.criterion_met, the course's stop rule), speedup, efficiency,
  Karp-Flatt, Amdahl, and which runs are comparable;
- sharding.py: shards, padding and gradient bytes per rank;
- ddp_source.py: the `# R1.<n>` tags and quoted statements of raw_ddp.py; student_source.py: the file the
  report quotes (raw_ddp.py or --source) and where each step is in it;
- content.py: the document as dataclasses (sections, text, tables, code, slots, steps);
- notes.py: the student's --notes and the slots they fill;
- changes.py: the recipe against recipes/baseline.yaml (the optimisations);
- featured.py: the run the report features, its printed lines and criterion;
- tables.py: the steps, scaling, profile, header and epoch tables;
- demonstrate.py: Demonstrate 1-6;
- topology.py: the topology as text and as a diagram; figures.py: the PNGs;
- markdown.py: report.md; pdf.py: the PDF, columns.py its tables' column widths; cli.py: the command line.
"""
