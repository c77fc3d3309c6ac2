"""Run as a script: the add-on's host mirror of the V2 runner's block tables against vLLM's own tables,
written and gathered by vLLM's own Triton kernels (``apply_staged_writes``, ``gather_block_tables``).

Those kernels need a GPU, or Triton's interpreter: the caller sets ``TRITON_INTERPRET=1`` and an empty
``CUDA_VISIBLE_DEVICES`` (vLLM then keeps Triton on) before this process imports vLLM. Requests come
and go in runner slots (new rows, appended blocks, rows given to other requests, resumed requests
written again); after each step the rows the builder reads for the step's ``req_idx`` must equal the
gathered table vLLM hands its builders. Prints ``LOCKSTEP OK <steps>``.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import torch


def main(seed: int, steps: int = 12) -> None:
    import mla_prefill_ext
    from mla_prefill_ext.mla_layers import MLA_MODULE

    mla_prefill_ext.activate()
    importlib.import_module(MLA_MODULE)  # the path wraps vLLM's runner tables from here on
    from vllm_runner_objects import v2_on_cpu, v2_tables, v2_write_one

    from mla_prefill_ext.hosts.core.shared_prefix import block_tables
    from mla_prefill_ext.testing import vllm_host as host

    rng = np.random.default_rng(seed)
    with v2_on_cpu():
        tables = v2_tables(16, max_num_reqs=8, max_blocks=32)
        live: dict[int, int] = {}
        for step in range(steps):
            for _ in range(3):
                v2_write_one(tables, live, rng)
            tables.apply_staged_writes()
            req_idx = np.array(sorted(live, key=lambda r: rng.random()), dtype=np.int32)
            device = tables.gather_block_tables(torch.from_numpy(req_idx), len(req_idx))[0]
            common = host.prefill_batch([1] * len(req_idx), [1] * len(req_idx), device, 16, req_idx=req_idx)
            rows = block_tables.host_rows(common)
            assert rows is not None, "the gathered table is not one the mirror follows"
            for batch_row, r in enumerate(req_idx):
                n = live[int(r)]
                assert rows[batch_row, :n].tolist() == device[batch_row, :n].tolist(), (step, batch_row)
    print(f"LOCKSTEP OK {steps}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
