"""Recipe values no one can mean are refused when the recipe loads, from whatever source (a YAML file, --set, a
dedicated flag), before any process starts; and the recipes ship inside the package, found without the checkout."""

import subprocess
import sys
from dataclasses import fields

import pytest
from helpers import REPO, cpu_env

import accel_train
import raw_ddp
from cifar_wrn.accel_side import resolve_accel_launch
from cifar_wrn.errors import UserError
from cifar_wrn.raw_side import resolve_raw_launch
from cifar_wrn.recipe import Recipe, RecipeError, load_recipe

FLOAT_KEYS = [f.name for f in fields(Recipe) if f.type is float]
# (as written, as the message names it): YAML's spellings and Python's
NOT_FINITE = [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("nan", "nan"), ("inf", "inf")]
# each entry point's flag for the CPU, so that resolve() needs no CUDA
ENTRY_POINTS = [(raw_ddp, resolve_raw_launch, ["--device", "cpu"]), (accel_train, resolve_accel_launch, ["--cpu"])]


def refusals(argv: list) -> list[str]:
    """What each entry point's resolve() says when refusing `argv` (both must refuse it as a UserError)."""
    said = []
    for module, resolve, cpu in ENTRY_POINTS:
        with pytest.raises(UserError) as info:
            resolve(module.parse_args([*cpu, *argv]))
        said.append(str(info.value))
    return said


def names(message: str, key: str, value: str) -> bool:
    return key in message and value in message


def test_every_float_key_is_in_the_list():
    assert {"weight_decay", "grad_clip_norm", "warmup_epochs", "base_lr", "target_accuracy"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("written, named", NOT_FINITE)
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_a_recipe_file_with_a_value_that_is_not_finite_is_refused(tmp_path, key, written, named):
    path = tmp_path / "r.yaml"
    path.write_text(f"epochs: 3\n{key}: {written}\n")
    for message in refusals(["--recipe", str(path)]):
        assert names(message, key, named), message


@pytest.mark.parametrize("written, named", NOT_FINITE)
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_a_set_value_that_is_not_finite_is_refused(key, written, named):
    for message in refusals(["--set", f"{key}={written}"]):
        assert names(message, key, named), message


@pytest.mark.parametrize("flag, key", [("--base-lr", "base_lr"), ("--target-accuracy", "target_accuracy")])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_dedicated_flag_that_is_not_finite_is_refused(flag, key, value):
    for message in refusals([f"{flag}={value}"]):  # "--base-lr -inf" would read -inf as a flag
        assert names(message, key, value), message


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("weight_decay", "-1e-4", "-0.0001"),
        ("grad_clip_norm", "-1", "-1"),
        ("warmup_epochs", "-0.5", "-0.5"),
        ("momentum", "1.0", "1.0"),
        ("ema_decay", "-0.1", "-0.1"),
        ("bn_lr_scale", "0", "0"),
    ],
)
def test_a_finite_value_out_of_its_range_is_still_refused(key, value, named):
    for message in refusals(["--set", f"{key}={value}"]):
        assert names(message, key, named), message


def test_a_float_key_takes_a_number_in_any_spelling(tmp_path):
    """YAML 1.1 reads 5e-4 (no dot) as a string: a float key takes it as the number it is."""
    assert load_recipe("baseline", {"weight_decay": "5e-4"}).weight_decay == 5e-4
    path = tmp_path / "r.yaml"
    path.write_text("weight_decay: 5e-4\nwarmup_epochs: 1\n")
    recipe = load_recipe(str(path))
    assert (recipe.weight_decay, recipe.warmup_epochs) == (5e-4, 1.0)
    with pytest.raises(RecipeError, match="'weight_decay' must be float, got 'lots'"):
        load_recipe("baseline", {"weight_decay": "lots"})


def test_a_set_value_that_is_not_yaml_is_a_recipe_error():
    for message in refusals(["--set", "momentum=[0.9"]):
        assert names(message, "momentum", "[0.9"), message


def test_a_key_written_twice_in_a_recipe_file_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("epochs: 3\nbase_lr: 0.1\nepochs: 5\n")
    for message in refusals(["--recipe", str(path)]):
        assert "'epochs'" in message and "3" in message and "5" in message and str(path) in message, message
        assert "twice" in message and "\n" not in message, message


def test_a_key_written_twice_in_a_nested_mapping_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("epochs: {a: 1, a: 2}\n")
    with pytest.raises(RecipeError, match="'a' is written twice"):
        load_recipe(str(path))


@pytest.mark.core  # starts one process, which exits while resolving the recipe (no training): seconds
@pytest.mark.parametrize("value", ["nan", ".nan"])
def test_the_trainer_refuses_a_nan_weight_decay_in_one_line(tmp_path, value):
    result = subprocess.run(
        [sys.executable, str(REPO / "raw_ddp.py"), "--device", "cpu", "--set", f"weight_decay={value}"]
        + ["--data-dir", str(tmp_path / "no-data")],
        cwd=tmp_path,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr
    assert len(errors) == 1 and names(errors[0], "weight_decay", "nan") and "finite" in errors[0], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
