"""Deliberately wrong MLA prefill backends: the GPU suite must see them fail.

Each mutant is the add-on's FLASH_ATTN backend with one realistic mistake, registered
as CUSTOM by class path (``engine_runner.py --custom-class mutant_backends.ScaleOffBackend``;
this folder, ``scripts/gpu_harness/doubles``, is put on ``PYTHONPATH`` so vLLM's engine processes
import it too; the CPU tests of the hosts register the SDPA mutants the same way):

* :class:`ScaleOffBackend`: softmax scale 2% too large (a backend that recomputes the
  scale instead of taking the layer's, e.g. dropping part of the YaRN mscale);
* :class:`Base2LseBackend`: returns the softmax LSE in base 2 (``lse / ln 2``), as
  FlashInfer's kernels do, so vLLM's ``merge_attn_states`` (natural log) mis-weights
  every merge of context chunks and new tokens.
* :class:`FlashInferWithoutWarmup`: the add-on's FLASHINFER with no warm-up declared, so
  FlashInfer builds or loads its prefill kernels at the first request instead of at engine
  start (``tests/gpu/test_first_request.py`` must see that).

The mistakes live in mixins, so the CPU layer test (tests/hosts/vllm_0_20/test_layer.py) applies the
very same mutations to the portable TORCH_SDPA backend (:class:`SdpaScaleOffBackend`,
:class:`SdpaBase2LseBackend`). The run methods take and pass on extra arguments, so
the mixins survive the base API growing (``out=``, a chunk object for ``chunk_idx``).
"""

from __future__ import annotations

import math
from typing import Any

from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend
from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

SCALE_ERROR = 1.02
LN2 = math.log(2.0)


class ScaleOffMixin:
    """Softmax scale ``SCALE_ERROR`` times the layer's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # After the base __init__ (which stores the layer's scale): every kernel call reads
        # self.scale. clone() re-runs __init__ from the original arguments: applied once.
        self.scale = self.scale * SCALE_ERROR


class Base2LseMixin:
    """Every returned LSE divided by ln 2 (base 2 instead of natural log)."""

    def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool, *a: Any, **kw: Any):
        ret = super().run_prefill_new_tokens(q, k, v, return_softmax_lse, *a, **kw)
        if return_softmax_lse and isinstance(ret, tuple):
            out, lse = ret
            return out, lse / LN2
        return ret

    def run_prefill_context_chunk(self, chunk: Any, q: Any, k: Any, v: Any, *a: Any, **kw: Any):
        out, lse = super().run_prefill_context_chunk(chunk, q, k, v, *a, **kw)
        return out, lse / LN2


class ScaleOffBackend(ScaleOffMixin, FlashAttnPrefillBackend):
    @staticmethod
    def get_name() -> str:
        return "MUTANT_SCALE_OFF"


class Base2LseBackend(Base2LseMixin, FlashAttnPrefillBackend):
    @staticmethod
    def get_name() -> str:
        return "MUTANT_BASE2_LSE"


class SdpaScaleOffBackend(ScaleOffMixin, TorchSDPAPrefillBackend):
    @staticmethod
    def get_name() -> str:
        return "MUTANT_SDPA_SCALE_OFF"


class SdpaBase2LseBackend(Base2LseMixin, TorchSDPAPrefillBackend):
    @staticmethod
    def get_name() -> str:
        return "MUTANT_SDPA_BASE2_LSE"


class FlashInferWithoutWarmup(FlashInferPrefillBackend):
    kernel_warmup = None  # the mistake: nothing built or loaded before the engine reports ready

    @staticmethod
    def get_name() -> str:
        return "MUTANT_NO_WARMUP"
