#!/usr/bin/env bash
# The GPU record of `mla-prefill-ext bench`, next to the kernel benchmark on the same shapes:
#   bash scripts/gpu_bench_suite.sh OUT_DIR
# 1. installs examples/mla_prefill_example_backend into OUT_DIR/example-site (pip --target, offline);
# 2. `mla-prefill-ext bench` of FLASH_ATTN, FLASHINFER, TORCH_SDPA and the example package's EXAMPLE,
#    at R1's dims with 16 heads (the default shapes), then with all 128 heads, each as JSON and text;
# 3. the kernel benchmark (python -m scripts.bench kernel) on R1's dims (its grid holds every default
#    bench shape, 16 and 128 heads). Both time through mla_prefill_ext/bench/timing.py.
# Everything lands in OUT_DIR (logs, JSON). PYTHON names the interpreter (default: python).
set -u
out=${1:?usage: gpu_bench_suite.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

stamp "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c "import sys, torch, vllm; print(sys.version); print('torch', torch.__version__); print('vllm', vllm.__version__)"
  "$py" -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
} > "$out/environment.txt" 2>&1

stamp "example package"
site="$out/example-site"
"$py" -m pip install -q --no-deps --no-build-isolation --no-index --target "$site" \
  examples/mla_prefill_example_backend > "$out/example-install.log" 2>&1
stamp "example package: rc=$?"

backends=FLASH_ATTN,FLASHINFER,TORCH_SDPA,EXAMPLE
for dims in r1 r1-tp1; do
  stamp "bench --dims $dims"
  PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m mla_prefill_ext bench --backend "$backends" --device cuda --dims "$dims" \
    --json > "$out/bench-$dims.json" 2> "$out/bench-$dims.log"
  stamp "bench --dims $dims: rc=$?"
  PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m mla_prefill_ext bench --backend "$backends" --device cuda --dims "$dims" \
    --repeat 5 > "$out/bench-$dims.txt" 2>> "$out/bench-$dims.log"
  stamp "bench --dims $dims (text): rc=$?"
done

stamp "kernel benchmark"
"$py" -m scripts.bench kernel --dims r1 --backends FLASH_ATTN,FLASHINFER,TORCH_SDPA --json "$out/bench-kernel.json" \
  > "$out/bench-kernel.log" 2>&1
stamp "kernel benchmark: rc=$?"

