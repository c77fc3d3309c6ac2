"""A fresh Python process, as vLLM starts one, with the add-on's settings only where a test sets them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **env}
    for name in ("MLA_PREFILL_BACKEND", "MLA_PREFILL_EXT_DISABLE", "MLA_PREFILL_BACKEND_OVERRIDES"):
        if name not in env:
            full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code).strip()],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
