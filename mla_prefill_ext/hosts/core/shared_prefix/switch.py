"""Whether the shared-prefix path runs in this engine: the user's setting, then what it cannot serve yet.

On by default. ``MLA_PREFILL_SHARED_PREFIX=0`` (or ``additional_config["mla_prefill_shared_prefix"]``
false) turns it off. Excluded for now, each with its reason: an FP8 KV cache (vLLM gathers it
without dequantizing, the path up-projects bf16 rows), decode context parallelism (each rank
holds part of the context), prefill context parallelism, dual-batch overlap (two micro-batches
split one step's requests; the path plans a whole step), and a model runner whose block tables the path
cannot read (:mod:`.needs`: the V1 runner's host table, the V2 runner's writes from vLLM 0.33, whose
builders learn each row's request).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.core.shared_prefix import block_tables, needs
from mla_prefill_ext.settings import shared_prefix_setting


class PathDecision(NamedTuple):
    on: bool
    reason: str  # why, in words for a log line or ``info``


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """Whether this engine's workers run vLLM's V2 model runner (``vllm/v1/worker/gpu/``).

    vLLM 0.25-0.33 decide it in ``VllmConfig.use_v2_model_runner`` (the environment, then the model);
    before, only ``VLLM_USE_V2_MODEL_RUNNER=1`` picks it; 0.34 has no other runner (no V1 runner module).
    """
    if "use_v2_model_runner" in dir(type(vllm_config)):
        return bool(vllm_config.use_v2_model_runner)
    if needs.V1 not in needs.runners_here():
        return True
    from vllm import envs

    return bool(getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False))


def runner_of(vllm_config: Any) -> str:
    """``"V2"`` or ``"V1"``: the model runner this engine's workers run."""
    return "V2" if uses_v2_model_runner(vllm_config) else "V1"


def _runner_remedy(runner: str) -> str:
    """What a user can do where the path cannot read ``runner``'s block tables: the other runner, where
    this vLLM has it and the path reads it (0.34 has no V1 runner: no such advice there)."""
    other = "V1" if runner == "V2" else "V2"
    if block_tables.RUNNER_PROBLEMS.get(other, "") is None:
        value = 1 if other == "V2" else 0
        return f"; VLLM_USE_V2_MODEL_RUNNER={value} selects the {other} runner, where it runs"
    return ""


def runner_problem(runner: str) -> str | None:
    """Why the path cannot serve an engine on ``runner`` here (None: it can)."""
    if not block_tables.RUNNER_PROBLEMS:
        return None  # not instrumented: the path is off for a reason of its own, said elsewhere
    why = block_tables.RUNNER_PROBLEMS.get(runner, "not known to the add-on")
    if why is None:
        return None
    return f"it cannot read the block tables of vLLM's {runner} model runner ({why}){_runner_remedy(runner)}"


def runners_picked() -> list[str]:
    """Without an engine: the model runners vLLM may pick here (``VLLM_USE_V2_MODEL_RUNNER``, else every
    runner this vLLM has, as 0.25 and 0.33 pick by model; 0.34 has V2 only and 0.20 picks V1 unless told)."""
    from vllm import envs

    here = needs.runners_here()
    if needs.V1 not in here:
        return [needs.V2]  # 0.34: the variable no longer chooses
    chosen = getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None)
    return {True: [needs.V2], False: [needs.V1]}.get(chosen, here)


def runner_outlook() -> tuple[bool, str]:
    """Without an engine (``info``): whether engines here will be served by the runners vLLM may pick,
    and what to say: ``(True, "")``, ``(True, caveat)`` where it picks an unserved one for some models
    (0.25: V2 for some), ``(False, reason)`` where none is served."""
    picked = runners_picked()
    unserved = [why for why in map(runner_problem, picked) if why]
    if not unserved:
        return True, ""
    if len(unserved) < len(picked):
        return True, f"; not where vLLM picks another runner for a model: {'; '.join(unserved)}"
    return False, "; ".join(unserved)


def exclusions(vllm_config: Any) -> list[str]:
    """What in this engine's configuration the path does not serve yet (empty: nothing)."""
    reasons = []
    cache = getattr(vllm_config, "cache_config", None)
    cache_dtype = str(getattr(cache, "cache_dtype", "auto") or "auto")
    if cache_dtype not in ("auto", "bfloat16", "float16"):
        reasons.append(f"the KV cache is {cache_dtype} (an FP8 cache is not served yet)")
    parallel = getattr(vllm_config, "parallel_config", None)
    if (getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
        reasons.append("decode context parallelism is on (not served yet)")
    if (getattr(parallel, "prefill_context_parallel_size", 1) or 1) > 1:
        reasons.append("prefill context parallelism is on (not served yet)")
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "use_ubatching", False):
        reasons.append("dual-batch overlap (micro-batching) is on (not served yet)")
    runner = runner_problem(runner_of(vllm_config))
    if runner:
        reasons.append(runner)
    return reasons


def decide(vllm_config: Any) -> PathDecision:
    """The decision for an engine configuration (pure: no logging)."""
    additional = getattr(vllm_config, "additional_config", None)
    on, source = shared_prefix_setting(additional)
    if not on:
        return PathDecision(False, f"turned off by {source}")
    excluded = exclusions(vllm_config)
    if excluded:
        return PathDecision(False, "; ".join(excluded))
    return PathDecision(True, "shared cached prefixes of a step's prefill requests are worked once per layer")


def decide_hash_reuse(vllm_config: Any) -> PathDecision:
    """Whether the engine core reuses a shared prefix's block hashes (:mod:`.prefix_hashes`).

    The same setting as the path; for MLA models only (the add-on leaves other engines alone). The
    attention exclusions do not apply: the hashes are vLLM's own, bit for bit, whatever the runner.
    """
    if not getattr(getattr(vllm_config, "model_config", None), "use_mla", False):
        return PathDecision(False, "the model does not use MLA")  # before the switch: not ours to read
    on, source = shared_prefix_setting(getattr(vllm_config, "additional_config", None))
    if not on:
        return PathDecision(False, f"turned off by {source}")
    return PathDecision(True, "leading blocks equal to a recent request's take its hashes")


def decide_and_say(vllm_config: Any) -> PathDecision:
    """:func:`decide`, with one INFO line per process and decision."""
    decision = decide(vllm_config)
    log_once(
        logging.INFO,
        ("shared-prefix", decision),
        "MLA shared-prefix prefill (mla-prefill-ext): %s (%s).",
        "on" if decision.on else "off",
        decision.reason,
    )
    return decision
