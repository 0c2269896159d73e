"""How a run's recipe differs from recipes/baseline.yaml: the optimisations (Demonstrate 6), apart from the keys
that only set how long a run goes, when it stops or its seed."""

import json

from .logs import Run, full_recipe

# How long a run goes and when it stops, not what it computes: listed apart from the optimisations.
RUN_LENGTH = ("epochs", "extra_epochs", "target_accuracy", "patience", "seed")


def recipe_changes(run: Run) -> list[tuple[str, str, str]]:
    """(recipe key, baseline value, value used) for each key where the run's recipe differs from
    recipes/baseline.yaml; a key the header lacks had its default (an older trainer). Nothing for a text log:
    it holds no recipe."""
    from ..recipe import as_dict, load_recipe

    if run.text_log:
        return []
    baseline = as_dict(load_recipe("baseline"))
    used = full_recipe(run.recipe)
    show = lambda value: value if isinstance(value, str) else json.dumps(value)  # true/false as in YAML
    return [
        (key, show(baseline[key]) if key in baseline else "(not a key of this code)", show(used[key]))
        for key in used
        if baseline.get(key, object()) != used[key]
    ]


def optimisations(run: Run) -> list[tuple[str, str, str]]:
    """The recipe changes that change the training computation; `epochs` among them only where it sets a
    schedule (under a constant one it only caps the run). The start-up warm-up's row names its cost."""
    schedule = full_recipe(run.recipe).get("lr_schedule") != "constant"
    seconds = run.header.get("startup_seconds")
    return [
        (
            key,
            base,
            f"{used} ({seconds:.1f} s of warm-up, before the clock)" if key == "startup_steps" and seconds else used,
        )
        for key, base, used in recipe_changes(run)
        if key not in RUN_LENGTH or (key == "epochs" and schedule)
    ]
