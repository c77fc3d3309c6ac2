"""What the bridge found and did in this process, for ``mla-prefill-ext info``."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mla_prefill_ext.hosts.core.report import HostReport


def _native_pick(shape: Any) -> tuple[str | None, str | None]:
    """What vLLM's own selector (bridged) picks here for a bfloat16 model with R1 dims, or why none."""
    import torch

    from mla_prefill_ext.selector import current_device_capability
    from mla_prefill_ext.value_types import R1_MLA_DIMS

    config_cls = shape.selector.MLAPrefillSelectorConfig
    if shape.mla_dimensions is not None:
        nope, rope, v = R1_MLA_DIMS
        dims = shape.mla_dimensions(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
        config = config_cls(dtype=torch.bfloat16, mla_dimensions=dims)
    else:
        config = config_cls(dtype=torch.bfloat16, is_r1_compatible=True)
    auto = shape.selector._auto_select_mla_prefill_backend
    try:
        if shape.auto_takes_capability:
            capability = current_device_capability()
            if capability is None:
                return None, "vLLM selects FLASH_ATTN unchecked where no device capability is known"
            cls = auto(capability, config)
        else:
            cls = auto(config)
    except Exception as e:  # vLLM's own selection failing is a finding, not a crash of info
        return None, f"{type(e).__name__}: {e}"
    return cls.get_name(), None


def explain_no_pick(error: str, capability: Any) -> str | None:
    """What vLLM's own automatic selection failing with ``error`` means here, in words (None: it says)."""
    if not error.startswith(("ImportError", "ModuleNotFoundError")):
        return None
    why = (
        "expected on a machine without a GPU: vLLM's GPU kernels (e.g. its FlashAttention build) are "
        "absent here, and on a GPU vLLM picks normally"
        if capability is None
        else "vLLM's installation lacks what its pick needs (reinstall vLLM)"
    )
    return (
        f"vLLM's own automatic selection picks a backend whose module does not import on this machine; "
        f"{why}. An explicit choice (e.g. MLA_PREFILL_BACKEND=TORCH_SDPA) does not use it, and "
        "`check` and `select` do not need it"
    )


def host_report(mla_module: ModuleType | None = None) -> HostReport:
    """The bridge's state, vLLM's registry as it stands, and vLLM's automatic pick here."""
    from mla_prefill_ext.hosts.vllm_0_23 import bridge, vllm_registry_sync

    state = bridge.state()
    shape = state.shape
    info: dict[str, Any] = {
        "instrumented": state.instrumented,
        "problem": state.problem,
        "shape": None,
        "registry": [],
        "automatic_pick": None,
        "automatic_error": None,
    }
    problems: list[str] = []
    if state.problem is not None:
        problems.append(f"The add-on does not bridge this vLLM: {state.problem}.")
    if shape is None:
        return HostReport(False, None, [], info, ["bridge: not in place (see the findings)"], problems)
    info["shape"] = {
        "context_chunks": "chunk objects (0.29+)" if shape.chunk_api == "object" else "by index (0.23-0.27)",
        "mla_dims": "supported_mla_dimensions"
        if shape.dims_api == "dimensions"
        else "requires_r1_mla_dimensions",
        "new_names": "registered as strings" if shape.string_names else "CUSTOM only",
        "clone_per_builder": shape.has_clone,
    }
    lines = [
        "bridge: in place: vLLM's get_mla_prefill_backend and _auto_select_mla_prefill_backend are wrapped",
        "  vLLM's API here: "
        + "; ".join(
            f"{k.replace('_', ' ')}: {v}" for k, v in info["shape"].items() if k != "clone_per_builder"
        ),
        "vLLM's MLA prefill registry (attention_config.mla_prefill_backend selects among these):",
    ]
    ours = set()
    for name, member in shape.enum.__members__.items():
        try:
            path = member.get_path()
        except ValueError:
            path = None
        mine = vllm_registry_sync.is_ours(member)
        if mine:
            ours.add(name)
        info["registry"].append({"name": name, "class_path": path, "addon": mine})
        where = "the add-on's" if mine else ("vLLM's own" if path else "not registered")
        lines.append(f"  {name}: {where}" + (f" ({path})" if path and not mine else ""))
    pick, error = _native_pick(shape)
    info["automatic_pick"], info["automatic_error"] = pick, error
    if pick is not None:
        lines.append(f"  vLLM's automatic pick here, for a bfloat16 model with DeepSeek-R1 dims: {pick}")
    else:
        from mla_prefill_ext.selector import current_device_capability

        lines.append(f"  vLLM's automatic pick here: none ({error})")
        meaning = explain_no_pick(error or "", current_device_capability())
        info["automatic_error_meaning"] = meaning
        if meaning is not None:
            lines.append(f"    that is: {meaning}")
    return HostReport(bool(state.instrumented), None, [], info, lines, problems)
