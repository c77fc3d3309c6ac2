"""Selection through vLLM's own selector (0.23+): the wrappers of its two functions.

``get_mla_prefill_backend(vllm_config)`` (what every MLA layer calls):

* The add-on's choice (``additional_config["mla_prefill_backend"]``, else
  ``MLA_PREFILL_BACKEND``) is served by the add-on's selector, with its reasons and
  messages, whatever the device (vLLM ignores an explicit choice where no device
  capability is known, 0.23-0.31, and on a CPU platform, 0.29+; the add-on does not).
  It wins over ``attention_config.mla_prefill_backend``; when both are set and differ,
  one INFO line says so.
* ``attention_config.mla_prefill_backend`` naming one of the add-on's backends (a
  name it registered in vLLM's registry) is served the same way.
* Any other ``attention_config`` choice, and no choice at all, is vLLM's: the call
  goes to vLLM's selector untouched.

``_auto_select_mla_prefill_backend`` (vLLM's automatic selection; on 0.33 it asks
the platform): out-of-tree backends that claim the device (``auto_select_claim``)
are tried first when vLLM's own pick is the backend they claim to go before, or
when vLLM finds none; then vLLM's pick; then the add-on's portable ``TORCH_SDPA``
when vLLM finds none. vLLM's order is inside its selector (0.23-0.31) or the
platform (0.33) and is not read: a claim placed before a backend vLLM skipped as
invalid here does not move ahead of vLLM's later pick.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from mla_prefill_ext._logging import first_time, log_once, logger
from mla_prefill_ext.hosts.core import refusal
from mla_prefill_ext.hosts.vllm_0_23 import vllm_registry_sync
from mla_prefill_ext.hosts.vllm_0_23.shape import Shape
from mla_prefill_ext.versions import installed_vllm_version

# The adapter module (torch, the backends' base) loads at the first selection, not at start.

NATIVE_SOURCE = "attention_config.mla_prefill_backend"


def config_arg(args: tuple, kwargs: dict) -> Any:
    """The engine configuration in a call of ``get_mla_prefill_backend`` (by keyword or first)."""
    return kwargs["vllm_config"] if "vllm_config" in kwargs else (args[0] if args else None)


def addon_choice(vllm_config: Any) -> Any:
    """The add-on's explicit choice for this configuration (None: automatic or unset)."""
    from mla_prefill_ext import selector, settings

    additional_config = getattr(vllm_config, "additional_config", None)
    selector.log_overridden_environment(additional_config)
    return settings.explicit_choice(additional_config)


def native_choice(vllm_config: Any) -> Any:
    """The member of vLLM's enum chosen in ``attention_config`` (None: unset)."""
    return getattr(getattr(vllm_config, "attention_config", None), "mla_prefill_backend", None)


@lru_cache(maxsize=64)
def _select(shape: Shape, capability: Any, config: Any, choice: Any, generation: int) -> type:
    from mla_prefill_ext import selector
    from mla_prefill_ext.hosts.vllm_0_23.adapter import adapter_class

    try:
        selection = selector.select(capability, config, choice)
    except ValueError as e:
        raise ValueError(f"mla-prefill-ext (vLLM {installed_vllm_version()}, bridged): {e}") from None
    logger.info(
        "Using %s MLA prefill backend (mla-prefill-ext, from %s; %s), through vLLM %s's own selector.",
        selection.name,
        choice.source,
        selector.describe(capability, config),
        installed_vllm_version(),
    )
    return adapter_class(selection.name, shape)


def _log_precedence(choice: Any, native: Any) -> None:
    if native is None or native.name.upper() == choice.name.upper():
        return
    log_once(
        logging.INFO,
        ("precedence", choice.name, choice.source, native.name),
        "MLA prefill backend: %s=%s takes precedence over %s=%s (the add-on's choice wins; unset "
        "one of them to silence this).",
        choice.source,
        choice.name,
        NATIVE_SOURCE,
        native.name,
    )


def make_get_wrapper(shape: Shape) -> Any:
    """The wrapper of vLLM's ``get_mla_prefill_backend``."""

    def get_mla_prefill_backend(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        # Loaded at the first selection (an MLA layer being built), not at every process start.
        from mla_prefill_ext import registry, selector, settings

        vllm_config = config_arg(args, kwargs)
        try:
            # An invalid overrides variable stops every selection, vLLM's own named one too: the
            # user meant it to change what runs, so running anyway would be a silent fallback.
            problem = settings.overrides_problem()
            if problem is not None:
                raise ValueError(problem)
            vllm_registry_sync.sync(shape)
            choice = addon_choice(vllm_config)
            native = native_choice(vllm_config)
            if choice is not None:
                _log_precedence(choice, native)
            elif native is not None and vllm_registry_sync.is_ours(native):
                choice = settings.Choice(native.name, NATIVE_SOURCE, True)
            if choice is not None:
                return _select(
                    shape,
                    selector.current_device_capability(),
                    selector.selector_config_for(vllm_config),
                    choice,
                    registry.generation(),
                )
        except (ValueError, TypeError) as e:
            # The add-on's refusal, not vLLM's: vLLM 0.33 would swallow a ValueError on sparse layers.
            raise refusal.ChoiceRefusedError(str(e)) from e
        return wrapped(*args, **kwargs)  # vLLM's own selection, its own errors

    return get_mla_prefill_backend


@lru_cache(maxsize=64)
def _claimed(shape: Shape, capability: Any, config: Any, native_name: str | None, generation: int) -> Any:
    """The first claimed backend that goes before vLLM's pick and can serve (None: none)."""
    from mla_prefill_ext import selector
    from mla_prefill_ext.hosts.vllm_0_23.adapter import adapter_class

    for member, claim in selector.claims(capability):
        if native_name is not None and claim.before != native_name:
            continue
        cls, reasons = selector.check_backend(member, capability, config)
        if cls is not None and not reasons:
            logger.info(
                "%s joined automatic selection by its claim (%s; before %s): using it for MLA prefill "
                "(mla-prefill-ext, vLLM %s).",
                member.name,
                ", ".join(claim.capabilities),
                claim.before,
                installed_vllm_version(),
            )
            return adapter_class(member.name, shape)
    return None


def make_auto_wrapper(shape: Shape) -> Any:
    """The wrapper of vLLM's ``_auto_select_mla_prefill_backend``."""

    def auto_select(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        from mla_prefill_ext import registry, selector
        from mla_prefill_ext.hosts.vllm_0_23.adapter import adapter_class, addon_selector_config

        vllm_config_selector = kwargs.get("selector_config", args[-1] if args else None)
        if shape.auto_takes_capability:
            capability = kwargs.get("device_capability", args[0] if len(args) > 1 else None)
        else:
            capability = selector.current_device_capability()
        config = addon_selector_config(vllm_config_selector)
        vllm_registry_sync.sync(shape)
        generation = registry.generation()
        try:
            native = wrapped(*args, **kwargs)
        except ValueError as e:
            native, failure = None, e
        else:
            failure = None
        claimed = _claimed(
            shape, capability, config, None if native is None else native.get_name(), generation
        )
        if claimed is not None:
            return claimed
        if native is not None:
            return native
        cls, reasons = selector.check_backend(registry.MLAPrefillBackendEnum.TORCH_SDPA, capability, config)
        if cls is None or reasons:
            raise ValueError(
                f"{failure} mla-prefill-ext's portable TORCH_SDPA cannot serve either: {'; '.join(reasons)}"
            ) from None
        if first_time(("fallback", capability, config)):
            logger.warning(
                "vLLM %s found no MLA prefill backend for this configuration (%s); mla-prefill-ext's "
                "portable TORCH_SDPA serves it (the slow path). vLLM's reasons: %s",
                installed_vllm_version(),
                selector.describe(capability, config),
                failure,
            )
        return adapter_class("TORCH_SDPA", shape)

    return auto_select


def clear_caches() -> None:
    _select.cache_clear()
    _claimed.cache_clear()
