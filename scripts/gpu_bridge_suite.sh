#!/usr/bin/env bash
# The bridge on vLLM 0.25.1 on a GPU, in one go: run from the project root on a CUDA host where the
# Python in use has vLLM 0.25.1 and this project installed (its vllm.general_plugins entry point must
# exist). Writes everything under RESULTS (default /tmp/bridge-025):
#   info.txt             `mla-prefill-ext info` (exit 0: the mode, the bridge, vLLM's registry)
#   kernels.txt          the kernel suite and the conformance suite on the GPU (version-independent)
#   <scenario>.json/.log one engine lifetime each (scripts/gpu_harness/scenarios.py) on the sharp checkpoint
#   verdicts.txt         tests/gpu/test_bridge_engine.py over those results
# GPUS=0,1 runs single-GPU scenarios in parallel; ONLY=a,b runs those scenarios alone (the verdicts of
# the others skip); KERNELS=0 leaves out the kernel and conformance suites. Set CUDA_HOME and MAX_JOBS for FlashInfer's JIT build.
set -uo pipefail
results=${1:-/tmp/bridge-025}
mkdir -p "$results"
python - <<'PY' || exit 2
import vllm, sys
if not vllm.__version__.startswith("0.25"):
    sys.exit(f"gpu_bridge_suite.sh: this Python has vLLM {vllm.__version__}, not 0.25.x")
PY
export VLLM_USE_FLASHINFER_SAMPLER=0
python -m mla_prefill_ext info > "$results/info.txt" 2>&1
echo "info: exit $? (see $results/info.txt)"
if [[ ${KERNELS:-1} == 1 ]]; then  # KERNELS=0: the engine scenarios alone (the suites take minutes)
  python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/testing/test_conformance.py \
    > "$results/kernels.txt" 2>&1
  echo "kernels and conformance: exit $? ($(tail -1 "$results/kernels.txt"))"
fi
python -m scripts.gpu_harness.scenarios --results "$results" --gpus "${GPUS:-0}" --only \
  "${ONLY:-stock,stock-eager,stock-chunks,shim-fa,shim-fa-chunks,shim-fi,shim-fi-chunks,shim-sdpa,shim-sdpa-eager,custom-spawn,mutant-scale,mutant-lse2}"
if [[ -n ${ONLY:-} ]]; then  # the verdicts would run the missing scenarios on demand
  echo "verdicts: not run (ONLY); replay with earlier results: MLA_GPU_RESULTS=EARLIER:$results" \
    "python -m pytest -q -s tests/gpu/test_bridge_engine.py (a vLLM 0.25 environment; no GPU needed)"
  exit 0
fi
MLA_GPU_RESULTS="$results" python -m pytest -q -s -p no:cacheprovider tests/gpu/test_bridge_engine.py \
  2>&1 | tee "$results/verdicts.txt"
