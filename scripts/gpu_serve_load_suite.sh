#!/usr/bin/env bash
# The first-request issue's load on a real `vllm serve` (docs/benchmarks.md, "Load on a real `vllm serve`"), on a CUDA host:
#   bash scripts/gpu_serve_load_suite.sh [--budget SECONDS] [--sides stock,FLASHINFER,FLASH_ATTN] [--eager]
#       [--caches DIR] OUT_DIR
# environment.txt (GPU, driver, versions), then scripts/bench/serve_load.py: each side one server with
# cold caches of its own (FlashInfer's JIT cache, vLLM's compile cache, Triton's), 2,000 completions
# from 64 clients; sides that the budget (default 560 s) cannot hold are skipped and say so.
# Outputs in OUT_DIR: environment.txt, serve-load.{json,log}, servers/<side>.log (each server's log, with
# the add-on's warm-up lines). Each side's caches go under --caches DIR (default: a temporary folder,
# removed at the end; given, they stay: the FLASHINFER side's is then a warm FlashInfer cache).
set -u
budget=560 sides=stock,FLASHINFER,FLASH_ATTN extra=() caches=
while [[ ${1:-} == --* ]]; do
  case $1 in
    --budget) budget=$2; shift 2 ;;
    --sides) sides=$2; shift 2 ;;
    --eager) extra+=(--eager); shift ;;
    --caches) caches=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out=${1:?usage: gpu_serve_load_suite.sh [--budget SECONDS] [--sides LIST] [--eager] [--caches DIR] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
deadline=$(( $(date +%s) + budget ))
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import sys, torch, vllm, flashinfer; print(sys.version); print('torch', torch.__version__); print('vllm', vllm.__version__); print('flashinfer', flashinfer.__version__)"
  nproc
  env | grep -E '^(CUDA_HOME|MAX_JOBS|FLASHINFER_|VLLM_)' || true
} > "$out/environment.txt" 2>&1
python -m scripts.bench serve_load --sides "$sides" "${extra[@]}" --deadline "$deadline" \
  ${caches:+--cache-root "$caches"} --logs "$out/servers" --json "$out/serve-load.json" 2>&1 | tee "$out/serve-load.log"
