#!/usr/bin/env bash
# The speed measurements of docs/benchmarks.md on a 2-GPU CUDA host, in one go:
#   bash scripts/gpu_speed_suite.sh OUT_DIR
# GPU 0: engine throughput, stock and the add-on's FLASH_ATTN and FLASHINFER alive at once,
#        interleaved (scripts/bench_engine.py).
# GPU 1: the no-sync check of every backend's step path (tests/gpu/test_no_sync.py, which also
#        shows it failing for planning from device offsets; it JIT-builds FlashInfer's kernels
#        before the engine needs them), then the kernel benchmark (backend vs bare kernel, R1 and
#        non-R1 dims), then the start-up profile (scripts/profile_startup.py).
# Everything lands in OUT_DIR (logs, JSON, junit XML).
set -u
out=${1:?usage: gpu_speed_suite.sh OUT_DIR}
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
  git log -1 --format='commit %H' 2>/dev/null || true
} > "$out/environment.txt" 2>&1

(
  CUDA_VISIBLE_DEVICES=0 python scripts/bench_engine.py --json "$out/bench-engine.json"
) > "$out/bench-engine.log" 2>&1 &
gpu0=$!
(
  stamp "no-sync check"
  CUDA_VISIBLE_DEVICES=1 python -m pytest tests/gpu/test_no_sync.py -q -rs --junitxml="$out/no-sync.xml" \
    > "$out/no-sync.log" 2>&1
  stamp "kernel benchmark"
  CUDA_VISIBLE_DEVICES=1 python scripts/bench_prefill.py kernel --rounds 3 --json "$out/bench-kernel.json" \
    --plot "$out/bench-kernel.png" > "$out/bench-kernel.log" 2>&1
  stamp "start-up profile"
  python scripts/profile_startup.py --reps 5 --json "$out/startup.json" > "$out/startup.log" 2>&1
  stamp "GPU 1 queue done"
) > "$out/queue-gpu1.log" 2>&1 &
gpu1=$!
wait $gpu0
stamp "engine benchmark done: rc=$?" >> "$out/queue-gpu0.log"
wait $gpu1
stamp "all done"
