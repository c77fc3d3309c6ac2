"""The add-on's logger: a child of vLLM's, so its lines look like vLLM's own."""

from __future__ import annotations

from vllm.logger import init_logger

# Under the "vllm" logger so vLLM's handler, format and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.mla_prefill_ext")
