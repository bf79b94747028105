#!/usr/bin/env bash
# The README's main-job command: set up .venv/ if needed, then simulate the embedded default run
# (tiny GPT-2-style model, ULS, sigma calibrated to epsilon = 8, two gRPC worker processes on
# loopback) into runs/demo/. Extra arguments go to `userdp simulate` (e.g. --quiet, --in-process,
# --output DIR). Running it again on the same folder resumes (and stops at once when it is done).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/venv.sh
source scripts/env.sh
exec .venv/bin/userdp simulate --demo --output runs/demo "$@"
