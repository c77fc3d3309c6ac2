#!/usr/bin/env bash
# Serving (docs/benchmarks.md, "Serving: `vllm serve` loaded by `vllm bench serve`"), on one GPU, one part a call:
#   bash scripts/gpu_serving_suite.sh OUT PART
# PART: a preset of scripts/bench/serving_workloads.py or workload names, comma-separated:
#   bursts-32k  bursts-8k   64 requests at once over a cached 32k (8k) prefix, 32/128/512 tokens of their own
#   sweep-low   sweep-high  Poisson arrivals over a cached 32k prefix: 2, 4, 8 req/s; 16, 32, 64 req/s
#   mix                     4 prefixes in one shuffled mix (8k at once; 32k at 16 req/s)
#   free                    nothing shared: 2k-token prompts at once and at 8 req/s
#   decode                  decode-heavy: 512 and 256 tokens out over a cached 8k prefix
#   start                   each lifetime only starts and stops (fills the compile cache for the parts after)
# Each part: SIDES (default stock,FLASH_ATTN), each LIFETIMES times (default 2), interleaved, each lifetime a
# fresh `vllm serve` of the R1 slice (dummy weights, prefix caching, max_num_batched_tokens 8192), compiled with
# CUDA graphs (EAGER=1: --enforce-eager); lifetimes that BUDGET (default 560 s) cannot hold are skipped and say
# so. GPU_MEM: gpu_memory_utilization (default 0.5). PROFILE=1: each workload a third time under vLLM's torch
# profiler, its worker steps summarized (traces in the lifetime's folder under OUT/servers-PART). The caches (vLLM's, Triton's, FlashInfer's) stay in CACHES
# (default ${TMPDIR:-/tmp}/serving-caches) for the next part on the same host. OUT/serving-PART.{json,md,log}, OUT/serving-PART-sweep.png (sweeps), OUT/servers-PART/: each
# lifetime's server log and its client runs' logs and result JSON.
set -u
out=${1:?usage: gpu_serving_suite.sh OUT PART}
part=${2:?usage: gpu_serving_suite.sh OUT PART}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python=${PYTHON:-python}
deadline=$(( $(date +%s) + ${BUDGET:-560} ))
name=serving-${part//,/+}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1
"$python" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)" >"$out/versions.txt" 2>/dev/null
echo "[$(date +%H:%M:%S)] serving: $part"
mode=()
[[ ${EAGER:-0} == 1 ]] && mode=(--eager)
[[ ${PROFILE:-0} == 1 ]] && mode+=(--profile)
"$python" -m scripts.bench serving --sides "${SIDES:-stock,FLASH_ATTN}" --lifetimes "${LIFETIMES:-2}" \
  --workloads "$part" "${mode[@]}" ${GPU_MEM:+--gpu-mem "$GPU_MEM"} --deadline "$deadline" \
  --cache-root "${CACHES:-${TMPDIR:-/tmp}/serving-caches}" --logs "$out/servers-${part//,/+}" \
  --json "$out/$name.json" >"$out/$name.log" 2>&1
rc=$?
grep "^|\|^\[" "$out/$name.log" | tail -24
echo "[$(date +%H:%M:%S)] done: rc=$rc"
exit "$rc"
