"""The run the report features (its epoch log, as rank 0 printed it, and its recipe), and why that one."""

from types import SimpleNamespace

from .content import code
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
        return f"{code(other.label)} (no comparable 1-process run)"
    if met and not other_met:
        return f"{code(other.label)} (did not meet the criterion)"
    if len(other.epochs) < len(run.epochs):
        return f"{code(other.label)} (fewer epochs)"
    return f"{code(other.label)} (equal standing: the first by path)"


def featured_group(runs: list[Run]) -> tuple[list[Run], list[str]]:
    """The runs set side by side with the featured one (the figures, the time profile, Demonstrate 4): those of
    its recipe, data, model and device (any process count); and each other one, with what differs."""
    run = main_run(runs)
    group = [r for r in runs if r is run or not differences([run, r])]
    others = [f"{code(r.label)} ({'; '.join(map(str, differences([run, r])))})" for r in runs if r not in group]
    return group, others


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
        f"The featured run (its epoch log and Demonstrate 6): {code(run.label)}: {', '.join(why)}"
        + (f"; chosen over {', '.join(others)}" if others else "")
        + "."
    )


def beside_text(runs: list[Run]) -> str:
    """Which runs the figures, the time profile and Demonstrate 4 set beside the featured one, and which not
    (another recipe, data, model or device), with what differs; '' when all are."""
    run = main_run(runs)
    group, apart = featured_group(runs)
    if not apart:
        return ""
    beside = ", ".join(code(r.label) for r in group if r is not run) or "none"
    return (
        f"Set beside {code(run.label)} in the figures, the time profile and Demonstrate 4 (its recipe, data, model "
        f"and device): {beside}; not {', '.join(apart)}."
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
        last = run.epochs[-1]["epoch"]
        recipe = SimpleNamespace(
            target_accuracy=run.target,
            patience=run.patience,
            epochs=budget if isinstance(budget, int) else last,  # a log that lacks it: no epoch past a budget
            extra_epochs=run.recipe.get("extra_epochs", 0),
        )  # logs from before the safety net: 0
        lines.append(final_text(last if stopped else None, last, recipe))
    return lines


def rule_text(run: Run) -> str:
    return f"validation accuracy >= {run.target} for {run.patience} epoch(s) in a row"


def unmet_text(runs: list[Run]) -> str:
    """The report's first words where no run met its stopping criterion ('' where one did)."""
    if any(run_stop(r) is not None for r in runs):
        return ""
    rules = "; ".join(dict.fromkeys(rule_text(r) for r in runs))
    return (
        f"**No run here meets the stopping criterion** ({rules}): no time to target, the speedup is by images/sec "
        "alone, and the course's runs must meet it."
    )


def criterion_text(run: Run) -> str:
    """The Cumulative Time at which the stopping criterion was first met, in words."""
    stop = run_stop(run)
    if stop is None:
        return f"Not met: {rule_text(run)} did not happen in the {len(run.epochs)} epoch(s) of this log."
    return (
        f"Cumulative Time at the criterion: {run.epochs[stop]['cumulative_time']:.3f} s, after epoch "
        f"{run.epochs[stop]['epoch']} ({rule_text(run)})."
    )
