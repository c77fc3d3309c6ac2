#!/usr/bin/env bash
# The speed measurements of docs/benchmarks.md on a CUDA host, one after the other on one GPU:
#   bash scripts/gpu_speed_suite.sh [--kernel] [--prev DIR] OUT_DIR
# 1. the no-sync check of every backend's step path (tests/gpu/test_no_sync.py; it also shows the
#    check failing for planning from device offsets, and JIT-builds FlashInfer's kernels);
# 2. engine throughput, stock and the add-on's FLASH_ATTN and FLASHINFER alive at once, interleaved
#    (scripts/bench/engine.py, its default model: the 61-layer R1 slice); with --prev DIR also
#    FLASHINFER from the code tree in DIR (a folder holding an earlier mla_prefill_ext), to compare
#    two versions in one run;
# 3. with --kernel: the kernel benchmark (backend vs bare kernel, R1 and non-R1 dims,
#    scripts/bench/kernel.py).
# Everything lands in OUT_DIR (logs, JSON, junit XML).
set -u
kernel=0 prev=""
while [[ ${1:-} == --* ]]; do
  case $1 in
    --kernel) kernel=1; shift ;;
    --prev) prev=$(cd "$2" && pwd); shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
out=${1:?usage: gpu_speed_suite.sh [--kernel] [--prev DIR] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

stamp "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import sys, torch, vllm, flashinfer; print(sys.version); print('torch', torch.__version__); print('vllm', vllm.__version__); print('flashinfer', flashinfer.__version__)"
  nproc
  env | grep -E '^PYTHON' || true
} > "$out/environment.txt" 2>&1

stamp "no-sync check"
python -m pytest tests/gpu/test_no_sync.py -q -rs --junitxml="$out/no-sync.xml" > "$out/no-sync.log" 2>&1
stamp "no-sync check: rc=$?"
stamp "engine throughput"
engine_args=()
if [[ -n $prev ]]; then
  engine_args=(--tree "prev=$prev" --sides stock,FLASH_ATTN,FLASHINFER,FLASHINFER@prev --gpu-mem 0.2
    --compare FLASHINFER/FLASH_ATTN,FLASH_ATTN/stock,FLASHINFER/stock,FLASHINFER/FLASHINFER@prev)
fi
python -m scripts.bench engine --reps 20 "${engine_args[@]}" --json "$out/bench-engine.json" > "$out/bench-engine.log" 2>&1
stamp "engine throughput: rc=$?"
if [[ $kernel == 1 ]]; then
  stamp "kernel benchmark"
  python -m scripts.bench kernel --rounds 3 --json "$out/bench-kernel.json" --plot "$out/bench-kernel.png" \
    > "$out/bench-kernel.log" 2>&1
  stamp "kernel benchmark: rc=$?"
fi
