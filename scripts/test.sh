#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the quality gates and every test
# (the slow real-engine ones included). Pass pytest arguments to narrow it, e.g.
#   scripts/test.sh -m 'not slow'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/start_dockerd.sh
.venv/bin/ruff check src tests scripts
.venv/bin/ruff format --check src tests scripts
.venv/bin/mypy
.venv/bin/pytest -q "$@"
