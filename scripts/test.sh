#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the quality gates and every test
# (the slow real-engine ones included). Pass pytest arguments to narrow it, e.g.
#   scripts/test.sh -m 'not slow'
# The tests run in two phases (docs/testing.md, tests/support/parallel.py): every test not
# marked `serial` on BERTH_TEST_WORKERS pytest-xdist workers (default 4; most of the suite's
# time is spent waiting on processes, so 4 workers keep 2 cores busy), then the `serial` ones
# alone. Each phase prints its 25 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/start_dockerd.sh
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/mypy

# pytest's exit status 5 means that a phase had no test to run (arguments that select only
# tests of the other phase): not a failure.
phase() {
    local status=0
    .venv/bin/pytest -q --durations=25 "$@" || status=$?
    if [ "$status" -eq 5 ]; then
        status=0
    fi
    return "$status"
}
parallel_status=0
phase -n "${BERTH_TEST_WORKERS:-4}" --dist loadgroup --phase parallel "$@" || parallel_status=$?
phase --phase serial "$@"
exit "$parallel_status"
