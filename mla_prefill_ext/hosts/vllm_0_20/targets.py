"""The patch targets in vLLM 0.20.x and the shape each must have to be patched.

A target that is missing or shaped differently means vLLM changed under us:
then nothing is patched at all (see :mod:`mla_prefill_ext.hosts.vllm_0_20`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

PREFILL_CHOICE_FUNCTIONS = (
    "use_flashinfer_prefill",
    "use_cudnn_prefill",
    "use_trtllm_ragged_deepseek_prefill",
)
QUERY_QUANT_FUNCTION = "backend_supports_prefill_query_quantization"


# NamedTuples, not frozen dataclasses: these load in every MLA engine process, and a
# frozen dataclass costs about 1 ms to create, a NamedTuple about 0.1 ms.
class Target(NamedTuple):
    """One attribute of the MLA module the patch relies on, and its expected shape."""

    path: str  # dotted, relative to the MLA module
    wrapped: bool  # True: the patch wraps it; False: the patch only relies on it
    check: Callable[[Any], str | None]


class TargetStatus(NamedTuple):
    path: str
    wrapped: bool
    problem: str | None  # None: found and shaped as expected

    @property
    def ok(self) -> bool:
        return self.problem is None


def _params(*names: str) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        if not callable(obj):
            return "is not callable"
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return "has no inspectable signature"
        missing = [n for n in names if n not in params]
        return f"lacks parameters {missing}" if missing else None

    return check


def _zero_arg_function(obj: Any) -> str | None:
    if not callable(obj):
        return "is not callable"
    try:
        inspect.signature(obj).bind()
    except TypeError:
        return "no longer takes zero arguments"
    except ValueError:
        return "has no inspectable signature"
    return None


def _dataclass_with(*fields: str) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        if not dataclasses.is_dataclass(obj):
            return "is not a dataclass"
        have = {f.name for f in dataclasses.fields(obj)}
        missing = [f for f in fields if f not in have]
        return f"lacks fields {missing}" if missing else None

    return check


# Checked here: each target's signature or fields. What the patch relies on beyond them is checked
# against vLLM's own code in the tests (tests/hosts/vllm_0_20/test_layer.py): vLLM's __init__s take their
# prefill choice through the choice functions; forward_mha and _compute_prefill_context call the impl's
# _run_prefill_new_tokens and _run_prefill_context_chunk and merge their outputs. The context-parallel
# loop needs a decode-context-parallel group, which those tests do not set up.
TARGETS: tuple[Target, ...] = (
    Target(
        "MLAAttention.__init__",
        True,
        _params("num_heads", "scale", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"),
    ),
    Target("MLACommonImpl.__init__", True, _params("scale", "v_head_dim")),
    Target(
        "MLACommonImpl.forward_mha",
        False,
        _params("q", "kv_c_normed", "k_pe", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale", "output"),
    ),
    Target(
        "MLACommonImpl._compute_prefill_context",
        False,
        _params("q", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale"),
    ),
    Target(
        "MLACommonImpl._context_parallel_compute_prefill_context",
        False,
        _params("q", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale", "dcp_world_size"),
    ),
    Target(
        "MLACommonMetadataBuilder.__init__",
        True,
        _params("kv_cache_spec", "layer_names", "vllm_config", "device"),
    ),
    Target("MLACommonMetadataBuilder.build", True, _params("common_prefix_len", "common_attn_metadata")),
    Target(
        "MLACommonPrefillMetadata",
        False,
        _dataclass_with("query_start_loc", "max_query_len", "chunked_context", "q_data_type", "output_dtype"),
    ),
    *(Target(name, True, _zero_arg_function) for name in (*PREFILL_CHOICE_FUNCTIONS, QUERY_QUANT_FUNCTION)),
)


def resolve(module: ModuleType, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def inspect_targets(module: ModuleType) -> list[TargetStatus]:
    """Find every target in the module and check its shape."""
    statuses = []
    for target in TARGETS:
        try:
            obj = resolve(module, target.path)
        except AttributeError:
            statuses.append(TargetStatus(target.path, target.wrapped, "not found"))
            continue
        owner_path, _, name = target.path.rpartition(".")
        owner = resolve(module, owner_path) if owner_path else None
        if isinstance(owner, type) and name not in owner.__dict__:
            # Inherited from a base class: not the code the patch was written for.
            statuses.append(
                TargetStatus(target.path, target.wrapped, f"is no longer defined on {owner_path}")
            )
            continue
        # Look through a wrapper someone (us included) already put on it.
        obj = getattr(obj, "__wrapped__", obj)
        statuses.append(TargetStatus(target.path, target.wrapped, target.check(obj)))
    return statuses
