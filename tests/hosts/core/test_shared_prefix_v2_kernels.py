"""The V2 host mirror against vLLM's own block-table kernels, run by Triton's interpreter on the CPU.

In-process tests build vLLM's real ``BlockTables`` but do its two Triton kernels' writes in torch
(``vllm_runner_objects.v2_apply``/``v2_gather``). Here vLLM's kernels themselves run, in a process of
their own (Triton's interpreter must be chosen before vLLM is imported, and it would change what the
rest of the suite runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[2] / "helpers"


@pytest.mark.parametrize("seed", [0, 1])
def test_the_mirror_equals_the_table_vllms_own_kernels_write_and_gather(seed):
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    if "V2" not in needs.runners_here() or needs.problems("plan", "V2"):
        pytest.skip("the path does not read this vLLM's V2 runner (vLLM 0.33+ only)")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",  # vLLM keeps Triton on; the interpreter runs its kernels
        "PYTHONPATH": os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(HELPERS / "v2_mirror_lockstep.py"), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0 and "LOCKSTEP OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
