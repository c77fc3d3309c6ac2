#!/usr/bin/env bash
# The GPU record of `mla-prefill-ext bench`, next to the kernel benchmark on the same shapes:
#   bash scripts/gpu_bench_suite.sh OUT_DIR
# 1. installs examples/mla_prefill_example_backend into OUT_DIR/example-site (pip --target, offline);
# 2. `mla-prefill-ext bench` of FLASH_ATTN, FLASHINFER, TORCH_SDPA and the example package's EXAMPLE,
#    at R1's dims with 16 heads (the default shapes), then with all 128 heads, each as JSON and text;
# 3. the kernel benchmark (python -m scripts.bench kernel) on R1's dims (its grid holds every default bench shape, 16 and 128 heads);
# 4. python -m scripts.bench bench_vs_kernel: each backend and shape both timed, bench's time over
#    the kernel benchmark's (the two should agree within 5%).
# Everything lands in OUT_DIR (logs, JSON, Markdown). PYTHON names the interpreter (default: python).
#
#   bash scripts/gpu_bench_suite.sh OUT_DIR --interleaved
# instead runs only the comparison, on the shapes where the two disagreed (and 1x8192, where they
# agreed), FLASH_ATTN, FLASHINFER and TORCH_SDPA at R1's dims, 16 heads: kernel, bench, kernel, bench,
# each a fresh process, the kernel benchmark with --with-lse (the new tokens with their LSE, as a step
# with context calls them), while nvidia-smi logs the SM clock, power and throttle reasons every
# 100 ms (clocks.csv); then every bench run against every kernel run (bench-vs-kernel-bI-kJ.*).
# Both record each repetition's time, so a drift within a measurement shows. A few minutes in all
# (FlashInfer's first JIT included).
#
#   bash scripts/gpu_bench_suite.sh OUT_DIR --live
# instead measures the two in one process, taking turns round by round for each backend and shape
# (python -m scripts.bench bench_vs_kernel --live: FLASH_ATTN, FLASHINFER, TORCH_SDPA and the example
# package's EXAMPLE, the interleaved run's 7 shapes, R1's dims with 16 heads, 15 rounds), with the
# environment and the clocks logged; its exit code is the comparison's (1: a pair outside 5%).
set -u
out=${1:?usage: gpu_bench_suite.sh OUT_DIR [--interleaved|--live]}
mode=${2:-full}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
stamp() { echo "[$(date +%H:%M:%S)] $*"; }

if [ "$mode" = "--interleaved" ]; then
  bench_shapes=1x1024,1x8192,8x2048,32x512,64x128,8x2048+2048,64x128+128
  kernel_shapes=1x1024,1x8192,8x2048,32x512,64x128  # each with as much context: 8x2048+2048, 64x128+128
  backends=FLASH_ATTN,FLASHINFER,TORCH_SDPA
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$out/clocks.csv" 2>&1 &
  smi=$!
  for i in 1 2; do
    stamp "kernel benchmark, run $i"
    "$py" -m scripts.bench kernel --dims r1 --heads 16 --shapes "$kernel_shapes" --with-lse --backends "$backends" \
      --json "$out/kernel-$i.json" > "$out/kernel-$i.log" 2>&1
    stamp "kernel benchmark, run $i: rc=$?"
    stamp "bench, run $i"
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m mla_prefill_ext bench --backend "$backends" --device cuda \
      --dims r1 --shapes "$bench_shapes" --json > "$out/bench-$i.json" 2> "$out/bench-$i.log"
    stamp "bench, run $i: rc=$?"
  done
  kill "$smi"
  for i in 1 2; do
    for j in 1 2; do
      "$py" -m scripts.bench bench_vs_kernel --bench "$out/bench-$i.json" --kernel "$out/kernel-$j.json" \
        --json "$out/bench-vs-kernel-b$i-k$j.json" --markdown "$out/bench-vs-kernel-b$i-k$j.md" \
        > "$out/bench-vs-kernel-b$i-k$j.log" 2>&1
      stamp "bench run $i vs kernel run $j: rc=$? ($(tail -1 "$out/bench-vs-kernel-b$i-k$j.log"))"
    done
  done
  exit 0
fi

if [ "$mode" = "--live" ]; then
  "$py" -c "import sys, torch, vllm; print(sys.version); print('torch', torch.__version__); print('vllm', vllm.__version__)" \
    > "$out/environment.txt" 2>&1
  site="$out/example-site"
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index --target "$site" \
    examples/mla_prefill_example_backend > "$out/example-install.log" 2>&1
  stamp "example package: rc=$?"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$out/clocks.csv" 2>&1 &
  smi=$!
  stamp "bench and the kernel benchmark, taking turns"
  PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m scripts.bench bench_vs_kernel --live --device cuda \
    --backends FLASH_ATTN,FLASHINFER,TORCH_SDPA,EXAMPLE --json "$out/bench-vs-kernel-live.json" \
    --markdown "$out/bench-vs-kernel-live.md" > "$out/bench-vs-kernel-live.txt" 2> "$out/bench-vs-kernel-live.log"
  rc=$?
  kill "$smi"
  stamp "bench and the kernel benchmark, taking turns: rc=$rc ($(tail -1 "$out/bench-vs-kernel-live.log"))"
  exit $rc
fi

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

for dims in r1 r1-tp1; do
  "$py" -m scripts.bench bench_vs_kernel --bench "$out/bench-$dims.json" --kernel "$out/bench-kernel.json" \
    --json "$out/bench-vs-kernel-$dims.json" --markdown "$out/bench-vs-kernel-$dims.md" \
    > "$out/bench-vs-kernel-$dims.log" 2>&1
  stamp "bench vs kernel.py, $dims: rc=$? ($(tail -1 "$out/bench-vs-kernel-$dims.log"))"
done
