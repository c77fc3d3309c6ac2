"""Deliberately wrong MLA prefill backends: the GPU suite must see them fail.

Registered as CUSTOM by class path (``engine_runner.py --custom-class mutant_backends.ScaleOffBackend``;
this folder is put on ``PYTHONPATH`` so vLLM's engine processes import it too). Each is a built-in
with one realistic mistake, in a mixin so the CPU tests of the hosts apply it to TORCH_SDPA too:
:class:`ScaleOffBackend`, softmax scale 2% too large (e.g. part of the YaRN mscale dropped);
:class:`Base2LseBackend`, the LSE in base 2 as FlashInfer's kernels give it (vLLM's natural-log merge
then mis-weights every context chunk); :class:`FlashInferWithoutWarmup`, FLASHINFER with no warm-up
declared, so its kernels are built at the first request (tests/gpu/test_first_request.py). The run
methods pass extra arguments on, so the mixins survive the base API growing.
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


def _name(name: str) -> Any:
    """A backend's ``get_name``: a static method answering ``name``."""
    return staticmethod(lambda: name)


class ScaleOffBackend(ScaleOffMixin, FlashAttnPrefillBackend):
    get_name = _name("MUTANT_SCALE_OFF")


class Base2LseBackend(Base2LseMixin, FlashAttnPrefillBackend):
    get_name = _name("MUTANT_BASE2_LSE")


class SdpaScaleOffBackend(ScaleOffMixin, TorchSDPAPrefillBackend):
    get_name = _name("MUTANT_SDPA_SCALE_OFF")


class SdpaBase2LseBackend(Base2LseMixin, TorchSDPAPrefillBackend):
    get_name = _name("MUTANT_SDPA_BASE2_LSE")


class FlashInferWithoutWarmup(FlashInferPrefillBackend):
    kernel_warmup = None  # the mistake: nothing built or loaded before the engine reports ready
    get_name = _name("MUTANT_NO_WARMUP")
