"""The engine-config patch set: stamp the user's settings into the engine configuration where it is created.

vLLM ships its ``VllmConfig`` to every engine process and worker, on every node.
The process that creates it (``EngineArgs.create_engine_config``: the user's
process, ``vllm serve``'s front end) records its add-on settings, when any is set,
under ``additional_config["mla_prefill_ext"]`` (``settings.stamped``), as vLLM itself
records other keys there. A process that builds MLA layers compares its own settings
with the stamp (``hooks.layer.refuse_if_settings_differ``) and refuses at start when
they differ: the settings did not reach it, and running would silently ignore the
user's choice.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mla_prefill_ext.hosts.core.instrumentor import Instrumentor

TARGET = "EngineArgs.create_engine_config"


def stamp_settings(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    config = wrapped(*args, **kwargs)
    from mla_prefill_ext import settings

    additional = settings.stamped(getattr(config, "additional_config", None))
    if additional is not None:
        config.additional_config = additional
    return config


class EngineConfigInstrumentor(Instrumentor):
    """Wraps ``EngineArgs.create_engine_config``; where it cannot, vLLM runs without the stamp."""

    def check(self, module: ModuleType) -> str | None:
        from mla_prefill_ext import versions

        self._state.vllm_version = versions.installed_vllm_version()
        return versions.unsupported_reason(versions.PATCH, self._state.vllm_version)

    def wrappers(self, module: ModuleType) -> list[tuple[str, Any]]:
        return [(TARGET, stamp_settings)]


INSTRUMENTOR = EngineConfigInstrumentor()
instrument = INSTRUMENTOR.instrument
uninstrument = INSTRUMENTOR.uninstrument
is_instrumented = INSTRUMENTOR.is_instrumented
