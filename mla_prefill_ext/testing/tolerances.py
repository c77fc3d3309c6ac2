"""The error each input dtype is allowed, for outputs and for the LSE.

Outputs: relative to the largest reference value, because attention outputs are weighted
means of V and every rounding is relative to their magnitude. bfloat16 ``2**-7`` and
float16 ``2**-10`` are four times the half-ulp rounding of the output (2**-9, 2**-12): the
output rounding itself, the probabilities a kernel may round to the input dtype before
P @ V, and one rounding per ``merge_attn_states`` over two chunks and the new tokens; that
is the tolerance the GPU kernel tests verified FLASH_ATTN and FLASHINFER with on an H200.
float32: ``2e-5``, for float32 accumulation over 192-long dot products and a few hundred
keys (measured: 5e-7). LSE: absolute (an error in the log is a relative error of the
softmax sum); always float32, from inputs the reference sees exactly: ``1e-4`` for float32
inputs, ``2e-3`` for bf16/fp16 (the tolerance the H200 runs verified, allowing kernels'
blockwise rescaling and fast ``exp2``). A base-2 LSE is off by a factor 1.44 (about 1.0
here), a 2% scale error by about 0.05-0.14: both far outside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """Error allowed for one input dtype (see the module docstring for why)."""

    output_rel: float
    """Max |output - reference| allowed, relative to max |reference|."""
    lse_abs: float
    """Max |LSE - reference LSE| allowed (natural log)."""


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(output_rel=2e-5, lse_abs=1e-4),
    torch.bfloat16: Tolerance(output_rel=2.0**-7, lse_abs=2e-3),
    torch.float16: Tolerance(output_rel=2.0**-10, lse_abs=2e-3),
}
