"""A backend that fails on purpose: the counting backend, raising on its Nth prefill call.

What a failing backend does to a running engine, to see for yourself (docs/deployment.md, "When a
backend fails"): the call numbered ``MLA_PREFILL_FAIL_AT`` (default 10; counted per process over
``run_prefill_new_tokens`` and ``run_prefill_context_chunk``) raises, and the engine stops with that
exception and mla-prefill-ext's note naming the backend and the call; no other backend takes over.
The calls before it run the best built-in kernel and are counted as ``counting_backend.py`` counts
them (``MLA_PREFILL_COUNT_FILE``); the failing one is not. scripts/gpu_failing_backend_suite.sh
runs it on a GPU under a burst of requests.

    PYTHONPATH=examples MLA_PREFILL_FAIL_AT=10 MLA_PREFILL_BACKEND=CUSTOM \\
      MLA_PREFILL_BACKEND_OVERRIDES='{"CUSTOM": "failing_backend.FailingPrefillBackend"}' vllm serve ...
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from counting_backend import CountingPrefillBackend

FAIL_AT_ENV = "MLA_PREFILL_FAIL_AT"


class FailingPrefillBackend(CountingPrefillBackend):
    """Counts its prefill calls in this process (all its instances) and raises on the Nth."""

    calls_made: ClassVar[int] = 0

    @staticmethod
    def get_name() -> str:
        return "FAILING"

    def _fail_if_due(self, what: str) -> None:
        FailingPrefillBackend.calls_made += 1
        n = FailingPrefillBackend.calls_made
        if n == int(os.environ.get(FAIL_AT_ENV, "10")):
            raise RuntimeError(f"FAILING: prefill call {n} ({what}) fails on purpose ({FAIL_AT_ENV}={n})")

    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._fail_if_due("new tokens")
        return super().run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._fail_if_due(f"context chunk {chunk_idx}")
        return super().run_prefill_context_chunk(chunk_idx, q, k, v)
