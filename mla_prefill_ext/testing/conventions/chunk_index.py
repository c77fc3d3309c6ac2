"""vLLM 0.20's calling convention (0.21-0.27 too): each context chunk is named by its index.

As the engine runs it: the backend is constructed with the layer's seven keyword arguments
(``num_heads``, ``scale``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``, ``vllm_config=None``), then per step ``prepare_metadata(prefill_metadata)``,
``run_prefill_new_tokens(q, k, v, return_softmax_lse)`` and ``run_prefill_context_chunk(chunk_idx,
q, k, v)`` with the whole ``q`` for every chunk, on problems that carry vLLM's own
``MLACommonPrefillMetadata`` (:func:`mla_prefill_ext.testing.problem.make_problem`). V arrives as
vLLM hands it over: a strided view into kv_b_proj's ``[k_nope | v]`` rows (the columns before it
are NaN, so a backend that reads them shows it).
"""

from __future__ import annotations

from typing import Any

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.testing.conventions.base import StepResult, drive_step
from mla_prefill_ext.testing.problem import PrefillProblem


class ChunkIndexConvention:
    """``run_prefill_context_chunk(chunk_idx, q, k, v)``: q shared by the new tokens and every chunk."""

    def construct(self, cls: type[MLAPrefillBackend], kwargs: dict[str, Any]) -> MLAPrefillBackend:
        return cls(**kwargs)

    def new_tokens_call(self, with_lse: bool) -> str:
        return f"run_prefill_new_tokens(return_softmax_lse={with_lse})"

    def chunk_call(self, index: int) -> str:
        return f"run_prefill_context_chunk({index})"

    def run_step(
        self,
        backend: MLAPrefillBackend,
        problem: PrefillProblem,
        with_lse: bool,
        plain: PrefillProblem | None,
    ) -> StepResult:
        p = problem
        return drive_step(
            self,
            p,
            with_lse,
            plain,
            prepare=lambda: backend.prepare_metadata(p.metadata),
            new_tokens=lambda t, lse: backend.run_prefill_new_tokens(t.q, t.k, t.v, lse),
            chunk=lambda i, kc, vc: backend.run_prefill_context_chunk(i, p.q, kc, vc),
        )
