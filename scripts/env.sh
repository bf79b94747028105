# Sourced by the scripts: caches that make repeated runs fast.
# DeepSpeed JIT-compiles a CPU comm op on first use; keep the build cache inside this venv so it is
# compiled once per venv (a cache shared between venvs gets clobbered by different torch builds).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
export USERDP_CACHE_DIR="${USERDP_CACHE_DIR:-$ROOT/.venv/userdp_cache}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export HF_HUB_OFFLINE=1
