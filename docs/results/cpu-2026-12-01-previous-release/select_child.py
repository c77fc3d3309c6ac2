import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm.config import DeviceConfig, VllmConfig
from vllm.v1.attention.backends.mla.prefill import selector
import mla_prefill_ext
try:
    cls = selector.get_mla_prefill_backend(VllmConfig(device_config=DeviceConfig(device="cpu")))
    print("RESULT", cls.get_name(), cls.__module__, "| add-on from", mla_prefill_ext.__file__)
except Exception as e:
    print("RESULT raised", type(e).__name__, str(e)[:300], "| add-on from", mla_prefill_ext.__file__)
