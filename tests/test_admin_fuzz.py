"""schemathesis over the admin API's own schema finds nothing (issue 38).

Runs ``scripts/fuzz_admin.py`` as a user would: a leader daemon started by the real CLI, an
admin key, then schemathesis with every phase (examples, coverage, fuzzing, stateful) and
``--checks all`` over ``/admin/openapi.json``, at a size CI can afford (25 cases an
operation, a fixed seed so that a failure here is one a developer can replay). The script
exits 0 only with no failure of any check, no case that could not be sent and no
``Traceback`` in the leader's log. A larger run is recorded in ``docs/testing.md``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The seed of CI's run; ``--seed`` with another number replays any other.
SEED = 38


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_schema_violation_or_traceback(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "fuzz_admin.py"),
            "--examples",
            "25",
            "--seed",
            str(SEED),
            # One worker thread: with two, hypothesis' ast.parse of a filter's lambda in two
            # threads at once can fail inside CPython with "SystemError: AST constructor
            # recursion depth mismatch" (python/cpython#106905; seen on 3.11.7 in a full run),
            # a schemathesis runtime error that is no finding of berth's.
            "--workers",
            "1",
            "--report-dir",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=480,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-20000:]}"
    assert "failures                        0" in result.stdout, result.stdout
    assert "tracebacks in the leader's log  0" in result.stdout, result.stdout
    for phase in ("examples", "coverage", "fuzzing", "stateful"):
        assert f"{phase} success" in result.stdout, result.stdout  # each ran, none failed
