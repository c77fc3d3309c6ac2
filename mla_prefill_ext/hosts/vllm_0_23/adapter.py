"""The adapter: an add-on backend as a subclass of vLLM's own ``MLAPrefillBackend``.

One adapter class per backend name, made on demand (:func:`adapter_class`). Its
``__module__`` is :mod:`mla_prefill_ext.hosts.vllm_0_23.adapter_classes` and its ``__qualname__`` the
name, so that ``mla_prefill_ext.hosts.vllm_0_23.adapter_classes.NAME`` is its class path in vLLM's
registry and pickles by reference into every process (that module makes the class
on first access there too). The adapter holds an instance of the add-on class
(``inner``) and maps vLLM's calls onto the add-on's API:

* selection: ``supports_*``, ``is_available`` and ``validate_configuration`` are the
  add-on class's own; vLLM's selector config (``mla_dimensions`` from 0.25,
  ``is_r1_compatible`` before) becomes the add-on's ``MLAPrefillSelectorConfig``;
  ``requires_r1_mla_dimensions`` becomes ``supported_mla_dimensions`` on 0.25+.
* ``clone()`` (vLLM 0.25+'s metadata builder, once per builder): the builder life cycle
  of :mod:`mla_prefill_ext.hosts.core.builder_lifecycle`, as the patched 0.20 builder
  runs it: the kernel warm-up for the query dtype vLLM's builder hands over and the
  model's dtype, then a clone of the add-on instance whose workspace is reserved at
  once, both before vLLM sizes the KV cache.
* ``run_prefill_new_tokens(..., out=, output_scale=)``: ``out`` is filled from the
  add-on's result; a fused output quantization is never asked for
  (``supports_quant_output`` stays vLLM's default, False).
* context chunks: by index (0.23-0.27) straight through; as vLLM 0.29+'s chunk
  objects with a sliced ``q`` through one prepared view per chunk
  (:mod:`mla_prefill_ext.hosts.vllm_0_23.chunks`), which is what the add-on's
  ``context_chunks()`` gives a backend: chunk 0 of a step of those requests.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from mla_prefill_ext.backend_errors import note_backend_error
from mla_prefill_ext.hosts.core.builder_lifecycle import builder_query_dtype, builder_runner
from mla_prefill_ext.hosts.vllm_0_23 import chunks, layers
from mla_prefill_ext.hosts.vllm_0_23.shape import CHUNK_OBJECT, DIMS_LIST, Shape
from mla_prefill_ext.hosts.vllm_0_23.vllm_registry_sync import ADAPTERS_MODULE
from mla_prefill_ext.value_types import R1_MLA_DIMS


def addon_selector_config(vllm_selector_config: Any) -> Any:
    """vLLM's ``MLAPrefillSelectorConfig`` (either shape) as the add-on's."""
    from mla_prefill_ext.value_types import MLAPrefillSelectorConfig

    dims = getattr(vllm_selector_config, "mla_dimensions", None)
    if dims is not None:
        return MLAPrefillSelectorConfig.from_dims(
            vllm_selector_config.dtype, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
        )
    return MLAPrefillSelectorConfig(
        dtype=vllm_selector_config.dtype,
        is_r1_compatible=bool(getattr(vllm_selector_config, "is_r1_compatible", False)),
    )


def _device(vllm_config: Any) -> torch.device:
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    if isinstance(device, torch.device):
        return device
    return torch.device(device if isinstance(device, str) and device not in ("", "auto") else "cpu")


class _Adapter:
    """The methods every adapter class has; the class itself is made by :func:`make_adapter`."""

    _addon_class: type
    _addon_name: str
    _shape: Shape

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        vllm_config: Any,
    ) -> None:
        kwargs = dict(
            num_heads=num_heads,
            scale=scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            vllm_config=vllm_config,
        )
        super().__init__(**kwargs)  # vLLM's base: its attributes, as its own backends have them
        self._init_kwargs = kwargs  # what clone() builds vLLM's base of the twin with
        self._prefill_metadata = None
        inner = type(self)._addon_class(**kwargs)
        layers.hand_layer_reader(inner)
        self._set_inner(inner)

    def _set_inner(self, inner: Any) -> None:
        self.inner = inner
        self._views = chunks.ChunkViews(inner) if self._shape.chunk_api == CHUNK_OBJECT else None

    # Selection: the add-on class decides.
    @classmethod
    def supports_compute_capability(cls, device_capability: Any) -> bool:
        return cls._addon_class.supports_compute_capability(device_capability)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return cls._addon_class.supports_dtype(dtype)

    @classmethod
    def is_available(cls) -> bool:
        return cls._addon_class.is_available()

    @classmethod
    def validate_configuration(cls, device_capability: Any, selector_config: Any) -> list[str]:
        return cls._addon_class.validate_configuration(
            device_capability, addon_selector_config(selector_config)
        )

    def clone(self) -> Any:
        twin = object.__new__(type(self))
        self._shape.base.__init__(twin, **self._init_kwargs)
        twin._init_kwargs = self._init_kwargs
        # vLLM 0.25+ clones once per metadata builder, when the builder is created: the moment
        # the patched 0.20 builder warms the backend's kernels up and reserves its workspace.
        device = _device(self.vllm_config)
        dtype = getattr(getattr(self.vllm_config, "model_config", None), "dtype", None)
        if isinstance(dtype, torch.dtype):
            q_dtype = builder_query_dtype(self.vllm_config, dtype)
            inner = builder_runner(self.inner, device, q_dtype, dtype)
        else:  # no model dtype to warm up for (a configuration built by hand)
            inner = self.inner.clone()
            inner.reserve_workspace(device)
        twin._prefill_metadata = None
        twin._set_inner(inner)
        return twin

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        self._prefill_metadata = prefill_metadata
        chunks.attach_host_offsets(prefill_metadata)
        if self._views is not None:
            self._views.prepare(prefill_metadata)  # hides vLLM's chunk objects from the inner instance
        try:
            self.inner.prepare_metadata(prefill_metadata)
        except Exception as e:  # never caught: named, it stops the engine in vLLM's worker
            note_backend_error(e, self.inner, "prepare_metadata (the step)")
            raise

    def run_prefill_new_tokens(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_softmax_lse: bool,
        out: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
    ) -> Any:
        if output_scale is not None:
            raise RuntimeError(
                f"MLA prefill backend {self._addon_name} (mla-prefill-ext) was asked for a fused, "
                "quantized output, which it never offers (supports_quant_output is False)"
            )
        try:
            result = self.inner.run_prefill_new_tokens(q, k, v, return_softmax_lse)
        except Exception as e:
            note_backend_error(e, self.inner, "run_prefill_new_tokens", q=q, k=k, v=v)
            raise
        if out is not None:
            out.copy_(result[0] if isinstance(result, tuple) else result)
        return result

    def _run_chunk_by_index(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.inner.run_prefill_context_chunk(chunk_idx, q, k, v)
        except Exception as e:
            note_backend_error(
                e, self.inner, f"run_prefill_context_chunk, context chunk {chunk_idx}", q=q, k=k, v=v
            )
            raise

    def _run_chunk_object(
        self, chunk: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._views is not None
        output, lse = self._views.run(chunk, q, k, v)
        if out is not None:
            out.copy_(output)
            output = out
        return output, lse

    def __repr__(self) -> str:
        return f"{self._addon_name}(bridged {self.inner!r})"


_LOCK = threading.Lock()
_CACHE: dict[tuple[str, type, int], type] = {}


def make_adapter(name: str, addon_class: type, shape: Shape) -> type:
    """The adapter class for ``addon_class`` under ``name``, a subclass of vLLM's base."""
    namespace: dict[str, Any] = {
        "__module__": ADAPTERS_MODULE,
        "__qualname__": name,
        "__doc__": f"mla-prefill-ext backend {name} ({addon_class.__module__}.{addon_class.__qualname__}) "
        "as a vLLM MLA prefill backend.",
        "_addon_class": addon_class,
        "_addon_name": name,
        "_shape": shape,
        "get_name": staticmethod(lambda: name),
        "supported_dtypes": list(addon_class.supported_dtypes),
        "run_prefill_context_chunk": (
            _Adapter._run_chunk_object if shape.chunk_api == CHUNK_OBJECT else _Adapter._run_chunk_by_index
        ),
    }
    requires_r1 = bool(getattr(addon_class, "requires_r1_mla_dimensions", False))
    if shape.dims_api == DIMS_LIST:
        assert shape.mla_dimensions is not None
        nope, rope, v = R1_MLA_DIMS
        namespace["supported_mla_dimensions"] = (
            [shape.mla_dimensions(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)]
            if requires_r1
            else []
        )
    else:
        namespace["requires_r1_mla_dimensions"] = requires_r1
    return type(name, (_Adapter, shape.base), namespace)


def adapter_class(name: str, shape: Shape) -> type:
    """The adapter for the add-on backend registered as ``name`` now (made once per class)."""
    from mla_prefill_ext.registry import lookup

    member = lookup(name)
    addon_class = member.get_class()  # ImportError / TypeError / ValueError name the backend
    key = (member.name, addon_class, id(shape.base))
    with _LOCK:
        cls = _CACHE.get(key)
        if cls is None:
            cls = _CACHE[key] = make_adapter(member.name, addon_class, shape)
        return cls


def is_adapter(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, _Adapter)
