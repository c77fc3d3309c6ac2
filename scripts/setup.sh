#!/usr/bin/env bash
# Creates .venv with the add-on, vLLM 0.20.2 (with its CUDA PyTorch wheels, several GB: a few
# minutes the first time) and the test tools. Safe to run again: it reuses .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
step() { echo "==> [$1/4] $2"; }

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

step 2 "Upgrading pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip

step 3 "Installing vLLM 0.20.2 with its CUDA PyTorch, the add-on (editable) and the test tools (a few minutes the first time)"
.venv/bin/python -m pip install -r requirements-dev.txt

step 4 "Checking that vLLM and the add-on import"
.venv/bin/python -c "import vllm, mla_prefill_ext; print('vLLM', vllm.__version__, '| mla-prefill-ext', mla_prefill_ext.__version__)"
echo "Done. Next: .venv/bin/mla-prefill-ext check (one MLA prefill against a float64 reference)."
echo "Without a GPU, vLLM and PyTorch first log lines about libcuda.so.1, the CUDA runtime and Triton:"
echo "they are expected there (README.md, Quick start)."
