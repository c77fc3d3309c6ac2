#!/usr/bin/env bash
# The whole GPU verification and benchmark run on a 2-GPU CUDA host, in one go:
#   bash scripts/gpu_suite.sh [--quick] OUT_DIR          (or MLA_GPU_QUICK=1 bash scripts/gpu_suite.sh OUT_DIR)
# First the sharp-attention checkpoint of the tiny DeepSeek-V2 is generated once, on the CPU
# (scripts/gpu_harness/make_sharp_checkpoint.py, seeded; kept if OUT_DIR already has it): every engine
# scenario compared with stock runs on it.
# Full run: GPU 0 and GPU 1 each run a queue of single-GPU engine scenarios; GPU 1 also runs
# the kernel numerics suite and the kernel benchmark; then the TP=2 scenarios take both GPUs;
# then the shared-prefix parity scenarios over both GPUs from one queue;
# then the engine assertions (verdicts, mutation proof) run over the recorded results (with --bench
# each scenario's JSON also holds its throughput).
# --quick: the engine scenarios only (no --bench, no kernel suite, no benchmarks), single-GPU
# ones over both GPUs from one queue, then TP=2, then the engine assertions.
# Everything lands in OUT_DIR (logs, scenario JSON, junit XML, benchmark JSON and plot).
set -u
quick=${MLA_GPU_QUICK:-0}
if [[ ${1:-} == --quick ]]; then
  quick=1
  shift
fi
out=${1:?usage: gpu_suite.sh [--quick] OUT_DIR}
mkdir -p "$out/scenarios"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 MLA_GPU_RESULTS="$out/scenarios" HF_HUB_OFFLINE=1
ckpt="$out/sharp-checkpoint"
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
scenarios() { python -m scripts.gpu_harness.scenarios --results "$out/scenarios" --model-dir "$ckpt" "$@"; }

stamp "environment"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt"
stamp "sharp checkpoint"
if ! python scripts/gpu_harness/make_sharp_checkpoint.py "$ckpt" --seed 0 > "$out/checkpoint.log" 2>&1; then
  stamp "the sharp checkpoint could not be generated: see $out/checkpoint.log"
  exit 1
fi

if [[ $quick == 1 ]]; then
  stamp "engine scenarios (quick: no benchmarks)"
  scenarios --gpus 0,1 > "$out/queue.log" 2>&1
else
  (
    scenarios --gpus 0 --bench \
      --only stock,stock-eager,shim-fa-eager,custom-spawn,shim-fi,stock-chunks,shim-fa-chunks,mutant-scale,mutant-lse2
  ) > "$out/queue-gpu0.log" 2>&1 &
  gpu0=$!
  (
    scenarios --gpus 1 --bench --only shim-fa
    stamp "kernel numerics"
    CUDA_VISIBLE_DEVICES=1 python -m pytest tests/gpu/test_kernels.py -q -rs --junitxml="$out/kernels.xml" \
      > "$out/kernels.log" 2>&1
    stamp "kernel benchmark"
    CUDA_VISIBLE_DEVICES=1 python -m scripts.bench kernel --json "$out/bench-kernel.json" \
      --plot "$out/bench-kernel.png" > "$out/bench-kernel.log" 2>&1
    scenarios --gpus 1 --only shim-fi-eager,shim-fi-chunks,invalid-explicit
  ) > "$out/queue-gpu1.log" 2>&1 &
  gpu1=$!
  wait $gpu0 $gpu1
  stamp "tensor parallel"
  scenarios --gpus 0,1 --only stock-tp2,shim-fa-tp2,shim-fi-tp2,custom-tp2 > "$out/queue-tp2.log" 2>&1
  stamp "shared-prefix parity"
  shared=$(python -c 'from scripts.gpu_harness import scenarios; print(",".join(scenarios.SHARED_SCENARIOS))')
  scenarios --gpus 0,1 --only "$shared" > "$out/queue-shared.log" 2>&1
fi
stamp "engine assertions"
python -m pytest tests/gpu/test_engine.py -q -rs -s --junitxml="$out/engine.xml" > "$out/engine.log" 2>&1
tail -n 3 "$out/engine.log"
python -m pytest tests/gpu/test_shared_prefix.py -q -rs -s --junitxml="$out/shared-prefix.xml" \
  > "$out/shared-prefix.log" 2>&1
tail -n 3 "$out/shared-prefix.log"
stamp "done"
