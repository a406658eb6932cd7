"""The suite in parallel: which tests share a worker, and which run alone after the others.

``scripts/test.sh`` runs the suite in two phases (docs/testing.md):

1. ``pytest -n N --dist loadgroup --phase parallel``: every test not marked ``serial``, on N
   pytest-xdist workers. A test that uses a module-scoped fixture of ours (a leader daemon, a
   cluster of agents, a browser) is put in its module's ``xdist_group``, so that the fixture
   is set up once, on one worker, as in a serial run; without the group every worker that
   drew one of the module's tests would start its own cluster. Every other test is a unit of
   its own, handed to whichever worker is free.
2. ``pytest --phase serial``: the tests marked ``serial``, one at a time with nothing beside
   them. The mark is for a test that measures time under a load it makes itself (a request
   held beyond its duration, a bound in seconds): other workers' processes on the same two
   cores would be its noise. The mark's reason says which.

``--phase all`` (the default, and plain ``pytest``) runs both kinds in one go, as before.
"""

from __future__ import annotations

import pytest

PHASES = ("all", "parallel", "serial")
#: Scopes whose fixtures are set up once for many tests.
_SHARED_SCOPES = frozenset({"module", "package", "class"})
#: Where fixtures of the project's own are defined (test modules, conftest, support/).
_OUR_MODULES = ("test_", "conftest", "support")


def add_options(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=PHASES,
        default="all",
        help="parallel: every test not marked serial; serial: only those; all (default): both",
    )


def _shared_fixture_module(item: pytest.Item) -> str | None:
    """The module of ``item`` when it uses a module-scoped (or wider, but not session-scoped)
    fixture of ours, else ``None``."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for definitions in info.name2fixturedefs.values():
        definition = definitions[-1]
        if definition.scope in _SHARED_SCOPES and definition.func.__module__.startswith(
            _OUR_MODULES
        ):
            return item.nodeid.split("::", 1)[0]
    return None


class Parallel:
    """The plugin: groups tests by their shared fixtures and keeps only the chosen phase."""

    def __init__(self, config: pytest.Config) -> None:
        config.addinivalue_line(
            "markers",
            "serial(reason): measures time under a load it makes itself, so it runs in the "
            "serial phase, alone (tests/support/parallel.py)",
        )
        self.phase: str = config.getoption("--phase")

    @pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        kept, dropped = [], []
        for item in items:
            serial = item.get_closest_marker("serial") is not None
            if self.phase == "all" or serial == (self.phase == "serial"):
                kept.append(item)
            else:
                dropped.append(item)
            module = _shared_fixture_module(item)
            if module is not None and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(module))
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


__all__ = ["PHASES", "Parallel", "add_options"]
