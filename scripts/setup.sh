#!/usr/bin/env bash
# Creates .venv with the add-on and vLLM 0.20.2 (CUDA torch wheels: a few minutes once).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -c "import vllm, mla_prefill_ext; print('vLLM', vllm.__version__, '| mla-prefill-ext', mla_prefill_ext.__version__)"
