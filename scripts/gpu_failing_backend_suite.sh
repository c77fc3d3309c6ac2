#!/usr/bin/env bash
# A backend that raises mid-run, on a real `vllm serve` under load (docs/deployment.md, "When a backend fails"):
#   bash scripts/gpu_failing_backend_suite.sh OUT
# `vllm serve` on the tiny DeepSeek-V2 (dummy weights, eager) with examples/failing_backend.py as CUSTOM,
# raising on its FAIL_AT-th prefill call (default 40); CLIENTS (default 32) clients send completions
# (a shared 512-token header, then their own tokens) until the server is gone. It passes when: the server
# was up before the failure (fewer calls counted at ready), the server exits within EXIT_S (default 90)
# of the failure reaching its log (no hang), every traceback of the failure carries exactly one note,
# the same one, naming FAILING and the call, the count file holds the FAIL_AT-1 calls before it (nothing
# ran after), and no client is left waiting. DRY_RUN=1: the server's command and the example's class
# as the registry loads it, then stop (no GPU needed). PYTHON (default python3); PYTHONPATH is kept.
# Everything lands in OUT: server.log, calls.txt, load.txt, summary.txt.
set -u
out=${1:?usage: gpu_failing_backend_suite.sh OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3} fail_at=${FAIL_AT:-40} port=${PORT:-8741} exit_s=${EXIT_S:-90}
export PYTHONPATH="$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 MLA_PREFILL_BACKEND=CUSTOM MLA_PREFILL_FAIL_AT=$fail_at MLA_PREFILL_COUNT_FILE=$out/calls.txt
export MLA_PREFILL_BACKEND_OVERRIDES='{"CUSTOM": "failing_backend.FailingPrefillBackend"}'
serve=("$python" -m vllm.entrypoints.cli.main serve scripts/gpu_harness/tiny_deepseek_v2 --served-model-name tiny
  --port "$port" --host 127.0.0.1 --load-format dummy --skip-tokenizer-init --max-model-len 4096 --enforce-eager
  --enable-prefix-caching --seed 0 --moe-backend triton --gpu-memory-utilization 0.5 --disable-log-stats)
stamp() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$out/summary.txt"; }
if [[ ${DRY_RUN:-0} == 1 ]]; then
  echo "${serve[*]}"
  exec "$python" -c "from mla_prefill_ext import MLAPrefillBackendEnum as E; print(E.CUSTOM.get_class())"
fi
rm -f "$out/calls.txt" "$out/summary.txt"
health() { "$python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; }
alive() { kill -0 "$server" 2>/dev/null; }
calls() { cat "$out/calls.txt" 2>/dev/null | wc -l; }
note="mla-prefill-ext: MLA prefill backend FAILING (failing_backend.FailingPrefillBackend) raised in run_prefill_"

stamp "vllm serve with FAILING as CUSTOM (MLA_PREFILL_FAIL_AT=$fail_at)"
setsid "${serve[@]}" >"$out/server.log" 2>&1 &  # its own process group: a hung server is stopped whole
server=$!
for ((i = 0; i < ${START_S:-600}; i++)); do health && break; alive || break; sleep 1; done
health || { stamp "FAIL: the server did not come up (see server.log)"; kill -9 -- "-$server" 2>/dev/null; exit 1; }
at_ready=$(calls)
stamp "up; $at_ready prefill calls counted at ready; the load starts"
"$python" - "$port" "${CLIENTS:-32}" >"$out/load.txt" 2>&1 <<'PY' &
import collections, json, random, sys, threading, urllib.error, urllib.request
port, clients = sys.argv[1], int(sys.argv[2])
header, outcomes = list(range(2, 514)), collections.Counter()
def client(seed):
    rng = random.Random(seed)
    while True:  # until the server is gone: then the connection is refused
        prompt = header + [rng.randrange(2, 32000) for _ in range(rng.randrange(64, 1024))]
        body = json.dumps(dict(model="tiny", prompt=prompt, max_tokens=8, ignore_eos=True, temperature=0.0))
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        try:
            outcomes[str(urllib.request.urlopen(request, timeout=120).status)] += 1
        except urllib.error.HTTPError as e:
            outcomes[str(e.code)] += 1
        except Exception as e:  # the server going away: cut off, reset, then refused
            reason = getattr(e, "reason", e)
            outcomes[type(reason).__name__] += 1
            if isinstance(reason, ConnectionRefusedError):
                return
threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
print("outcomes:", dict(outcomes))
PY
load=$!
for ((i = 0; i < ${LOAD_S:-300}; i++)); do grep -q -F "$note" "$out/server.log" && break; alive || break; sleep 1; done
failed_at=$(date +%s) rc=0
if ! grep -q -F "$note" "$out/server.log"; then
  stamp "FAIL: no failure of FAILING in the log after ${LOAD_S:-300} s of load (see server.log)"
  rc=1
fi
while alive && (($(date +%s) - failed_at < exit_s)); do sleep 1; done
if alive; then
  stamp "FAIL: the server still runs ${exit_s} s after the failure (a hang): stopped"
  kill -9 -- "-$server"
  rc=1
else
  stamp "the server exited $(($(date +%s) - failed_at)) s after the failure reached its log"
fi
for ((i = 0; i < 150; i++)); do kill -0 "$load" 2>/dev/null || break; sleep 1; done
kill -0 "$load" 2>/dev/null && { stamp "FAIL: clients still waiting 150 s after the server exited"; kill "$load"; rc=1; }
notes=$(grep -c -F "$note" "$out/server.log")
distinct=$(grep -o "mla-prefill-ext: MLA prefill backend .*" "$out/server.log" | sort -u | wc -l)
raised=$(grep -c -F "RuntimeError: FAILING: prefill call $fail_at (" "$out/server.log")
stamp "$(tail -1 "$out/load.txt"); tracebacks of the failure: $raised, its notes: $notes ($distinct distinct);" \
  "calls counted: $(calls)"
grep -o "mla-prefill-ext: MLA prefill backend .*" "$out/server.log" | sort -u | tee -a "$out/summary.txt"
((notes >= 1 && distinct == 1 && notes == raised)) || { stamp "FAIL: not one note per traceback, naming FAILING"; rc=1; }
(($(calls) == fail_at - 1 && at_ready < fail_at - 1)) || { stamp "FAIL: not FAIL_AT-1 calls, after ready"; rc=1; }
stamp "done: rc=$rc"
exit "$rc"
