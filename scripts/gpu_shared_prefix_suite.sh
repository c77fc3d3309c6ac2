#!/usr/bin/env bash
# The shared-prefix path on one GPU, in parts that each fit one call of a few minutes:
#   bash scripts/gpu_shared_prefix_suite.sh OUT bench    # engine, R1 slice, eager: stock vs FLASH_ATTN (path on),
#                                                       # shared 32k prefix (N = 1 gives the prefix's fixed cost),
#                                                       # fresh prompts, private contexts, decode, with the path's
#                                                       # counters (steps with segments, steps routed)
#   bash scripts/gpu_shared_prefix_suite.sh OUT bench-compiled  # the same engines compiled, CUDA graphs
#   bash scripts/gpu_shared_prefix_suite.sh OUT control  # eager, the points that read below 0.97 on vLLM 0.25.1
#                                                       # (private 8k, fresh) with two stock lifetimes and the
#                                                       # path with and without its gathering: spread vs cost
#   bash scripts/gpu_shared_prefix_suite.sh OUT pause    # eager, the private and fresh points: the path on and
#                                                       # paused (all of it; plan+route; the engine core's parts)
#                                                       # call by call in one add-on engine, next to two stock
#                                                       # lifetimes (cost vs lifetime spread)
#   bash scripts/gpu_shared_prefix_suite.sh OUT parts    # eager, shared 32k and 8k prefixes, N = 32, 128, 512:
#                                                       # each part of the path paused alone in one add-on
#                                                       # engine, the whole path paused, stock (what each part is
#                                                       # worth)
#   bash scripts/gpu_shared_prefix_suite.sh OUT lifetimes  # eager, fresh prompts: three stock engines, three
#                                                       # with the path on, two with it off, side by side
#                                                       # (what a configuration costs vs what lifetimes of one
#                                                       # configuration differ by); COMPILED=1: compiled, CUDA
#                                                       # graphs, fresh 16 x 128, stock x3 and the path on x2
#   bash scripts/gpu_shared_prefix_suite.sh OUT parity   # tiny sharp checkpoint: two stock lifetimes, three with
#                                                       # short extends on vLLM's prefill path (the path on routes
#                                                       # them there), the path on, the three wrong-path mutants; their
#                                                       # verdicts; stock's two paths against each other
#   bash scripts/gpu_shared_prefix_suite.sh OUT decode-parity  # tiny sharp checkpoint, eager: decode rows over a
#                                                       # shared prefix (two stock lifetimes, vLLM's FlashMLA on
#                                                       # the same rows, the path with decode rows on, its three
#                                                       # wrong-decode mutants); their verdicts
#   bash scripts/gpu_shared_prefix_suite.sh OUT tp2      # two GPUs, vLLM 0.25+: TP=2 with mp and with Ray (Ray
#                                                       # installed), the path on and off, stock's lifetimes, a
#                                                       # mutant; one engine per GPU at a time; the verdicts; the
#                                                       # records packed as OUT/tp2-scenarios.tar.gz
#   bash scripts/gpu_shared_prefix_suite.sh OUT profile  # eager (COMPILED=1: compiled): where a step's time goes
#                                                       # (host, GPU busy, kernel groups) under vLLM's torch
#                                                       # profiler, stock against the path's decode rows over a
#                                                       # shared 32k prefix, and the path's prefill (TRACES=DIR:
#                                                       # where the traces go, default /tmp/mla-traces)
#   bash scripts/gpu_shared_prefix_suite.sh OUT decode-crossover  # one R1 layer's decode, vLLM's against the
#                                                       # path's over B x P x S: where the shared call pays
#                                                       # (SPLITS=N: the prefix call's num_splits)
#   bash scripts/gpu_shared_prefix_suite.sh OUT layer    # one R1 layer's context part: vLLM's plan, shared,
#                                                       # absorbed (the router's calibration)
#   bash scripts/gpu_shared_prefix_suite.sh OUT memory   # one engine at gpu_memory_utilization 0.9 (SIDE=stock
#                                                       # or a backend; default FLASH_ATTN), its workload's peak
# PREFIX_LENS=32768,8192 (bench, bench-compiled): the shared points at each prefix length.
# NAMES=a,b (parity, decode-parity): those scenarios only (parity: and their pairs); the verdicts are replayed
# on a CPU then. PACK=1 (parity, decode-parity): the scenarios' files as one OUT/scenarios.tar.gz; BUDGET=S
# (parity, decode-parity): the scenarios stop after S seconds, those done kept; SHARP_DIR: where the checkpoint
# goes.
# Everything lands in OUT. The full scenario list and the compiled runs: docs/gpu-verification.md and
# docs/benchmarks.md ("Shared-prefix engine").
set -u
out=${1:?usage: gpu_shared_prefix_suite.sh OUT bench|bench-compiled|control|pause|parts|lifetimes|parity|decode-parity|tp2|profile|decode-crossover|layer|memory}
part=${2:?usage: gpu_shared_prefix_suite.sh OUT bench|bench-compiled|control|pause|parts|lifetimes|parity|decode-parity|tp2|profile|decode-crossover|layer|memory}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python=${PYTHON:-python}
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
pack() {  # PACK=1: the scenarios' files as one OUT/scenarios.tar.gz (for hosts that copy back few files)
  [[ ${PACK:-0} == 1 && -d $out/scenarios ]] || return 0
  tar -czf "$out/scenarios.tar.gz" -C "$out" scenarios && rm -rf "$out/scenarios" || rc=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1
"$python" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)" >"$out/versions.txt" 2>/dev/null
case $part in
bench)
  stamp "engine benchmark (eager)"
  "$python" -m scripts.bench shared_prefix_engine --eager --sides stock,FLASH_ATTN \
    --scenarios shared,private,fresh,decode --prefix-lens "${PREFIX_LENS:-32768}" --points 16x1,16x32,16x128,16x512,8x1024 \
    --private-points 16x128 --decode-points 16x32 --decode-tokens 32 --reps 8 --stop-after "${STOP_AFTER:-470}" \
    --json "$out/engine-eager.json" >"$out/engine-eager.log" 2>&1
  rc=$?
  grep -v "WARNING\|INFO" "$out/engine-eager.log" | tail -24
  ;;
bench-compiled)
  stamp "engine benchmark (compiled, CUDA graphs)"
  "$python" -m scripts.bench shared_prefix_engine --sides stock,FLASH_ATTN --scenarios shared,private,fresh \
    --prefix-lens "${PREFIX_LENS:-32768}" --points 16x32,16x128,16x512,8x1024 --private-points 16x128 --reps 6 \
    --stop-after "${STOP_AFTER:-500}" --json "$out/engine-compiled.json" >"$out/engine-compiled.log" 2>&1
  rc=$?
  grep -v "WARNING\|INFO" "$out/engine-compiled.log" | tail -20
  ;;
control)
  stamp "control (eager): two stock lifetimes, the path with and without its gathering"
  "$python" -m scripts.bench shared_prefix_engine --eager --sides stock,stock:2,FLASH_ATTN,FLASH_ATTN:nogather \
    --scenarios shared,private,fresh --prefix-lens 32768 --points 16x32,16x128 --private-points 16x128 \
    --reps "${REPS:-10}" --gpu-mem 0.2 --stop-after "${STOP_AFTER:-470}" \
    --json "$out/engine-control.json" >"$out/engine-control.log" 2>&1
  rc=$?
  grep -v "WARNING\|INFO" "$out/engine-control.log" | grep "^|\|^note:\|against every stock lifetime"
  ;;
pause | parts)
  if [[ $part == pause ]]; then  # where nothing is shared: does the path cost anything, against two stock lifetimes
    stamp "the path on and paused in one engine lifetime (eager), two stock lifetimes"
    sides=stock,stock:2,FLASH_ATTN,FLASH_ATTN:pause,FLASH_ATTN:pause-plan+route,FLASH_ATTN:pause-hashes+hits+gather
    shape=(--scenarios private,fresh --prefix-lens 32768 --points 16x32,16x128 --private-points 16x128 --gpu-mem 0.2)
    reps=${REPS:-200}
  else  # over a shared prefix: what each part is worth, as its share of the whole path's gain
    stamp "each part of the path paused alone in one engine lifetime (eager), shared 32k and 8k prefixes"
    sides=stock,FLASH_ATTN,FLASH_ATTN:pause,FLASH_ATTN:pause-plan,FLASH_ATTN:pause-route,FLASH_ATTN:pause-hashes
    sides=$sides,FLASH_ATTN:pause-hits,FLASH_ATTN:pause-gather
    shape=(--scenarios shared --prefix-lens "${PREFIX_LENS:-32768,8192}" --points 16x32,16x128,16x512)
    reps=${REPS:-3}
  fi
  "$python" -m scripts.bench shared_prefix_engine --eager --sides "$sides" "${shape[@]}" --reps "$reps" \
    --stop-after "${STOP_AFTER:-470}" --json "$out/engine-$part.json" >"$out/engine-$part.log" 2>&1
  rc=$?
  grep -v "WARNING\|INFO" "$out/engine-$part.log" |
    grep "^|\|^note:\|against every stock lifetime\|in one engine lifetime"
  ;;
lifetimes)
  if [[ ${COMPILED:-0} == 1 ]]; then  # each engine compiles: fewer of them, the one compiled point left open
    stamp "lifetimes (compiled, CUDA graphs, fresh 16 x 128): stock x3, the path on x2"
    mode=() sides=stock,stock:2,stock:3,FLASH_ATTN,FLASH_ATTN:2 points=16x128 mem=0.17 name=lifetimes-compiled
  else
    stamp "lifetimes (eager, fresh prompts): stock x3, the path on x3, the path off x2"
    mode=(--eager) sides=stock,stock:2,stock:3,FLASH_ATTN,FLASH_ATTN:2,FLASH_ATTN:3,FLASH_ATTN:noshare,FLASH_ATTN:noshare:2
    points=16x32,16x128 mem=0.11 name=lifetimes
  fi
  "$python" -m scripts.bench shared_prefix_engine "${mode[@]}" --sides "$sides" --scenarios fresh \
    --points "$points" --reps "${REPS:-200}" --gpu-mem "$mem" --max-model-len 4096 \
    --stop-after "${STOP_AFTER:-470}" --json "$out/engine-$name.json" >"$out/engine-$name.log" 2>&1
  rc=$?
  grep -v "WARNING\|INFO" "$out/engine-$name.log" |
    grep "^|\|^note:\|against every stock lifetime"
  ;;
parity | decode-parity)
  names=stock-shared,stock-shared-2,stock-shared-prefill,stock-shared-prefill-2,stock-shared-prefill-3
  names=$names,shim-fa-shared,mutant-shared-other-prefix,mutant-shared-drop-lse,mutant-shared-segment-scale
  tests=(tests/gpu/test_shared_prefix.py -k "not chunks and not compiled and not off and not shim-fa-shared-2")
  if [[ $part == decode-parity ]]; then  # every decode scenario, and their verdicts
    names=$("$python" -c 'from scripts.gpu_harness import scenarios; print(",".join(scenarios.DECODE_SCENARIOS))')
    tests=(tests/gpu/test_shared_prefix_decode.py)
  fi
  names=${NAMES:-$names}
  stamp "scenarios $names"
  # The checkpoint (regenerated from its seed, tens of MB) stays out of OUT.
  # BUDGET (seconds, 0: none): the scenarios stop there; those done are kept (and packed with PACK=1).
  timeout --kill-after=15 "${BUDGET:-0}" "$python" -m scripts.gpu_harness.scenarios --results "$out/scenarios" \
    --model-dir "${SHARP_DIR:-${TMPDIR:-/tmp}/mla-sharp-checkpoint}" --only "$names" >"$out/scenarios.log" 2>&1
  ran=$?  # a scenario that failed to run, a name the harness does not know, or 124: BUDGET ran out
  if [[ -n ${NAMES:-} ]]; then  # a subset: the verdicts would run the others here; replay them on a CPU
    where=$out/scenarios
    [[ ${PACK:-0} == 1 ]] && where="(OUT/scenarios.tar.gz unpacked)"
    stamp "verdicts: not run (NAMES); replay on a CPU with the stock lifetimes they need, e.g." \
      "MLA_GPU_RESULTS=EARLIER_RUN:$where python -m pytest -q -s ${tests[0]} -k NAME"
    rc=$ran
    if [[ $part == parity ]]; then
      "$python" -m scripts.gpu_harness.shared_pairs "$out/scenarios" >"$out/pairs.txt" 2>&1
      cut -c1-400 "$out/pairs.txt" | tail -20
    fi
    pack
    stamp "done: rc=$rc"
    exit "$rc"
  fi
  stamp "verdicts over those scenarios"
  MLA_GPU_RESULTS="$out/scenarios" "$python" -m pytest -q -s -p no:cacheprovider "${tests[@]}" >"$out/verdicts.txt" 2>&1
  rc=$?
  ((ran == 0)) || rc=$ran
  tail -15 "$out/verdicts.txt"
  if [[ $part == parity ]]; then
    stamp "every pair: stock lifetimes, candidates, vLLM's two paths for short extends against each other"
    "$python" -m scripts.gpu_harness.shared_pairs "$out/scenarios" >"$out/pairs.txt" 2>&1
    cut -c1-400 "$out/pairs.txt" | tail -20
  fi
  pack
  ;;
tp2)
  # The records go to a folder outside OUT (the checkpoint, tens of MB, is generated into it), then
  # into one archive: some hosts copy back only a few files.
  work=${TMPDIR:-/tmp}/mla-shared-tp2
  stamp "TP=2 shared-prefix scenarios (mp, then Ray) in $work"
  "$python" -m scripts.gpu_harness.session shared-multi --results "$work" >"$out/tp2-session.log" 2>&1
  rc=$?
  grep "^\[" "$out/tp2-session.log" | tail -20
  stamp "verdicts"
  MLA_GPU_RESULTS="$work" "$python" -m pytest -q -s -rfs -p no:cacheprovider tests/gpu/test_shared_prefix_tp2.py \
    >"$out/tp2-verdicts.txt" 2>&1 || rc=1
  tail -12 "$out/tp2-verdicts.txt"
  (cd "$work" && tar -czf "$out/tp2-scenarios.tar.gz" ./*.json ./*.log) || rc=1
  ;;
memory)
  stamp "memory: one engine at gpu_memory_utilization=0.9, the largest shared points (${SIDE:-FLASH_ATTN})"
  "$python" -m scripts.bench shared_prefix_engine --eager --sides "${SIDE:-FLASH_ATTN}" --baseline "${SIDE:-FLASH_ATTN}" \
    --gpu-mem 0.9 --scenarios shared --prefix-lens 32768 --points 16x512,8x1024 --reps 2 \
    --json "$out/memory-${SIDE:-FLASH_ATTN}.json" >"$out/memory-${SIDE:-FLASH_ATTN}.log" 2>&1
  rc=$?
  grep -v "WARNING\|INFO" "$out/memory-${SIDE:-FLASH_ATTN}.log" | tail -12
  grep "KV cache memory\|Available\|profil" "$out/memory-${SIDE:-FLASH_ATTN}.log" | tail -4
  ;;
profile)
  # Traces outside OUT (tens of MB); the summaries are in the JSON. COMPILED=1: compiled, CUDA graphs.
  traces=${TRACES:-/tmp/mla-traces}
  eager=--eager
  [[ ${COMPILED:-0} == 1 ]] && eager=
  stamp "where a step's time goes: decode rows over a shared 32k prefix, stock and the path's decode ($eager)"
  "$python" -m scripts.bench shared_prefix_engine $eager --sides stock,FLASH_ATTN:decode --scenarios decode \
    --decode-prefix-len 32768 --decode-points 64x32 --decode-tokens 64 --reps 1 --profile "$traces/decode" \
    --profile-steps 8:16 --json "$out/profile-decode.json" >"$out/profile-decode.log" 2>&1
  rc=$?
  stamp "the same for a shared 32k prefix's prefill, 16 x 512 (stock, the path)"
  "$python" -m scripts.bench shared_prefix_engine $eager --sides stock,FLASH_ATTN --scenarios shared \
    --prefix-lens 32768 --points 16x512 --reps 1 --profile "$traces/prefill" --profile-steps 0:4 \
    --json "$out/profile-prefill.json" >"$out/profile-prefill.log" 2>&1 || rc=1
  grep -h "^| " "$out"/profile-*.log | grep -v "^| scenario\|^| point" | tail -20
  ;;
decode-crossover)
  stamp "one layer's decode, vLLM's against the path's, over requests x prefix x private (SPLITS=${SPLITS:-0})"
  "$python" -m scripts.bench shared_decode_crossover --shared-splits "${SPLITS:-0}" \
    --json "$out/decode-crossover-${SPLITS:-0}.json" >"$out/decode-crossover-${SPLITS:-0}.log" 2>&1
  rc=$?
  tail -8 "$out/decode-crossover-${SPLITS:-0}.log"
  ;;
layer)
  stamp "one layer: vLLM's plan, shared, absorbed"
  "$python" -m scripts.bench shared_prefix_layer --new 32,128,256,512 --json "$out/layer.json" >"$out/layer.log" 2>&1
  rc=$?
  tail -20 "$out/layer.log"
  ;;
*)
  echo "unknown part '$part': bench, bench-compiled, control, pause, parts, lifetimes, parity, decode-parity, tp2, layer or memory" >&2
  exit 2
  ;;
esac
stamp "done: rc=$rc"
exit "$rc"
