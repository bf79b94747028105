#!/usr/bin/env bash
# The README's main-job command: set up .venv/ if needed, then simulate the embedded default run
# (tiny GPT-2-style model, ULS, target epsilon, real gRPC workers on loopback) into runs/demo/.
# Extra arguments go to `userdp simulate` (e.g. --quiet, --in-process).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/venv.sh
source scripts/env.sh
if ! .venv/bin/userdp simulate --help >/dev/null 2>&1; then
    echo "userdp simulate: not available yet: see issue 8 (the main job). What works today:" >&2
    echo "  .venv/bin/userdp --help" >&2
    exit 3
fi
exec .venv/bin/userdp simulate --demo --output runs/demo "$@"
