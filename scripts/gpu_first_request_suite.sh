#!/usr/bin/env bash
# First requests after a fresh start (docs/benchmarks.md, "First requests after a fresh start"), on a CUDA host, within a time
# budget (default 540 s):
#   bash scripts/gpu_first_request_suite.sh [--budget SECONDS] [--compiled] OUT_DIR
# 1. environment.txt: GPU, driver, versions;
# 2. pre-build: FlashInfer's MLA prefill kernels compiled into a fresh cache with the recipe in docs/deployment.md
#    (FLASHINFER_WORKSPACE_BASE=DIR mla-prefill-ext check --backend FLASHINFER --device cuda), timed;
# 3. scripts/bench/first_request.py: stock, FLASHINFER and FLASH_ATTN, each with fresh caches
#    (FlashInfer's JIT cache cold), and FLASHINFER-warm on the cache pre-built in step 2; eager
#    engines unless --compiled (torch.compile with cold caches on every side takes longer than the
#    default budget: give --budget 900 or more);
# 4. tests/gpu/test_warmup.py and tests/gpu/test_first_request.py on the pre-built cache.
# Each step gets what is left of the budget (the benchmark skips the sides it has no time for, and
# writes what ran). Everything lands in OUT_DIR; the caches are in a temporary folder, removed at the end.
set -u
budget=540 compiled=0
while [[ ${1:-} == --* ]]; do
  case $1 in
    --budget) budget=$2; shift 2 ;;
    --compiled) compiled=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out=${1:?usage: gpu_first_request_suite.sh [--budget SECONDS] [--compiled] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
caches=$(mktemp -d "${TMPDIR:-/tmp}/first-request-caches.XXXXXX")
trap 'rm -rf "$caches"' EXIT
deadline=$(( $(date +%s) + budget ))
left() { echo $(( deadline - $(date +%s) )); }
stamp() { echo "[$(date +%H:%M:%S)] $* ($(left) s left)"; }
TESTS_RESERVE=150  # seconds kept for step 4 (two eager engines and two short processes)

stamp "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import sys, torch, vllm, flashinfer; print(sys.version); print('torch', torch.__version__); print('vllm', vllm.__version__); print('flashinfer', flashinfer.__version__)"
  python -c "import importlib.util as u; print('flashinfer-cubin', bool(u.find_spec('flashinfer_cubin')), 'flashinfer-jit-cache', bool(u.find_spec('flashinfer_jit_cache')))"
  nproc
  env | grep -E '^(PYTHON|CUDA_HOME|MAX_JOBS|FLASHINFER_|VLLM_)' || true
} > "$out/environment.txt" 2>&1

stamp "pre-build FlashInfer's prefill kernels (cold cache)"
prebuilt=$caches/prebuilt
start=$(date +%s.%N)
FLASHINFER_WORKSPACE_BASE=$prebuilt timeout 240 python -m mla_prefill_ext check --backend FLASHINFER --device cuda \
  > "$out/prebuild.log" 2>&1
rc=$?
{
  echo "command: FLASHINFER_WORKSPACE_BASE=DIR python -m mla_prefill_ext check --backend FLASHINFER --device cuda"
  echo "rc: $rc"
  echo "seconds: $(python -c "print(round($(date +%s.%N) - $start, 1))")"
  echo "modules built:"
  find "$prebuilt" -path '*cached_ops/*' -name '*.so' -printf '  %P (%s bytes)\n' 2>/dev/null
} > "$out/prebuild.txt"
stamp "pre-build: rc=$rc"

stamp "first-request benchmark"
bench_args=(--sides stock,FLASHINFER,FLASHINFER-warm,FLASH_ATTN --warm-cache "$prebuilt")
[[ $compiled == 1 ]] || bench_args+=(--eager)
python -m scripts.bench first_request "${bench_args[@]}" --deadline $(( deadline - TESTS_RESERVE )) \
  --cache-root "$caches/bench" --logs "$out/engines" --json "$out/bench-first-request.json" \
  > "$out/bench-first-request.log" 2>&1
stamp "first-request benchmark: rc=$?"

stamp "GPU tests: warm-up and first steps"
FLASHINFER_WORKSPACE_BASE=$prebuilt MLA_FIRST_REQUEST_LOGS=$out/test-engines \
  timeout $(( $(left) > 30 ? $(left) : 30 )) python -m pytest tests/gpu/test_warmup.py tests/gpu/test_first_request.py \
  -q -rs -s --junitxml="$out/first-request-tests.xml" > "$out/first-request-tests.log" 2>&1
stamp "GPU tests: rc=$?"
