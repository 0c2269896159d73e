"""docs/ddp_walkthrough.md stays true to the code: every `# R1.<n>` tag, test and recipe key it cites exists."""

import re

from helpers import REPO

from cifar_wrn.recipe import FIELDS
from cifar_wrn.report.ddp_source import ddp_steps

DOC = REPO / "docs" / "ddp_walkthrough.md"


def tags_in_code() -> set[str]:
    """The step tags in raw_ddp.py, read as the report reads them (its own tests: tests/test_report.py's
    test_ddp_steps_are_read_from_the_tags, R1.1 told from R1.10 there): {'R1.1', ..., 'R1.11'}."""
    return {step for step, _ in ddp_steps()}


def cited_tags(text: str) -> set[str]:
    return {f"R1.{n}" for n in re.findall(r"R1\.(\d+)", text)}


def test_every_cited_tag_exists_in_raw_ddp():
    cited = cited_tags(DOC.read_text())
    missing = sorted(cited - tags_in_code(), key=lambda t: int(t.split(".")[1]))
    assert not missing, f"docs/ddp_walkthrough.md cites {missing}, which raw_ddp.py no longer has"


def test_the_check_sees_a_vanished_tag():
    """The doc's citations are read whole, R1.1 told from R1.10 and R1.11, so a removed tag cannot hide behind
    a longer one; a tag the code lacks is not among the code's."""
    assert cited_tags("see `# R1.1`, `# R1.10` and `# R1.12`") == {"R1.1", "R1.10", "R1.12"}
    assert cited_tags("only `# R1.10` and R1.11") == {"R1.10", "R1.11"}
    assert "R1.12" not in tags_in_code() and {"R1.1", "R1.10", "R1.11"} <= tags_in_code()


def test_each_demonstrate_item_is_answered_with_tags():
    sections = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]
    numbered = [s for s in sections if re.match(r"[1-4]\. ", s)]
    assert [s[0] for s in numbered] == ["1", "2", "3", "4"]
    for section in numbered:
        assert cited_tags(section), f"section {section.splitlines()[0]!r} cites no R1 tag"
    expected = {"1": {"R1.2", "R1.3", "R1.7", "R1.11"}, "2": {"R1.5", "R1.6"}, "3": {"R1.8"}, "4": {"R1.9"}}
    for section in numbered:
        assert expected[section[0]] <= cited_tags(section), section.splitlines()[0]


def test_cited_tests_and_recipe_keys_exist():
    text = DOC.read_text()
    tests = "".join(p.read_text() for p in (REPO / "tests").glob("test_*.py"))
    for name in set(re.findall(r"`(test_\w+)`", text)):
        assert re.search(rf"def {name}\(", tests), f"the walkthrough cites {name}, which no test defines"
    keys = set(re.findall(r"recipe key `(\w+)`", text))
    assert keys, "the walkthrough names no recipe keys: the pattern changed?"
    assert keys <= set(FIELDS), f"unknown recipe keys cited: {sorted(keys - set(FIELDS))}"
