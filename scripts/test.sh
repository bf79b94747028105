#!/usr/bin/env bash
# The README's test command: set up .venv/ if needed, then lint, format check and the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow` or `-k ledger`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/venv.sh
source scripts/env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    # pytest's "no tests collected": only reachable with a filter that selects nothing.
    echo "scripts/test.sh: pytest collected no tests for the given selection" >&2
    exit 0
fi
exit "$status"
