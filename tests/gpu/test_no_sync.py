"""No device-to-host read in any backend's step path (so vLLM's async scheduling keeps the CPU ahead).

The patched metadata builder attaches the host copies of the step's offsets; with
them in place, ``prepare_metadata`` and the run methods must not synchronise with
the GPU. ``torch.cuda.set_sync_debug_mode("error")`` turns any synchronising call
(``.item()``, ``.tolist()``, ``.cpu()`` of a device tensor, a blocking copy) into an
error. A backend that plans from ``query_start_loc`` on the device fails here.
"""

from __future__ import annotations

import pytest
import torch

from mla_prefill_ext.backends.base import context_chunks, host_query_start_loc
from mla_prefill_ext.registry import MLAPrefillBackendEnum
from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability
from mla_prefill_ext.testing.problem import make_problem

pytestmark = pytest.mark.gpu


def backend_class_or_skip(name: str) -> type:
    """The backend's class, or skip where it cannot serve R1 dims in bf16 on this device."""
    cls = MLAPrefillBackendEnum[name].get_class()
    reasons = cls.validate_configuration(
        current_device_capability(), MLAPrefillSelectorConfig.from_dims(torch.bfloat16, 128, 64, 128)
    )
    if reasons:
        pytest.skip("; ".join(reasons))
    return cls


def ready(cls: type):
    backend = cls(16, 0.1147, 512, 128, 64, 128, None)
    backend.reserve_workspace(torch.device("cuda"))  # done when vLLM creates the builder
    return backend


@pytest.mark.parametrize("name", ["FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"])
@pytest.mark.parametrize("with_context", [False, True], ids=["new-tokens", "with-context"])
def test_step_path_does_not_synchronise(name, with_context):
    backend = ready(backend_class_or_skip(name))
    for step in range(3):  # metadata changes between steps; the first also builds wrappers
        p = make_problem(
            [300, 17, 1024],
            [700, 0, 2048] if with_context else None,
            num_chunks=2,
            device="cuda",
            seed=step,
        )
        # What the patched builder attaches from the host tensors it already has.
        host_query_start_loc(p.metadata)
        context_chunks(p.metadata)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.prepare_metadata(p.metadata)
            backend.run_prefill_new_tokens(p.q, p.k, p.v, with_context)
            for i in range(len(p.chunk_k)):
                backend.run_prefill_context_chunk(i, p.q, p.chunk_k[i], p.chunk_v[i])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def test_planning_from_device_offsets_is_caught():
    """The check above can fail: FLASHINFER made to plan from the device offsets trips it."""
    cls = backend_class_or_skip("FLASHINFER")

    class PlansFromDeviceOffsets(cls):
        def prepare_metadata(self, prefill_metadata):
            # Drop the host copies the builder attached: planning reads query_start_loc back.
            prefill_metadata.query_start_loc_cpu = None
            prefill_metadata.mla_prefill_context_chunks = None
            super().prepare_metadata(prefill_metadata)

    backend = ready(PlansFromDeviceOffsets)
    p = make_problem([300, 17, 1024], [700, 0, 2048], num_chunks=2, device="cuda", seed=0)
    host_query_start_loc(p.metadata)
    context_chunks(p.metadata)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            backend.prepare_metadata(p.metadata)
    finally:
        torch.cuda.set_sync_debug_mode("default")
