"""A backend written to vLLM 0.23+'s own MLA prefill API (not the add-on's), for the bridge tests.

The tests register it through vLLM's own ``register_mla_prefill_backend`` as a user of
vLLM would, in place of vLLM's FLASH_ATTN (whose kernels cannot load on a CPU box), so
that vLLM's automatic selection has a valid pick to compare the add-on's claims with.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend


class NativeFlashAttnStandIn(MLAPrefillBackend):
    """Valid everywhere; never run."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    def run_prefill_new_tokens(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def run_prefill_context_chunk(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError
