"""The parallel suite's own rules (``support/parallel.py``), run on a small inner suite:
``--phase`` keeps the serial-marked tests or the others, and under ``--dist loadgroup`` the
tests that share a module-scoped fixture run on one worker, so it is set up once.

The last one fails where pytest-xdist's groups are silently ignored: with pytest 9.2,
``--dist loadgroup`` no longer groups (pytest-xdist#1386), which is why ``pyproject.toml``
keeps pytest below 9.2 until a fixed pytest-xdist is released."""

from __future__ import annotations

from pathlib import Path

import pytest

#: The inner suite's conftest: berth's phases and groups, from this checkout's ``tests/``.
INNER_CONFTEST = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from support import parallel

def pytest_addoption(parser):
    parallel.add_options(parser)

def pytest_configure(config):
    config.pluginmanager.register(parallel.Parallel(config), "support.parallel")
"""

INNER_TESTS = """
import os
import pytest

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    # one line per set-up, naming the worker that did it
    with open(os.environ["SETUPS_FILE"], "a") as setups:
        setups.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_uses_the_shared_fixture(shared, n):
    pass

@pytest.mark.parametrize("n", range(6))
def test_alone(n):
    pass

@pytest.mark.serial("measures time")
def test_timed():
    pass
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    setups = tmp_path / "setups"
    monkeypatch.setenv("SETUPS_FILE", str(setups))
    return setups


@pytest.mark.parametrize(
    ("phase", "passed", "deselected"), [("all", 13, 0), ("parallel", 12, 1), ("serial", 1, 12)]
)
def test_a_phase_keeps_its_tests(
    inner: Path, pytester: pytest.Pytester, phase: str, passed: int, deselected: int
) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--phase", phase)
    result.assert_outcomes(passed=passed, deselected=deselected)


def test_tests_sharing_a_module_fixture_run_on_one_worker(
    inner: Path, pytester: pytest.Pytester
) -> None:
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup", "--phase", "parallel"
    )
    result.assert_outcomes(passed=12)
    assert len(inner.read_text().split()) == 1, "the module's fixture was set up on several workers"
