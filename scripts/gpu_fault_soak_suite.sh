#!/usr/bin/env bash
# A fault soak of `vllm serve` (issue 50), one side a call, or all three at once on one GPU:
#   bash scripts/gpu_fault_soak_suite.sh OUT stock|path
#   bash scripts/gpu_fault_soak_suite.sh OUT all   # stock, a second stock lifetime and path side by side (their own
#                                                  # ports, checkpoint copies, GPU_MEM 0.25 each, each started once
#                                                  # the one before is up; OUT/stock, OUT/stock-2, OUT/path), then the
#                                                  # tokens judged (OUT/tokens.txt); in one 10-minute call: DURATION_S=420
# The tiny DeepSeek-V2 with sharp attention (scripts/gpu_harness/make_sharp_checkpoint.py, in SHARP_DIR, default
# ${TMPDIR:-/tmp}/mla-sharp-checkpoint: a wrong attention shows in the tokens), eager, prefix caching, a KV cache of
# KV_TOKENS (default 16384) tokens so that vLLM preempts. path: the add-on with MLA_PREFILL_BACKEND=FLASH_ATTN (the
# shared-prefix path on); stock: MLA_PREFILL_EXT_DISABLE=1. LANES (default 6) clients send greedy streaming
# completions (token ids, logprobs) for WARM_S (default 30) s, then for DURATION_S (default 600) s: bursts of 4-16
# requests over one of 3 shared prefixes of 2560 tokens and requests that share nothing, each prompt seeded by its
# id; ABORT (default 0.3) of them, a seeded choice, disconnect after a random part of their stream. The default meets
# the issue's 10 minutes where a call may run longer; within one 10-minute call use DURATION_S=480 (start, warm-up
# and drain take the rest). It judges (OUT/summary.txt): every request not aborted answered, no 5xx, the server's
# processes alive, at least 50 preemptions (vLLM's /metrics), at least 20% aborted; path: steps with shared
# segments during the soak and the add-on's memos bounded and back to idle (a probe in each server process,
# scripts/gpu_harness/soak_probe, writes OUT/path-PID.jsonl). Tokens against stock, on a CPU after both sides ran:
#   python -m scripts.gpu_harness.soak_verdict STOCK_OUT PATH_OUT [STOCK_OUT2]
# DRY_RUN=1: the server's command and the imports, then stop (no GPU needed). PYTHON (default python3); PYTHONPATH
# is kept. OUT: server.log, client.json, completions.jsonl, metrics-{idle,end}.txt, phases.txt, summary.txt.
set -u
out=${1:?usage: gpu_fault_soak_suite.sh OUT stock|path|all}
side=${2:?usage: gpu_fault_soak_suite.sh OUT stock|path|all}
[[ $side == stock || $side == path || $side == all ]] || { echo "SIDE is stock, path or all, not '$side'" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
if [[ $side == all ]]; then  # the tiny model and its small KV cache leave room for three servers on one GPU
  rc=0 pids=()
  for run in stock:8743 stock-2:8744 path:8745; do
    name=${run%:*}
    PORT=${run#*:} GPU_MEM=${GPU_MEM:-0.25} SHARP_DIR=${TMPDIR:-/tmp}/mla-sharp-$name \
      bash "$self" "$out/$name" "${name%-2}" >"$out/$name.txt" 2>&1 &
    pids+=($!)
    # The next server starts once this one is up: vLLM measures free memory while it starts.
    for ((i = 0; i < ${START_S:-300}; i++)); do
      grep -q "warm-up\|FAIL" "$out/$name/summary.txt" 2>/dev/null && break
      kill -0 "$!" 2>/dev/null || break
      sleep 1
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  tail -n 12 "$out"/stock.txt "$out"/stock-2.txt "$out"/path.txt
  [[ ${DRY_RUN:-0} == 1 ]] && exit "$rc"
  "${PYTHON:-python3}" -m scripts.gpu_harness.soak_verdict "$out/stock" "$out/path" "$out/stock-2" \
    >"$out/tokens.txt" 2>&1 || rc=1
  cat "$out/tokens.txt"
  exit "$rc"
fi
python=${PYTHON:-python3} port=${PORT:-8743} sharp=${SHARP_DIR:-${TMPDIR:-/tmp}/mla-sharp-checkpoint}
block=64 max_len=4096
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [[ $side == stock ]]; then
  env=(MLA_PREFILL_EXT_DISABLE=1)
else
  env=(MLA_PREFILL_BACKEND=FLASH_ATTN "SOAK_PROBE_DIR=$out" "PYTHONPATH=$PWD/scripts/gpu_harness/soak_probe:$PYTHONPATH")
fi
serve=("$python" -m vllm.entrypoints.cli.main serve "$sharp" --served-model-name tiny --port "$port" --host 127.0.0.1
  --skip-tokenizer-init --max-model-len "$max_len" --enforce-eager --enable-prefix-caching --seed 0 --moe-backend triton
  --gpu-memory-utilization "${GPU_MEM:-0.5}" --block-size "$block" --num-gpu-blocks-override $((${KV_TOKENS:-16384} / block)))
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$out/summary.txt"; }
if [[ ${DRY_RUN:-0} == 1 ]]; then
  echo "${env[*]} ${serve[*]}"
  exec env "${env[@]}" "$python" -c "import mla_prefill_ext, scripts.gpu_harness.soak_verdict, \
scripts.gpu_harness.make_sharp_checkpoint; print('imports ok')"
fi
rm -f "$out"/summary.txt "$out"/path-*.jsonl "$out"/completions.jsonl
get() { "$python" -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen('http://127.0.0.1:$port$1', \
timeout=5).read().decode())" 2>/dev/null; }
alive() { kill -0 "$server" 2>/dev/null; }
"$python" scripts/gpu_harness/make_sharp_checkpoint.py "$sharp" >"$out/checkpoint.log" 2>&1 ||
  { stamp "FAIL: the sharp checkpoint (see checkpoint.log)"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1
"$python" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)" >"$out/versions.txt" 2>&1
stamp "vllm serve, $side side ($(cat "$out/versions.txt"))"
setsid env "${env[@]}" "${serve[@]}" >"$out/server.log" 2>&1 &  # its own process group: stopped whole
server=$!
for ((i = 0; i < ${START_S:-300}; i++)); do get /health >/dev/null && break; alive || break; sleep 1; done
get /health >/dev/null || { stamp "FAIL: the server did not come up (see server.log)"; kill -9 -- "-$server"; exit 1; }
client() {  # DURATION SEED: the load; records and counts into OUT (client.json, completions.jsonl)
  "$python" - "$port" "$1" "$2" "${LANES:-6}" "${ABORT:-0.3}" "$out" <<'PY'
import collections, hashlib, http.client, json, random, sys, threading, time
port, duration, seed, lanes, abort_share, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
prefixes = [random.Random(f"prefix-{p}").choices(range(2, 32000), k=2560) for p in range(3)]
counts, statuses, errors, lock = collections.Counter(), collections.Counter(), collections.Counter(), threading.Lock()
deadline, records = time.monotonic() + duration, open(f"{out}/completions.jsonl", "a")
def one(rid, prompt, max_tokens, cut):  # cut: close the stream after this many chunks (None: read it all)
    body = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True,
                logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    conn, rec = http.client.HTTPConnection("127.0.0.1", int(port), timeout=300), dict(tokens=[], logprobs=[], top2=[], top2_tokens=[])
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        with lock: statuses[str(resp.status)] += 1; counts["sent"] += 1
        done = resp.status != 200
        for chunk, line in enumerate(resp):
            if cut is not None and chunk >= cut: break  # the client goes away mid-stream
            if line.startswith(b"data: [DONE]"): done = True
            if not line.startswith(b"data: {"): continue
            choice = json.loads(line[6:])["choices"][0]
            rec["tokens"] += choice.get("token_ids") or []
            lp = choice.get("logprobs") or {}
            rec["logprobs"] += lp.get("token_logprobs", [])
            for top in lp.get("top_logprobs", []):
                best = sorted(top.items(), key=lambda kv: -kv[1])[:2]
                rec["top2"].append([v for _, v in best]); rec["top2_tokens"].append([int(k.split(":")[1]) for k, _ in best])
        kind = "aborted" if not done and cut is not None else "completed" if done and resp.status == 200 else "incomplete"
        with lock:
            counts[kind] += 1
            if kind == "completed":
                sha = hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:16]
                records.write(json.dumps(dict(id=rid, prompt_sha=sha, prompt_len=len(prompt), **rec)) + "\n")
    except Exception as e:
        with lock: errors[type(e).__name__] += 1
    finally:
        conn.close()
def lane(n):
    for r in range(10**9):
        if time.monotonic() > deadline: return
        rng = random.Random(f"{seed}-{n}-{r}")  # the same id, the same prompts, cuts and sizes on every side
        p = rng.randrange(3) if rng.random() < 0.6 else None  # a burst over prefix p, or one request of its own
        heads = [prefixes[p]] * rng.randrange(4, 17) if p is not None else [[]]
        jobs = []
        for i, head in enumerate(heads):
            prompt = head + rng.choices(range(2, 32000), k=rng.randrange(16, 256) if head else rng.randrange(512, 3072))
            max_tokens = rng.randrange(16, 129)
            cut = rng.randrange(1, max_tokens) if rng.random() < abort_share else None
            jobs.append(threading.Thread(target=one, args=(f"{n}-{r}-{i}", prompt, max_tokens, cut)))
        for t in jobs: t.start()
        for t in jobs: t.join()
threads = [threading.Thread(target=lane, args=(n,)) for n in range(lanes)]
for t in threads: t.start()
for t in threads: t.join()
summary = dict(sent=counts["sent"], completed=counts["completed"], aborted=counts["aborted"],
               incomplete=counts["incomplete"], statuses=dict(statuses), errors=dict(errors))
json.dump(summary, open(f"{out}/client.json", "w")); print(summary)
PY
}
stamp "warm-up: ${WARM_S:-30} s"
client "${WARM_S:-30}" warm >"$out/warm.txt" 2>&1
rm -f "$out/completions.jsonl"
sleep 6  # idle: the probe's samples before the soak are the idle sizes
get /metrics >"$out/metrics-idle.txt"
echo "soak_start $(date +%s.%N)" >"$out/phases.txt"
stamp "soak: ${DURATION_S:-600} s"
client "${DURATION_S:-600}" soak >"$out/client.txt" 2>&1
echo "soak_end $(date +%s.%N)" >>"$out/phases.txt"
for ((i = 0; i < 60; i++)); do  # drained: nothing running or waiting (aborts reach the engine core late)
  get /metrics | grep -q '^vllm:num_requests_\(running\|waiting\){.*} [1-9]' || break
  sleep 1
done
sleep 6  # idle again: the probe's last samples are the end sizes
get /metrics >"$out/metrics-end.txt"
rc=0
procs=$(ps -o pid= -g "$server" | wc -l)  # the API server and the engine core (its workers, if any)
if alive && get /health >/dev/null && ((procs >= 2)); then stamp "PASS: alive: health 200, $procs processes"
else stamp "FAIL: alive: the server or its engine core is gone ($procs processes; see server.log)"; rc=1; fi
kill -TERM -- "-$server" 2>/dev/null
for ((i = 0; i < 30; i++)); do alive || break; sleep 1; done
alive && kill -9 -- "-$server"
"$python" -m scripts.gpu_harness.soak_verdict --run "$out" --side "$side" --max-prompt "$max_len" \
  >>"$out/summary.txt" 2>&1 || rc=1
tail -n +3 "$out/summary.txt"
stamp "done: rc=$rc (tokens: python -m scripts.gpu_harness.soak_verdict STOCK_OUT PATH_OUT [STOCK_OUT2])"
exit "$rc"
