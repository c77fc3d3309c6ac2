"""inputs.unmodified: the backend writes to none of the step's input tensors."""

from __future__ import annotations

import torch

from mla_prefill_ext.testing.compare import changed
from mla_prefill_ext.testing.formatting import fmt
from mla_prefill_ext.testing.problem import PrefillProblem
from mla_prefill_ext.testing.properties import FAIL, PASS
from mla_prefill_ext.testing.recorder import CaseRecorder

PROPS = ("inputs.unmodified",)


def with_lead(t: torch.Tensor) -> torch.Tensor:
    """The whole rows ``t`` (a kv_b_proj tail, see problem.kv_b_proj_tail) is a view of."""
    if t.dim() != 3 or t.stride(-1) != 1:
        return t
    lead = t.stride(-2) - t.shape[-1]
    if lead <= 0 or t.storage_offset() < lead:
        return t
    return t.as_strided((*t.shape[:-1], t.shape[-1] + lead), t.stride(), t.storage_offset() - lead)


def input_tensors(p: PrefillProblem) -> dict[str, torch.Tensor]:
    """Every tensor a step hands the backend, by the name the report gives it."""
    named = {"q": p.q, "k": p.k, "v (and the kv_b_proj rows it is a view of)": with_lead(p.v)}
    for i, (kc, vc) in enumerate(zip(p.chunk_k, p.chunk_v, strict=True)):
        named[f"chunk {i} k"] = kc
        named[f"chunk {i} v (and its rows)"] = with_lead(vc)
    m = p.metadata
    named["metadata.query_start_loc"] = m.query_start_loc
    if m.chunked_context is not None:
        for name in ("cu_seq_lens", "starts", "seq_lens"):
            t = getattr(m.chunked_context, name)
            if isinstance(t, torch.Tensor):
                named[f"metadata.chunked_context.{name}"] = t
    return named


def snapshot(p: PrefillProblem) -> dict[str, torch.Tensor]:
    """Copies of ``p``'s input tensors, to compare with after the step."""
    return {n: t.clone() for n, t in input_tensors(p).items()}


def check_inputs(
    rec: CaseRecorder,
    pristine: dict[str, torch.Tensor],
    inputs: PrefillProblem,
    plain_inputs: PrefillProblem,
) -> None:
    """Compare the inputs of both new-token calls (and the chunks) with their ``pristine`` copies."""
    changes = []
    worst = 0.0
    for where, p in (("", inputs), (" (of the return_softmax_lse=False call)", plain_inputs)):
        for name, after in input_tensors(p).items():
            n, d = changed(pristine[name], after)
            if n:
                changes.append(f"{name}{where}: {n} of {after.numel()} elements, max |change| {fmt(d)}")
                worst = max(worst, d)
    if changes:
        rec.add(
            "inputs.unmodified",
            FAIL,
            "after one step the backend had written to " + "; ".join(changes),
            worst,
            0.0,
        )
    else:
        rec.add("inputs.unmodified", PASS, "no input tensor changed")
