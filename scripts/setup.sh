#!/usr/bin/env bash
# Creates .venv with the add-on, vLLM 0.20.2 (with its CUDA PyTorch wheels, several GB: a few
# minutes the first time) and the test tools. Safe to run again: it reuses .venv.
# Prints one line per stage and pip's download progress; pip's own output goes to .venv/setup.log
# (on a failure its last lines are printed). Off a terminal (CI, a log file), where the progress is
# not shown, it also prints a line when each stage is done, with its time.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
log=.venv/setup.log
stage="" started=$SECONDS
done_line() { # the stage in progress is done: say so, with its time, off a terminal only
  if [[ -n $stage && ! -t 1 ]]; then echo "    [$stage/4] done in $((SECONDS - started)) s"; fi
}
step() {
  done_line
  stage=$1 started=$SECONDS
  echo "==> [$1/4] $2"
}
fail() {
  echo "scripts/setup.sh: $1 failed. The last lines of its log, $PWD/$log:" >&2
  tail -n 25 "$log" | sed 's/^/    /' >&2
  exit 1
}

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "scripts/setup.sh needs Python 3.10 or newer as '$python' (set PYTHON=/path/to/python3.x)." >&2
  exit 2
fi

if [[ -x .venv/bin/python ]]; then
  step 1 "Reusing the virtual environment .venv ($(.venv/bin/python --version 2>&1))"
else
  step 1 "Creating the virtual environment .venv ($("$python" --version 2>&1))"
  "$python" -m venv .venv
fi
: >"$log" # one run's output

step 2 "Upgrading pip in .venv (its output: $log)"
.venv/bin/python -m pip install --upgrade pip >>"$log" 2>&1 || fail "upgrading pip"

step 3 "Installing vLLM 0.20.2 with its CUDA PyTorch, the add-on (editable) and the test tools (a few minutes the first time)"
bar=raw # progress reports that pip_progress.py shows; pip before 24.1 (step 2 failed to upgrade) has none
.venv/bin/python -c 'import pip, sys; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (24, 1))' || bar=off
.venv/bin/python -m pip install --progress-bar "$bar" -r requirements-dev.txt 2>&1 |
  .venv/bin/python scripts/pip_progress.py "$log" || fail "pip install -r requirements-dev.txt"

step 4 "Checking that vLLM and the add-on import"
versions=$(.venv/bin/python -c "import vllm, mla_prefill_ext; print('vLLM', vllm.__version__, '| mla-prefill-ext', mla_prefill_ext.__version__)" 2>>"$log") ||
  fail "importing vllm and mla_prefill_ext"
echo "    $versions"
done_line
echo "Done (pip's output: $log). Next: .venv/bin/mla-prefill-ext check (one MLA prefill against a float64 reference)."
echo "Without a GPU, vLLM and PyTorch first log lines about libcuda.so.1, the CUDA runtime and Triton:"
echo "they are expected there (README.md, Quick start)."
