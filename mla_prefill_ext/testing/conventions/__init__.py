"""The ways a host calls a prefill backend; the conformance suite drives backends through one of them."""

from mla_prefill_ext.testing.conventions.base import CallingConvention, StepResult, pair, synchronize
from mla_prefill_ext.testing.conventions.chunk_index import ChunkIndexConvention

DEFAULT_CONVENTION: CallingConvention = ChunkIndexConvention()
"""vLLM 0.20's: the host this add-on patches."""

__all__ = [
    "DEFAULT_CONVENTION",
    "CallingConvention",
    "ChunkIndexConvention",
    "StepResult",
    "pair",
    "synchronize",
]
