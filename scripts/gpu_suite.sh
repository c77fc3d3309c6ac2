#!/usr/bin/env bash
# The whole GPU verification and benchmark run on a 2-GPU CUDA host, in one go:
#   bash scripts/gpu_suite.sh OUT_DIR
# GPU 0 and GPU 1 each run a queue of single-GPU engine scenarios; GPU 1 also runs the kernel
# numerics suite and the kernel benchmark; then the TP=2 scenarios take both GPUs; then the
# engine assertions run over the recorded results, and the start-up benchmark. Everything lands
# in OUT_DIR (logs, scenario JSON, junit XML, benchmark JSON and plot).
set -u
out=${1:?usage: gpu_suite.sh OUT_DIR}
mkdir -p "$out/scenarios"
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 MLA_GPU_RESULTS="$out/scenarios"
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

stamp "environment"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt"
(
  python -m tests.gpu.scenarios --results "$out/scenarios" --gpus 0 --bench \
    --only stock,stock-eager,shim-fa-eager,custom-spawn,shim-fi
) > "$out/queue-gpu0.log" 2>&1 &
gpu0=$!
(
  python -m tests.gpu.scenarios --results "$out/scenarios" --gpus 1 --bench --only shim-fa
  stamp "kernel numerics"
  CUDA_VISIBLE_DEVICES=1 python -m pytest tests/gpu/test_kernels.py -q -rs --junitxml="$out/kernels.xml" \
    > "$out/kernels.log" 2>&1
  stamp "kernel benchmark"
  CUDA_VISIBLE_DEVICES=1 python scripts/bench_prefill.py kernel --json "$out/bench-kernel.json" \
    --plot "$out/bench-kernel.png" > "$out/bench-kernel.log" 2>&1
  python -m tests.gpu.scenarios --results "$out/scenarios" --gpus 1 --only shim-fi-eager,invalid-explicit
) > "$out/queue-gpu1.log" 2>&1 &
gpu1=$!
wait $gpu0 $gpu1
stamp "tensor parallel"
python -m tests.gpu.scenarios --results "$out/scenarios" --gpus 0,1 \
  --only stock-tp2,shim-fa-tp2,shim-fi-tp2,custom-tp2 > "$out/queue-tp2.log" 2>&1
stamp "engine assertions"
python -m pytest tests/gpu/test_engine.py -q -rs -s --junitxml="$out/engine.xml" > "$out/engine.log" 2>&1
stamp "engine benchmark table"
python scripts/bench_prefill.py engine --reuse "$out/scenarios" --json "$out/bench-engine.json" \
  > "$out/bench-engine.log" 2>&1
stamp "start-up benchmark"
python scripts/bench_prefill.py startup --startup-reps 3 --json "$out/bench-startup.json" \
  > "$out/bench-startup.log" 2>&1
stamp "done"
