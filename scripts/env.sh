# Sourced by the scripts (and by hand: `source scripts/env.sh`): caches that make repeated runs fast,
# all inside this checkout's .venv/, found from this file's own location.
# DeepSpeed JIT-compiles a CPU comm op; scripts/venv.sh builds it once into this venv's cache (a
# cache shared between venvs gets clobbered by different torch builds).
_USERDP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$_USERDP_ROOT/.venv/torch_extensions}"
export USERDP_CACHE_DIR="${USERDP_CACHE_DIR:-$_USERDP_ROOT/.venv/userdp_cache}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_OFFLINE=1
unset _USERDP_ROOT
