#!/usr/bin/env bash
# Create (or update) the virtual environment at .venv/ in the repo root and install userdp into it.
# Idempotent: when pyproject.toml and constraints.txt are unchanged since the last install and
# DeepSpeed's CPU comm op is in the venv's JIT cache, it exits at once.
# Bytecode is compiled at install time: with PYTHONDONTWRITEBYTECODE set (as on some CI machines)
# every command would otherwise recompile scipy, transformers and dp_accounting from source.
# torch comes from pip (which finds the local CPU wheel via pip's config on our machines); everything
# else is installed by uv against constraints.txt, which pins torch==2.13.0 so no CUDA build is pulled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${USERDP_PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.userdp-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/scripts/venv.sh" | sha256sum | cut -d' ' -f1)"

source "$ROOT/scripts/env.sh"

if ! { [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; }; then
    echo "userdp: setting up $VENV (first run takes about a minute)" >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.5"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
    "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" -c "$ROOT/constraints.txt" \
        -e "$ROOT[dev,simulation,peft,hf,tracking,wandb,bench]"
    rm -f "$VENV/.userdp-ops-stamp"
    echo "$WANT" > "$STAMP"
fi

# DeepSpeed's CPU comm op, built once here so that workers only load it (a killed build is healed
# and redone by the same module; see clients/deepspeed_ops.py).
if [ ! -f "$VENV/.userdp-ops-stamp" ] || [ "$(cat "$VENV/.userdp-ops-stamp")" != "$TORCH_EXTENSIONS_DIR" ] \
    || ! ls "$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm/*.so > /dev/null 2>&1; then
    echo "userdp: building DeepSpeed's CPU comm op into $TORCH_EXTENSIONS_DIR (once; about a minute)" >&2
    mkdir -p "$TORCH_EXTENSIONS_DIR"
    DS_ACCELERATOR=cpu "$VENV/bin/python" -m userdp.clients.deepspeed_ops >&2
    echo "$TORCH_EXTENSIONS_DIR" > "$VENV/.userdp-ops-stamp"
fi
