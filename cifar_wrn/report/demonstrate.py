"""The course's Demonstrate items 1-6 as sections: facts from the logs and the shipped raw_ddp.py, the
explanations as the student's slots."""

import json

from .changes import optimisations, recipe_changes
from .content import Section, Table, Text, code, md_text
from .featured import featured_group, main_run
from .logs import Run, full_recipe, is_number
from .notes import EXPLAIN, slot
from .scaling import differences, mean_images_per_sec, profile_parts, run_time_to_target
from .sharding import BUCKET_CAP_MB, FIRST_BUCKET_MB, MIB, accelerate_shards, ddp_buckets, gradient_bytes, shards
from .student_source import Source, shipped_source
from .tables import PROFILE_TITLE, fmt

WALKTHROUGH = "docs/ddp_walkthrough.md"
NO_COUNTS = "_No {} in these logs (a text log holds none)._"


def _explain(notes: dict, key: str) -> Text:
    return Text(f"**Explanation:** {slot(notes, 'explain', key, EXPLAIN[key])}")


def topology_item(runs: list[Run], source: Source) -> Section:
    layouts = "; ".join(
        f"{code(r.label)} draws {r.num_nodes} node(s) x {r.num_gpus} "
        f"{'GPU(s)' if r.header['device'] == 'cuda' else 'CPU process(es)'}, "
        + (f"ranks 0-{r.world_size - 1}" if r.world_size > 1 else "rank 0")
        + f", {md_text(r.header['backend'])}"
        for r in runs
    )
    text = (
        "Each run's layout (its diagram and text topology: report.md's section of the run; the PDF's section "
        '"Scaling" shows the featured run\'s): '
        + layouts
        + f". In {source.name}, the ranks (R1.2), the GPU pinning (R1.7) and init_process_group (R1.3). "
        + f"The concepts: {WALKTHROUGH}."
    )
    quoted = source.quote(("R1.2", "R1.7", "R1.3"), "dist.init_process_group(")
    return Section("D1", "Demonstrate 1: process topology and rank assignment", [Text(text), quoted])


def _accelerate_row(r: Run, split: str, n: int, b: int | None) -> list:
    sh = accelerate_shards(n, r.world_size, b or r.recipe.get("eval_batch_size", 500), drop_last=b is not None)
    steps = f"{sh['steps']} x {b} ({sh['unused']} unused: the short batch and the last round)"
    row = [r.label, split, n, r.world_size, sh["shard"], sh["padding"]]
    return row + [", ".join(map(str, sh["padded_ranks"])) or "none", "–" if b is None else steps]


def _sampler_row(r: Run, split: str, n: int, b: int | None) -> list:
    sh = shards(n, r.world_size, b)
    steps = "–"
    if b is not None:
        logged = r.header.get("steps_per_epoch")
        steps = f"{sh['steps']} x {b} ({sh['dropped']} dropped)"
        steps += "" if logged in (None, sh["steps"]) else f"; the log says {logged}"
    padded = ", ".join(map(str, sh["padded_ranks"])) or "none"
    return [r.label, split, n, r.world_size, sh["shard"], sh["padding"], padded, steps]


def _partition_rows(runs: list[Run]) -> tuple[list[list], bool]:
    """The shards of each run's training and validation images; whether any run used Accelerate's prepare()."""
    rows, accelerate = [], False
    for r in runs:
        batch = r.header.get("per_device_batch_size")
        prepared = r.header.get("trainer") == "accelerate" and r.recipe.get("data_pipeline") != "device"
        accelerate |= prepared
        for split, key, b in (("train", "train_images", batch), ("validation", "val_images", None)):
            n = r.header.get(key)
            if isinstance(n, int) and prepared and isinstance(batch, int):
                rows.append(_accelerate_row(r, split, n, b))
            elif isinstance(n, int):
                rows.append(_sampler_row(r, split, n, b))
    return rows, accelerate


ACCELERATE_DEALS = (
    "For accel_train.py's DataLoader path there is no DistributedSampler: Accelerate's prepare() (A1.5) "
    "deals the shuffled loader's batches out in rounds, rank r taking batches r, r + W, ... "
    "(training drops the short batch and a last incomplete round; validation completes it with "
    "repeats that gather_for_metrics leaves out). "
)


def partitioning_item(runs: list[Run], source: Source) -> Section:
    rows, accelerate = _partition_rows(runs)
    text = (
        "DistributedSampler (R1.5) gives each rank ceil(n / world size) indices; the padding "
        "(shard x world size - n) repeats the first indices, one each on the last ranks. Training "
        "batches drop the short last one (drop_last); validation leaves the repeats out of its sums. "
        + (ACCELERATE_DEALS if accelerate else "")
        + "From each header's image counts and per-process batch:"
    )
    head = ["run", "split", "images", "ranks", "per rank", "padding", "ranks holding a repeat", "steps per epoch"]
    return Section(
        "D2",
        "Demonstrate 2: data partitioning",
        [
            Text(text),
            Table(head, rows) if rows else Text(NO_COUNTS.format("image counts")),
            Text("The sampler and its new shuffle each epoch (R1.6):"),
            source.quote(("R1.6", "R1.5"), "= DistributedSampler("),
        ],
    )


def _gradient_row(r: Run, sent: tuple[int, int]) -> list:
    comm = [e["comm_estimate"] for e in r.epochs if is_number(e.get("comm_estimate"))]
    epoch = sum(e["epoch_time"] for e in r.epochs) / len(r.epochs) if r.epochs else None
    measured = (
        f"{sum(comm) / len(comm):.3f} s/epoch ({100 * sum(comm) / len(comm) / epoch:.1f}% of the epoch)"
        if comm and epoch
        else "not measured (run with --profile)"
    )
    return [
        r.label,
        r.header["model_parameters"],
        "bf16" if r.recipe.get("grad_compression") == "bf16" else "fp32",
        f"{sent[0] / MIB:.1f} MiB",
        ddp_buckets(r) or f"~{sent[1]}",
        f"{2 * (r.world_size - 1) / r.world_size * sent[0] / MIB:.1f} MiB",
        measured,
    ]


def gradient_sync_item(runs: list[Run], source: Source) -> Section:
    rows = [_gradient_row(r, gradient_bytes(r)) for r in runs if gradient_bytes(r) and r.world_size > 1]
    text = (
        "DDP (R1.8) all-reduces every gradient once per step, in buckets, overlapped with backward. "
        "Bytes = parameters x 4 (gradients in the parameters' fp32, also under bf16 autocast; half with "
        f"grad_compression bf16). Buckets: counted as DDP fills them, whole gradients in reverse order up to its "
        f"caps ({FIRST_BUCKET_MB} MiB first, then {BUCKET_CAP_MB} MiB or the recipe's ddp_bucket_cap_mb; "
        "~: an estimate, for another model). "
        "A ring all-reduce sends 2(N-1)/N of the bytes per rank. "
        "The measured cost is --profile's all-reduce estimate (the last batch's backward with and "
        "without synchronisation, times the steps)."
    )
    head = ["run", "parameters", "gradients", "all-reduced per step", "buckets", "sent per rank (ring)"]
    several = any(r.world_size > 1 for r in runs)
    none = NO_COUNTS.format("parameter counts") if several else "_No run with more than one process._"
    table = Table(head + ["measured all-reduce"], rows) if rows else Text(none)
    blocks = [Text(text), table, source.quote(("R1.8",), "= DDP(")]
    return Section("D3", "Demonstrate 3: gradient synchronisation", blocks)


def aggregation_item(runs: list[Run], source: Source) -> Section:
    text = (
        f"The R1.9 lines of {source.name} as they stand: images/sec is a SUM over the ranks (dist.reduce to "
        "rank 0), validation loss and accuracy an AVG (all_reduce of sums and counts)."
    )
    head = ["run", "last epoch", "images/sec (SUM over ranks)", "per rank (SUM / N)", "val loss (AVG)"]
    last = lambda r: r.epochs[-1]
    rows = [
        [
            r.label,
            last(r)["epoch"],
            fmt(last(r)["images_per_sec"], 1),
            fmt(last(r)["images_per_sec"] / r.world_size, 1),
            fmt(last(r)["val_loss"], 4),
            fmt(last(r)["val_accuracy"], 4),
        ]
        for r in runs
        if r.epochs
    ]
    blocks = [Text(text), source.quote(("R1.9",)), Table(head + ["val accuracy (AVG)"], rows)]
    return Section("D4", "Demonstrate 4: aggregating metrics across ranks", blocks)


def scaling_item(runs: list[Run]) -> Section:
    profile = (
        f'the section "{PROFILE_TITLE}" shows where an epoch\'s time goes'
        if any(profile_parts(r.epochs) for r in runs)
        else "a run with --profile adds a time profile, where an epoch's time goes"
    )
    text = f'The scaling table is in the section "Scaling", computed only between comparable runs; {profile}.'
    return Section("D5", "Demonstrate 5: 1 vs N processes, Amdahl's law and the bottleneck", [Text(text)])


def _recipe_change(before: Run, after: Run) -> str:
    if before.text_log or after.text_log:
        return "not logged (a text log holds no recipe)"
    old, new = full_recipe(before.recipe), full_recipe(after.recipe)
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return "; ".join(f"{k}: {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in keys) or "none"


def _measures(r: Run) -> list:
    return [
        fmt(run_time_to_target(r), missing="not reached"),
        fmt(mean_images_per_sec(r.epochs), 1),
        fmt(r.epochs[-1]["val_accuracy"], 4) if r.epochs else "–",
        len(r.epochs),
    ]


def compare_blocks(before: Run, after: Run) -> list:
    """A before/after table from two of the student's logs, and what else than the recipe differs."""
    # the recipe change, the stopping rule included, is the table's own column
    other = [str(d) for d in differences([before, after]) if d.key not in ("recipe", "stopping rule")]
    if before.world_size != after.world_size:
        other.append(f"world size ({before.world_size} vs {after.world_size})")
    head = ["", "recipe change", "Cumulative Time to target (s)", "mean images/sec", "final val accuracy", "epochs"]
    rows = [
        [f"before: {before.label}", _recipe_change(before, after), *_measures(before)],
        [f"after: {after.label}", "", *_measures(after)],
    ]
    title = f"**Before/after** ({code(f'--compare {before.path} {after.path}')})"
    title += f"; **not like for like: they also differ in {'; '.join(other)}**" if other else ""
    return [Text(title + ":"), Table(head, rows)]


def optimisations_item(runs: list[Run], notes: dict, compare: list[tuple[Run, Run]]) -> Section:
    run = main_run(runs)
    changes = optimisations(run)
    if run.text_log:
        text = f"{code(run.label)} is a text log: it holds no recipe, so your changes are yours to name (with --notes)."
    elif changes:
        text = (
            f"The recipe keys where {code(run.label)}'s recipe differs from recipes/baseline.yaml in what it computes:"
        )
    else:
        text = f"None: {code(run.label)} trained with the baseline recipe, unchanged."
    blocks: list = [Text(text)]
    if changes:
        rows = [[key, base, used, slot(notes, "optimisations", key, "why")] for key, base, used in changes]
        blocks.append(Table(["recipe key", "baseline", "used", "why"], rows))
    other = [c for c in recipe_changes(run) if c not in changes]
    if other:
        blocks.append(
            Text(
                "Not optimisations (they set how long the run goes, when it stops or its random seed, not what "
                "it computes): " + "; ".join(md_text(f"{key} {base} -> {used}") for key, base, used in other) + "."
            )
        )
    for before, after in compare:
        blocks += compare_blocks(before, after)
    if not compare:
        blocks.append(
            Text(
                "**Before/after:** [you measure: pass the logs of a run without and with the change, "
                "`--compare BEFORE.jsonl AFTER.jsonl`]"
            )
        )
    return Section("D6", "Demonstrate 6: optimisations", blocks)


def demonstrate(runs: list[Run], notes: dict, compare: list[tuple[Run, Run]], source=None) -> list[Section]:
    """Demonstrate 1-6, each closing with the student's explanation (EXPLAIN's slot for it); the code quoted
    from `source` (student_source.Source: the shipped raw_ddp.py by default)."""
    source = source or shipped_source()
    items = [
        (topology_item(runs, source), "topology"),
        (partitioning_item(runs, source), "partitioning"),
        (gradient_sync_item(runs, source), "gradient_sync"),
        (aggregation_item(featured_group(runs)[0], source), "aggregation"),
        (scaling_item(runs), "scaling"),
        (optimisations_item(runs, notes, compare), "optimisations"),
    ]
    for section, key in items:
        section.blocks.append(_explain(notes, key))
    return [section for section, _ in items]
