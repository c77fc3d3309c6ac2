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
from mla_prefill_ext.testing.conventions.base import StepResult, synchronize
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
        new = plain_out = None
        chunks: list[Any] = []
        where = "prepare_metadata"
        try:
            backend.prepare_metadata(p.metadata)
            if with_lse:
                where = self.new_tokens_call(True)
                new = backend.run_prefill_new_tokens(p.q, p.k, p.v, True)
            if plain:
                where = self.new_tokens_call(False)
                plain_out = backend.run_prefill_new_tokens(plain.q, plain.k, plain.v, False)
            for i, (kc, vc) in enumerate(zip(p.chunk_k, p.chunk_v, strict=True)):
                where = self.chunk_call(i)
                chunks.append(backend.run_prefill_context_chunk(i, p.q, kc, vc))
            where = "the step (synchronizing the device)"
            synchronize(p.q.device)
        except Exception as e:  # reported, never raised: the report says where
            return StepResult(new, plain_out, chunks, f"{where} raised {type(e).__name__}: {e}")
        return StepResult(new, plain_out, chunks)
