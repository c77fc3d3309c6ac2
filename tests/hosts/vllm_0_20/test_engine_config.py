"""The engine-config patch set: the settings stamped where the engine configuration is created."""

from __future__ import annotations

import pickle
from typing import Any
from unittest import mock

import pytest
import wrapt

from mla_prefill_ext import activation, settings
from mla_prefill_ext.hosts.vllm_0_20 import ARG_UTILS_MODULE, PATCH_SETS, engine_config, instrumentor_for
from mla_prefill_ext.hosts.vllm_0_20.hooks import layer
from mla_prefill_ext.testing import vllm_host as host

pytestmark = pytest.mark.vllm_patch  # the engine-config patch set of vLLM 0.20 (skipped where it bridges)


@pytest.fixture
def arg_utils() -> Any:
    """vLLM's arg_utils module, patched; the patch is in place again whatever the test did."""
    import vllm.engine.arg_utils as module

    activation.activate()
    yield module
    activation.activate()
    assert engine_config.is_instrumented()


def create_engine_config(model_dir: Any, additional: dict) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    args = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, max_model_len=2048, additional_config=additional
    )
    # The unspecified platform has no device type either: one more device fact to supply.
    with host.gpu_view((9, 0)), mock.patch.object(type(current_platform), "device_type", "cpu"):
        return args.create_engine_config()


def test_listed_once_as_a_patch_set():
    assert PATCH_SETS[ARG_UTILS_MODULE] == engine_config.__name__
    assert instrumentor_for(ARG_UTILS_MODULE) is engine_config.INSTRUMENTOR


def test_engine_config_carries_the_settings_to_every_process(arg_utils, clean_selection, model_dirs):
    assert engine_config.is_instrumented()
    # Nothing set: no stamp, so the configuration (and vLLM's compile-cache key) is stock's.
    assert settings.STAMP_KEY not in create_engine_config(model_dirs["plain"], {}).additional_config
    clean_selection.setenv(settings.BACKEND_ENV, "flashinfer")
    user_additional = {"other": 1}
    cfg = create_engine_config(model_dirs["plain"], user_additional)
    assert user_additional == {"other": 1}  # the user's own dict is left as given
    stamp = cfg.additional_config[settings.STAMP_KEY]
    assert stamp[settings.BACKEND_ENV] == "FLASHINFER" and stamp[settings.DISABLE_ENV] is False
    shipped = pickle.loads(pickle.dumps(cfg))  # as vLLM ships it to engine cores and workers
    layer.refuse_if_settings_differ(shipped)  # same settings here: fine
    # A worker on a node started without the variable:
    clean_selection.delenv(settings.BACKEND_ENV)
    with pytest.raises(RuntimeError) as e:
        layer.refuse_if_settings_differ(shipped)
    message = str(e.value)
    assert "MLA_PREFILL_BACKEND='AUTO'" in message  # what it has
    assert "Set MLA_PREFILL_BACKEND='FLASHINFER'" in message  # what to set there
    assert "host " in message and "pid " in message


def test_uninstrument_restores_vllms_own_and_both_are_idempotent(arg_utils):
    wrapped = arg_utils.EngineArgs.__dict__["create_engine_config"]
    assert isinstance(wrapped, wrapt.FunctionWrapper)
    original = wrapped.__wrapped__
    assert engine_config.instrument(arg_utils)  # again: nothing more
    assert arg_utils.EngineArgs.__dict__["create_engine_config"] is wrapped
    activation.deactivate()
    assert arg_utils.EngineArgs.__dict__["create_engine_config"] is original
    assert not engine_config.is_instrumented()
    engine_config.uninstrument(arg_utils)  # again: nothing to remove
    assert arg_utils.EngineArgs.__dict__["create_engine_config"] is original


def test_unsupported_vllm_gets_no_stamp(arg_utils, monkeypatch):
    from mla_prefill_ext import versions

    activation.deactivate()
    monkeypatch.setattr(versions, "installed_vllm_version", lambda: "0.21.0")
    try:
        assert not engine_config.instrument(arg_utils)
        assert "vLLM 0.21.0 is not supported" in engine_config.INSTRUMENTOR.state().skipped_reason
        assert not isinstance(arg_utils.EngineArgs.__dict__["create_engine_config"], wrapt.FunctionWrapper)
    finally:
        monkeypatch.undo()
        engine_config.uninstrument(arg_utils)
