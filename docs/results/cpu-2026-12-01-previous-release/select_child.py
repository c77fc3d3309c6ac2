"""Ask vLLM's own MLA prefill selector for a backend once vLLM has loaded its plugins."""

import vllm.plugins

vllm.plugins.load_general_plugins()  # first, as vLLM does in each process: the add-on activates here

from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backends.mla.prefill import selector  # noqa: E402

import mla_prefill_ext  # noqa: E402

try:
    cls = selector.get_mla_prefill_backend(VllmConfig(device_config=DeviceConfig(device="cpu")))
    print("RESULT", cls.get_name(), cls.__module__, "| add-on from", mla_prefill_ext.__file__)
except Exception as e:
    print("RESULT raised", type(e).__name__, str(e)[:300], "| add-on from", mla_prefill_ext.__file__)
