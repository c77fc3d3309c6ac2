"""Chooses the MLA prefill backend for a vLLM configuration on this device.

Precedence, the first that is set wins:

1. ``vllm_config.additional_config["mla_prefill_backend"]``
2. the environment variable ``MLA_PREFILL_BACKEND`` (a member name, any case)
3. the host's legacy choice, handed in as data (vLLM 0.20's ``attention_config``
   flags, read by ``hosts.vllm_0_20.legacy_flags``: the selector knows no vLLM version)
4. automatic, by compute capability (see :func:`mla_prefill_backend_priorities`).

An explicit choice (1 or 2) that cannot serve raises ``ValueError`` with its
reasons; there is no silent fallback. A legacy choice that cannot serve warns and
falls back to automatic selection, as vLLM 0.20 itself silently did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from mla_prefill_ext import registry, settings
from mla_prefill_ext._logging import log_once, logger
from mla_prefill_ext.backends.base import AutoSelectClaim
from mla_prefill_ext.registry import MLAPrefillBackendEnum, lookup, registered_backends
from mla_prefill_ext.settings import AUTO, BACKEND_ENV, Choice, user_setting

# MLAPrefillSelectorConfig and Choice stay importable from here too (the API names them so).
from mla_prefill_ext.value_types import AUTOMATIC, R1_MLA_DIMS, MLAPrefillSelectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.backends.base import MLAPrefillBackend


@dataclass
class Selection:
    """The outcome of a selection, how it was chosen, and why every other candidate was passed over.

    ``source`` is the setting that chose ``name`` (``MLA_PREFILL_BACKEND``,
    ``additional_config[...]``, a legacy flag) or :data:`AUTOMATIC`.
    """

    backend: type[MLAPrefillBackend]
    name: str
    source: str
    capability: DeviceCapability | None
    config: MLAPrefillSelectorConfig
    rejected: dict[str, list[str]] = field(default_factory=dict)

    @property
    def is_automatic(self) -> bool:
        return self.source is AUTOMATIC


def is_deepseek_r1_mla_compatible(vllm_config: VllmConfig) -> bool:
    """Whether the model has DeepSeek-R1 MLA dims (qk_nope 128, qk_rope 64, v 128)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return False
    hf = model_config.hf_text_config
    dims = tuple(getattr(hf, a, None) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    return dims == R1_MLA_DIMS


def selector_config_for(vllm_config: VllmConfig) -> MLAPrefillSelectorConfig:
    model_config = getattr(vllm_config, "model_config", None)
    dtype = model_config.dtype if model_config is not None else torch.get_default_dtype()
    return MLAPrefillSelectorConfig(dtype=dtype, is_r1_compatible=is_deepseek_r1_mla_compatible(vllm_config))


def builtin_priorities(capability: DeviceCapability | None) -> list[MLAPrefillBackendEnum]:
    """The built-in automatic selection order for a device (first valid wins)."""
    E = MLAPrefillBackendEnum
    if capability is None:  # CPU or a platform that reports no capability
        order = []
    elif capability.major == 10:
        order = [E.FLASH_ATTN, E.TRTLLM_RAGGED, E.FLASHINFER]
    elif capability.major == 9:
        order = [E.FLASH_ATTN, E.FLASHINFER]
    else:
        order = [E.FLASH_ATTN]
    # The portable backend closes every list: slow on a GPU, but it always runs.
    return [*order, E.TORCH_SDPA]


def claims(capability: DeviceCapability | None) -> list[tuple[MLAPrefillBackendEnum, AutoSelectClaim]]:
    """Registered out-of-tree backends that claim a place in automatic selection on this device.

    Backends registered by call (``CUSTOM`` or a new name) or installed through the
    entry-point group; a class that does not load is left out, with a warning. In the
    order of their names, so that claims at the same place are tried in that order in
    every process, whenever each backend was registered or discovered.
    """
    refuse_invalid_overrides()
    registry.discover_installed()
    found = []
    for member, path in sorted(registered_backends(), key=lambda entry: entry[0].name):
        if member.value is not None or not path:  # built-ins keep their own place
            continue
        try:
            cls = member.get_class()
            claim = AutoSelectClaim.of(getattr(cls, "auto_select_claim", None))
        except (ImportError, TypeError, ValueError) as e:
            log_once(
                logging.WARNING,
                ("unloadable", member.name, str(e)),
                "MLA prefill backend %s is left out of automatic selection: %s",
                member.name,
                str(e),
            )
            continue
        if claim is not None and claim.matches(capability):
            found.append((member, claim))
    return found


def refuse_invalid_overrides() -> None:
    """Raise ValueError when MLA_PREFILL_BACKEND_OVERRIDES cannot be applied (it would be ignored)."""
    problem = settings.overrides_problem()
    if problem is not None:
        raise ValueError(problem)


def mla_prefill_backend_priorities(
    capability: DeviceCapability | None,
) -> list[MLAPrefillBackendEnum]:
    """Automatic selection order for a device (first valid wins), claims included."""
    order = builtin_priorities(capability)
    for member, claim in claims(capability):
        names = [m.name for m in order]
        at = names.index(claim.before) if claim.before in names else names.index("TORCH_SDPA")
        order.insert(at, member)
    return order


def requested_choice(vllm_config: VllmConfig | None, legacy: Choice | None = None) -> Choice | None:
    """The user's choice in force, by precedence; None means automatic.

    ``legacy`` is what the host read from its vLLM's own prefill flags (vLLM 0.20's:
    ``hosts.vllm_0_20.legacy_flags``); it counts only when the user set nothing.
    """
    additional_config = getattr(vllm_config, "additional_config", None)
    is_set, choice = user_setting(additional_config)
    log_overridden_environment(additional_config)
    return choice if is_set else legacy


def log_overridden_environment(additional_config: Any) -> None:
    """One INFO line when additional_config's choice overrides a different MLA_PREFILL_BACKEND."""
    ignored = settings.overridden_environment_choice(additional_config)
    if ignored is None:
        return
    chosen = str(additional_config[settings.ADDITIONAL_CONFIG_KEY])
    log_once(
        logging.INFO,
        ("overridden environment", chosen, ignored),
        "MLA prefill backend: additional_config['%s']=%r takes precedence over %s=%r, which is "
        "ignored (unset one of them to silence this).",
        settings.ADDITIONAL_CONFIG_KEY,
        chosen,
        BACKEND_ENV,
        ignored,
    )


def describe(capability: DeviceCapability | None, config: MLAPrefillSelectorConfig) -> str:
    """The facts a selection depends on, in words (for the messages of both hosts)."""
    cap = "no GPU" if capability is None else f"compute capability {capability.major}.{capability.minor}"
    dtype = str(config.dtype).removeprefix("torch.")
    return f"{cap}, dtype {dtype}, DeepSeek-R1 MLA dims: {'yes' if config.is_r1_compatible else 'no'}"


def check_backend(
    member: MLAPrefillBackendEnum,
    capability: DeviceCapability | None,
    config: MLAPrefillSelectorConfig,
) -> tuple[type[MLAPrefillBackend] | None, list[str]]:
    """Load a member's class and validate it: (class or None, reasons it cannot serve)."""
    try:
        cls = member.get_class()
    except (ImportError, TypeError, ValueError) as e:
        return None, [str(e)]
    return cls, cls.validate_configuration(capability, config)


def select(
    capability: DeviceCapability | None,
    config: MLAPrefillSelectorConfig,
    choice: Choice | None = None,
) -> Selection:
    """Choose a backend (uncached). Raises ValueError when nothing can serve."""
    refuse_invalid_overrides()
    if choice is not None:
        try:
            member = lookup(choice.name)  # any case; ValueError lists the valid names
        except ValueError as e:
            raise ValueError(f"{e}. The name comes from {choice.source}: correct it there") from None
        cls, reasons = check_backend(member, capability, config)
        if not reasons and cls is not None:
            return Selection(cls, member.name, choice.source, capability, config)
        if cls is None:  # its class did not load: say so, not that the device cannot serve it
            detail = "; ".join(reasons).removeprefix(f"MLA prefill backend {member.name}").lstrip(": ")
            message = f"MLA prefill backend {member.name} (from {choice.source}) cannot be loaded: {detail}"
        else:
            message = (
                f"MLA prefill backend {member.name} (from {choice.source}) cannot serve "
                f"this configuration ({describe(capability, config)}): {'; '.join(reasons)}"
            )
        if choice.explicit:
            # A registration that does not load is fixed where it was made (the message says where).
            instead = "Or choose" if cls is None and member.where_to_fix() is not None else "Choose"
            raise ValueError(f"{message.rstrip('.')}. {instead} another backend or unset {choice.source}.")
        logger.warning("%s. Falling back to automatic selection.", message)
        auto = select(capability, config)
        auto.rejected = {member.name: reasons, **auto.rejected}
        return auto

    rejected: dict[str, list[str]] = {}
    for member in mla_prefill_backend_priorities(capability):
        cls, reasons = check_backend(member, capability, config)
        if not reasons and cls is not None:
            return Selection(cls, member.name, AUTOMATIC, capability, config, rejected)
        rejected[member.name] = reasons
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items())
    raise ValueError(
        f"No MLA prefill backend can serve this configuration ({describe(capability, config)}). "
        f"Reasons: {detail}"
    )


@cache
def _select_cached(
    capability: DeviceCapability | None,
    config: MLAPrefillSelectorConfig,
    choice: Choice | None,
    registry_generation: int = 0,
) -> Selection:
    selection = select(capability, config, choice)
    where = "auto-selected" if selection.is_automatic else f"from {selection.source}"
    logger.info(
        "Using %s MLA prefill backend (%s; %s).",
        selection.name,
        where,
        describe(capability, config),
    )
    if selection.is_automatic and MLAPrefillBackendEnum[selection.name].value is None:
        claim = AutoSelectClaim.of(getattr(selection.backend, "auto_select_claim", None))
        logger.info(
            "%s joined automatic selection by its claim (%s; before %s).",
            selection.name,
            ", ".join(claim.capabilities) if claim else "?",
            claim.before if claim else "?",
        )
    if selection.is_automatic and selection.name == "TORCH_SDPA" and capability is not None:
        logger.warning(
            "TORCH_SDPA was chosen automatically on a GPU: it is the portable, slow MLA "
            "prefill path. Faster backends were passed over: %s",
            "; ".join(f"{n}: {', '.join(r)}" for n, r in selection.rejected.items()),
        )
    return selection


def current_device_capability() -> DeviceCapability | None:
    """The device capability vLLM reports now (None on CPU or an unknown platform)."""
    from vllm import platforms

    try:
        return platforms.current_platform.get_device_capability()
    except Exception:  # a platform without device facts
        return None


def selection_for(vllm_config: VllmConfig, legacy: Choice | None = None) -> Selection:
    """The cached :class:`Selection` for this configuration on this device.

    ``legacy``: the choice the host read from its vLLM's legacy flags (see :func:`requested_choice`).
    """
    registry.discover_installed()  # installed packages are registrations too: before the cache key
    return _select_cached(
        current_device_capability(),
        selector_config_for(vllm_config),
        requested_choice(vllm_config, legacy),
        registry.generation(),
    )


def get_mla_prefill_backend(vllm_config: VllmConfig) -> type[MLAPrefillBackend]:
    """The MLA prefill backend class for this configuration on this device.

    By the user's settings; vLLM 0.20's legacy flags count where the patch selects
    (``hosts.vllm_0_20.legacy_flags.backend_for``).
    """
    return selection_for(vllm_config).backend


def clear_cache() -> None:
    """Forget cached selections (tests; registrations invalidate them by themselves)."""
    _select_cached.cache_clear()


def describe_requested(vllm_config: VllmConfig | None, legacy: Choice | None = None) -> dict[str, Any]:
    """What the configuration in force asks for (for diagnostics)."""
    choice = requested_choice(vllm_config, legacy)
    requested = AUTO
    if choice is not None:
        try:
            requested = lookup(choice.name).name  # the member's own spelling
        except ValueError:
            requested = choice.name  # unknown: show it as given
    return {
        "requested": requested,
        "source": choice.source if choice else AUTOMATIC,
        BACKEND_ENV: settings.environment()[BACKEND_ENV],
    }
