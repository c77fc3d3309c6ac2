"""Shared-prefix prefill: a cached prefix that several prefill requests share, worked once per layer.

Stock vLLM gathers and up-projects every request's whole cached context in every layer, so a
prefix shared by B requests is gathered and up-projected B times. Here a step's shared prefixes
are found from host copies of its block table (:mod:`.groups`), planned into shared segments
and private remainders within vLLM's context workspace (:mod:`.plan`), presented to the
selected backend (:mod:`.views`) and run per layer (:mod:`.execute`): each shared segment is
gathered and up-projected once and attended by all its members' queries in one non-causal
call, then each request's private chunks run as today, all merged by LSE.

How a host uses it. Once per step, in the MLA metadata builder after vLLM built the prefill
metadata: :func:`plan_context` from host copies of the prefill requests' block-table rows,
computed tokens and query offsets, the builder's page size and context workspace rows
(``shared=accepts_shared_segments(backend)``); :func:`attach_private_chunks` on the prefill
metadata before the step's backend is prepared; :meth:`SegmentInstance.prepare` (one
instance per builder, kept across steps) for the segments; :meth:`ContextPlan.to` the device.
Per layer, in place of vLLM's ``_compute_prefill_context``: :func:`compute_context`, whose
output and LSE merge with the new tokens exactly as vLLM's do.
"""

from mla_prefill_ext.shared_prefix.execute import (
    LatentLayout,
    LayerContext,
    compute_context,
    gather_latent,
    up_project,
    vllm_merge,
)
from mla_prefill_ext.shared_prefix.groups import SharedPrefixGroup, find_shared_prefixes
from mla_prefill_ext.shared_prefix.plan import (
    ContextPass,
    ContextPlan,
    FlopCostModel,
    SharedSegment,
    accepts_shared_segments,
    plan_context,
)
from mla_prefill_ext.shared_prefix.views import SegmentInstance, SegmentStep, attach_private_chunks

__all__ = [
    "ContextPass",
    "ContextPlan",
    "FlopCostModel",
    "LatentLayout",
    "LayerContext",
    "SegmentInstance",
    "SegmentStep",
    "SharedPrefixGroup",
    "SharedSegment",
    "accepts_shared_segments",
    "attach_private_chunks",
    "compute_context",
    "find_shared_prefixes",
    "gather_latent",
    "plan_context",
    "up_project",
    "vllm_merge",
]
