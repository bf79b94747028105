#!/usr/bin/env bash
# Create (or update) the virtual environment at .venv/ in the repo root and install userdp into it.
# Idempotent: when pyproject.toml and constraints.txt are unchanged since the last install it exits at once.
# torch comes from pip (which finds the local CPU wheel via pip's config on our machines); everything
# else is installed by uv against constraints.txt, which pins torch==2.13.0 so no CUDA build is pulled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${USERDP_PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.userdp-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/scripts/venv.sh" | sha256sum | cut -d' ' -f1)"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
echo "userdp: setting up $VENV (first run takes about a minute)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$ROOT/constraints.txt" \
    -e "$ROOT[dev,simulation,peft]"
mkdir -p "$VENV/torch_extensions"
echo "$WANT" > "$STAMP"
