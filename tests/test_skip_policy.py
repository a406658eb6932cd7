"""The policy for parts of the test environment that ``scripts/setup.sh`` installs: a test
whose part is missing is skipped on a developer's machine and fails under ``CI=true``."""

from __future__ import annotations

import re

import pytest

from support import installed
from support.installed import PARTS, check_needs, in_ci, require_installed

MISSING = "unobtainium is not installed (nothing installs it)"

INNER_TEST = """
import pytest

@pytest.fixture
def expensive():
    raise AssertionError("set up before the needs mark was checked")

@pytest.mark.needs("unobtainium")
def test_needs_a_missing_part(expensive):
    pass

def test_needs_nothing():
    pass
"""


@pytest.fixture
def missing_part(monkeypatch: pytest.MonkeyPatch) -> str:
    """A part that is never installed, known to the ``needs`` mark."""
    monkeypatch.setitem(PARTS, "unobtainium", lambda: MISSING)
    return "unobtainium"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("1", True), ("True", True), ("", False), ("false", False), ("0", False)],
)
def test_ci_is_recognised_by_its_variable(
    value: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci() is expected


def test_a_missing_part_skips_here_and_fails_in_ci(
    missing_part: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=re.escape(MISSING)):
        check_needs((missing_part,))

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"{missing_part} is missing in CI"):
        check_needs((missing_part,))
    with pytest.raises(pytest.fail.Exception, match="no Docker engine"):
        require_installed("docker", "no Docker engine at unix:///nowhere")


def test_an_installed_part_lets_the_test_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PARTS, "always-here", lambda: None)
    monkeypatch.setenv("CI", "true")
    check_needs(("always-here",))
    require_installed("docker", None)


def test_an_unknown_part_is_a_typo() -> None:
    with pytest.raises(ValueError, match="unknown part 'cady'"):
        check_needs(("cady",))


@pytest.mark.parametrize(("ci", "outcomes"), [("", {"skipped": 1}), ("true", {"errors": 1})])
def test_the_needs_mark_is_checked_before_fixtures_and_fails_a_ci_run(
    pytester: pytest.Pytester,
    missing_part: str,
    monkeypatch: pytest.MonkeyPatch,
    ci: str,
    outcomes: dict[str, int],
) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_inner=INNER_TEST)

    result = pytester.runpytest(plugins=[installed])

    result.assert_outcomes(passed=1, **outcomes)
    assert "set up before the needs mark" not in result.stdout.str()
    assert (result.ret != 0) is bool(ci)
