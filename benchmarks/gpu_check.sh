#!/usr/bin/env bash
# The prepared GPU check: the GPU tests and the engine rows on one CUDA device, in one command.
#
#   bash benchmarks/gpu_check.sh prepare [WHEELS]       # here, in the checkout with .venv set up
#   bash benchmarks/gpu_check.sh run [WHEELS] [OUT]     # on the GPU machine, from the checkout
#
# prepare: fills WHEELS (default .whl, git-ignored through .git/info/exclude) with the wheels a
#   GPU image lacks for userdp (benchmarks/gpu_wheels.py: the dependency closure of userdp,
#   DeepSpeed and Opacus minus what images with torch, transformers, peft, numpy, scipy, pyarrow
#   and pytest already have), pinned to this .venv's versions: userdp's own wheel, DeepSpeed as a
#   pure-Python wheel (its ops are JIT-built on the GPU machine), binary wheels for CPython 3.12
#   on manylinux x86_64. Carry WHEELS with the checkout.
# run: installs WHEELS into a temporary folder (nothing is installed system-wide), checks that
#   CUDA and every module the checks import are there (exit 2 naming what is missing), then runs,
#   each under its own time limit (seconds; environment variables, the defaults add up to
#   under 8 minutes):
#     GPU_CHECK_TESTS_S=100   the GPU tests (-m gpu), from outside the checkout so that the
#                             installed package is imported
#     GPU_CHECK_E2E_S=130     benchmarks/end_to_end.py --quick: GPT-2 small, seq 128, ULS G=1/8/64
#                             and ELS against non-private, default precision
#     GPU_CHECK_GPT2_S=60     benchmarks/worker.py on GPT-2 small, and
#     GPU_CHECK_LLAMA_S=80    on the Llama-shaped preset, full fine-tuning and LoRA r = 8:
#                             userdp's vectorized engine beside Opacus hooks and ghost clipping on
#                             the same tokens
#     GPU_CHECK_OFFLOAD_S=110 benchmarks/zero3_offload.py --repeats 1: ZeRO-3 with parameter
#                             offload, a model sized past the device's memory (it exits 2 when
#                             the host's memory cannot hold it either)
#   and writes gpu-<card>-<check>.md (card: h100, h200, ...) into OUT (default $OUT when set, as on the
#   device machine, else benchmarks/results): the command, its exit status, its time and its
#   output (each benchmark prints JSON, then a markdown table). A check that fails or runs out of
#   time is recorded as such and the next one still runs; the exit status is that of the first
#   check that failed (0 when all passed).
set -uo pipefail

usage() {
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

prepare() {
  local out=${1:-.whl} py=${PY:-.venv/bin/python}
  [ -x "$py" ] || { echo "gpu_check prepare: $py not found: set up the checkout's .venv first (bash scripts/venv.sh), or set PY" >&2; exit 2; }
  grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
  mkdir -p "$out"
  local pins
  pins=$("$py" benchmarks/gpu_wheels.py) || exit 2
  local own ds binaries
  own=$(grep '^userdp==' <<<"$pins")
  ds=$(grep '^deepspeed==' <<<"$pins")
  binaries=$(grep -v -e '^userdp==' -e '^deepspeed==' <<<"$pins")
  echo "gpu_check prepare: $(wc -l <<<"$pins") wheels into $out ($own, $ds and $(wc -l <<<"$binaries") others)"
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" . || exit 1
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$ds" || exit 1
  # shellcheck disable=SC2086  # one pin per word
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$out" $binaries || exit 1
  du -sh "$out"
}

card() {
  python3 - <<'EOF'
import re, torch
name = torch.cuda.get_device_name(0).lower()
match = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
print(match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name).strip("-"))
EOF
}

# run_check NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S seconds, write OUT/gpu-CARD-NAME.md
run_check() {
  local name=$1 limit=$2 file start rc
  shift 2
  file="$results/gpu-$gpu-$name.md"
  echo "gpu_check: $name (at most ${limit}s) -> $file" >&2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$results/.$name.log" 2>&1
  rc=$?
  {
    echo "# gpu_check: $name on $device"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); torch $(python3 -c 'import torch; print(torch.__version__)')"
    echo "- command: \`$*\`"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "- result: **ran out of time** after ${limit}s (exit $rc); the output so far follows"
    else
      echo "- result: exit $rc after $(( $(date +%s) - start ))s"
    fi
    echo
    echo '```'
    tail -c 60000 "$results/.$name.log"
    echo '```'
  } > "$file"
  rm -f "$results/.$name.log"
  [ "$rc" -eq 0 ] || { [ "$status" -ne 0 ] || status=$rc; }
}

run() {
  local wheels=${1:-.whl}
  results=${2:-${OUT:-benchmarks/results}}
  ls "$wheels"/*.whl > /dev/null 2>&1 || { echo "gpu_check run: no wheels in $wheels: run 'bash benchmarks/gpu_check.sh prepare $wheels' in the checkout first and carry the folder" >&2; exit 2; }
  local site repo version
  version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$version" = "3.12" ] || { echo "gpu_check run: the wheels are built for CPython 3.12 and python3 here is $version: run it on the GPU machine's image" >&2; exit 2; }
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check run: python3 has no torch that sees a CUDA device: run it on the GPU machine" >&2; exit 2; }
  repo=$(pwd)
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl || exit 1
  export PYTHONPATH=$site HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$site/torch_extensions}
  local missing
  missing=$(python3 - <<'EOF'
import importlib.util
names = ["userdp.clients.engine", "deepspeed", "pydantic", "dp_accounting", "grpc", "opacus", "peft"]
print(" ".join(n for n in names if importlib.util.find_spec(n.split(".")[0]) is None))
EOF
)
  [ -z "$missing" ] || { echo "gpu_check run: not importable: $missing (add their wheels to $wheels)" >&2; exit 2; }
  mkdir -p "$results"
  gpu=$(card)
  device=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))")
  status=0
  run_check tests "${GPU_CHECK_TESTS_S:-100}" bash -c "cd /tmp && python3 -m pytest -q --rootdir '$repo' -c '$repo/pyproject.toml' -m gpu '$repo/tests/clients/test_engine_gpu.py' '$repo/tests/userdp/test_simulate_gpu.py'"
  local engine=(--device cuda --dtype bf16 --engines vectorized --skip-long --repeat 2)
  run_check end_to_end "${GPU_CHECK_E2E_S:-130}" python3 benchmarks/end_to_end.py --quick --repeats 2
  run_check worker_gpt2 "${GPU_CHECK_GPT2_S:-60}" python3 benchmarks/worker.py --preset gpt2-small "${engine[@]}"
  run_check worker_llama "${GPU_CHECK_LLAMA_S:-80}" python3 benchmarks/worker.py --preset llama-small --lora-rank 0,8 "${engine[@]}"
  run_check zero3_offload "${GPU_CHECK_OFFLOAD_S:-110}" python3 benchmarks/zero3_offload.py --repeats 1
  echo "gpu_check: results in $results (exit $status)" >&2
  exit "$status"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) usage ;;
esac
