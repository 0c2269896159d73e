"""The run the report features (its epoch log, as rank 0 printed it, and its recipe), and why that one."""

from types import SimpleNamespace

from .logs import Run
from .scaling import differences, run_stop, run_time_to_target


def _standing(run: Run, runs: list[Run]) -> tuple[bool, bool, bool]:
    """What makes a run the one to feature: 2 processes, a comparable 1-process run among `runs` (the pair
    the scaling table compares), the criterion met."""
    paired = run.world_size > 1 and any(s.world_size == 1 and not differences([s, run]) for s in runs)
    return run.world_size == 2, paired, run_time_to_target(run) is not None


def main_run(runs: list[Run]) -> Run:
    """The run whose epoch log and recipe the report features: a 2-process run with a comparable 1-process
    run, one that met the criterion, then the most processes and epochs; the same whatever the order of the
    logs on the command line (the last tie goes to the path's name)."""
    order = lambda r: (_standing(r, runs), r.world_size if r.world_size != 2 else 0, len(r.epochs))
    best = max(order(r) for r in runs)
    return min((r for r in runs if order(r) == best), key=lambda r: str(r.path))


def _why_not(other: Run, run: Run, runs: list[Run]) -> str:
    """Why `other`, of the featured run's size, is not the one featured."""
    _, paired, met = _standing(run, runs)
    _, other_paired, other_met = _standing(other, runs)
    if paired and not other_paired:
        return f"`{other.label}` (no comparable 1-process run)"
    if met and not other_met:
        return f"`{other.label}` (did not meet the criterion)"
    if len(other.epochs) < len(run.epochs):
        return f"`{other.label}` (fewer epochs)"
    return f"`{other.label}` (equal standing: the first by path)"


def featured_text(runs: list[Run]) -> str:
    """Which run the report features and why, and why not each other 2-process run (empty with one run)."""
    run = main_run(runs)
    if len(runs) == 1:
        return ""
    _, paired, met = _standing(run, runs)
    why = [f"{run.world_size} process{'es' if run.world_size > 1 else ''}"]
    why += ["compared with a 1-process run of the same recipe, data, model and device"] if paired else []
    why += ["met the criterion"] if met else ["did not meet the criterion"]
    others = [_why_not(o, run, runs) for o in runs if o is not run and o.world_size == run.world_size]
    return (
        f"The featured run (its epoch log and Demonstrate 6): `{run.label}`: {', '.join(why)}"
        + (f"; chosen over {', '.join(others)}" if others else "")
        + "."
    )


def printed_lines(run: Run) -> list[str]:
    """What rank 0 printed, line for line from the log: each epoch's line and the final line (the trainers'
    own functions, cifar_wrn/runlog.py and stopping.py), or none when the log ends before the run did. A text
    log's lines as they were printed."""
    if run.text_log:
        return run.header["printed_lines"]
    from ..runlog import epoch_line
    from ..stopping import final_text

    lines = [epoch_line(e) for e in run.epochs]
    stop = run_stop(run)
    stopped = stop is not None and stop == len(run.epochs) - 1
    budget = run.recipe.get("epochs")
    ended = run.epochs and "safety_net" not in run.epochs[-1]  # the net fired there: the run went on
    if stopped or (isinstance(budget, int) and ended and run.epochs[-1]["epoch"] >= budget):
        recipe = SimpleNamespace(
            target_accuracy=run.target,
            patience=run.patience,
            epochs=budget,
            extra_epochs=run.recipe.get("extra_epochs", 0),
        )  # logs from before the safety net: 0
        last = run.epochs[-1]["epoch"]
        lines.append(final_text(last if stopped else None, last, recipe))
    return lines


def rule_text(run: Run) -> str:
    return f"validation accuracy >= {run.target} for {run.patience} epoch(s) in a row"


def criterion_text(run: Run) -> str:
    """The Cumulative Time at which the stopping criterion was first met, in words."""
    stop = run_stop(run)
    if stop is None:
        return f"Not met: {rule_text(run)} did not happen in the {len(run.epochs)} epoch(s) of this log."
    return (
        f"Cumulative Time at the criterion: {run.epochs[stop]['cumulative_time']:.3f} s, after epoch "
        f"{run.epochs[stop]['epoch']} ({rule_text(run)})."
    )
