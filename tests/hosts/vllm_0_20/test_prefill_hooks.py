"""The impl's two prefill hooks: which instance each call runs, with the per-step lookup kept.

The hooks keep the instance a step's first call found with that step's metadata object (shared
by the layers of one ``step_key``); these tests pin that every call still runs the instance its
own step's builder prepared, and that the fallbacks are as before.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from mla_prefill_ext.hosts.vllm_0_20.hooks.dispatch import bind_impl_to_backend
from mla_prefill_ext.testing import vllm_host as host

pytestmark = pytest.mark.vllm_patch  # the patch of vLLM 0.20 (skipped where the add-on bridges)

HEADS, QK, V = 4, 192, 128


def build_layer(cfg: Any, prefix: str) -> Any:
    with host.gpu_view(None):
        return host.mla_layer(host.build_deepseek_attention(cfg, prefix=prefix))


def make_builder(cfg: Any, layers: list[Any]) -> Any:
    from vllm.config import set_current_vllm_config

    builder_cls = layers[0].attn_backend.get_builder_cls()
    with host.gpu_view(None), set_current_vllm_config(cfg):
        return builder_cls(
            layers[0].get_kv_cache_spec(cfg), [layer.layer_name for layer in layers], cfg, torch.device("cpu")
        )


def build_step(cfg: Any, builder: Any, new_lens: list[int]) -> Any:
    from vllm.config import set_current_vllm_config

    with host.gpu_view(None), set_current_vllm_config(cfg):
        return builder.build(0, host.prefill_batch(new_lens)).prefill


class Ran:
    """Which instance each kernel call ran on (spied on the class: every instance is seen)."""

    def __init__(self, cls: type) -> None:
        self.instances: list[Any] = []
        self._patches = [
            mock.patch.object(cls, "run_prefill_new_tokens", self._spy("run_prefill_new_tokens", cls)),
            mock.patch.object(cls, "run_prefill_context_chunk", self._spy("run_prefill_context_chunk", cls)),
        ]

    def _spy(self, name: str, cls: type) -> Any:
        original = getattr(cls, name)

        def spy(instance: Any, *args: Any, **kwargs: Any) -> Any:
            self.instances.append(instance)
            return original(instance, *args, **kwargs)

        return spy

    def __enter__(self) -> Ran:
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in reversed(self._patches):
            p.stop()


def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    q, k = (torch.randn(tokens, HEADS, QK, generator=gen) for _ in range(2))
    return q, k, torch.randn(tokens, HEADS, V, generator=gen)


def test_every_call_runs_its_own_steps_instance(shim, clean_selection, model_dirs):
    """Two builders (dual-batch overlap) and three steps, interleaved: each call, its step's instance."""
    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build_layer(cfg, f"model.layers.{i}.self_attn") for i in range(3)]
    builders = [make_builder(cfg, layers), make_builder(cfg, layers)]
    (r0,), (r1,) = (list(b._mla_prefill_runners.values()) for b in builders)
    steps = [(build_step(cfg, builders[0], [5, 3]), r0, 8), (build_step(cfg, builders[1], [7]), r1, 7)]
    # A later step of the first builder: a new metadata object, the same instance re-prepared.
    steps.append((build_step(cfg, builders[0], [2, 2]), r0, 4))
    order = [0, 1, 0, 2, 1, 2, 2, 0]
    with Ran(type(r0)) as ran, mock.patch.object(type(r0), "prepare_metadata") as prepare:
        expected = []
        for s in order:
            prefill, instance, tokens = steps[s]
            q, k, v = inputs(tokens)
            for layer in layers:
                layer.impl._run_prefill_new_tokens(prefill, q, k, v, False)
                expected.append(instance)
    assert ran.instances == expected
    prepare.assert_not_called()  # the hooks never prepare a builder's instance


def test_context_chunk_hooks_run_the_steps_instance(shim, clean_selection, model_dirs):
    """forward_mha's order: new tokens, then each context chunk, on the instance of the call's step."""
    cfg = host.make_vllm_config(model_dirs["plain"])
    layers = [build_layer(cfg, f"model.layers.{i}.self_attn") for i in range(2)]
    builders = [make_builder(cfg, layers), make_builder(cfg, layers)]
    runners = [next(iter(b._mla_prefill_runners.values())) for b in builders]
    prefills = [build_step(cfg, b, [3]) for b in builders]
    calls: list[tuple[str, Any, Any]] = []

    def new_tokens(self: Any, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        calls.append(("new", self, self._prefill_metadata))
        return "out"

    def chunk(self: Any, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        calls.append((f"chunk {chunk_idx}", self, self._prefill_metadata))
        return "out", "lse"

    cls = type(runners[0])
    with (
        mock.patch.object(cls, "run_prefill_new_tokens", new_tokens),
        mock.patch.object(cls, "run_prefill_context_chunk", chunk),
    ):
        for i in (0, 1, 1, 0):
            for layer in layers:
                assert layer.impl._run_prefill_new_tokens(prefills[i], None, None, None, True) == "out"
                for c in range(3):
                    assert layer.impl._run_prefill_context_chunk(prefills[i], c, None, None, None) == (
                        "out",
                        "lse",
                    )
    assert len(calls) == 4 * 2 * 4
    it = iter(calls)
    for i in (0, 1, 1, 0):
        for _ in layers:
            for what in ("new", "chunk 0", "chunk 1", "chunk 2"):
                name, instance, metadata = next(it)
                assert (name, instance, metadata) == (what, runners[i], prefills[i])


def test_metadata_from_elsewhere_prepares_the_layers_own_backend_once_each(shim, clean_selection, model_dirs):
    """Metadata not built by the patched builder (tests, benchmarks): the layer's own instance,
    prepared once per metadata object, before and after builder steps."""
    from mla_prefill_ext.testing.problem import make_problem

    cfg = host.make_vllm_config(model_dirs["plain"])
    layer = build_layer(cfg, "model.layers.0.self_attn")
    builder = make_builder(cfg, [layer])
    (runner,) = builder._mla_prefill_runners.values()
    own = layer.prefill_backend
    outside = [make_problem([4, 6], None, num_heads=HEADS, dtype=torch.float32).metadata for _ in range(2)]
    stepped = build_step(cfg, builder, [5])
    cls = type(own)
    ran: list[tuple[Any, Any]] = []
    prepared: list[tuple[Any, Any]] = []
    original_prepare = cls.prepare_metadata

    def prepare(self: Any, metadata: Any) -> None:
        prepared.append((self, metadata))
        original_prepare(self, metadata)

    def run(self: Any, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        ran.append((self, self._prefill_metadata))

    with (
        mock.patch.object(cls, "prepare_metadata", prepare),
        mock.patch.object(cls, "run_prefill_new_tokens", run),
    ):
        sequence = [outside[0], outside[0], stepped, outside[0], outside[1], outside[1], stepped, stepped]
        for metadata in sequence:
            layer.impl._run_prefill_new_tokens(metadata, None, None, None, False)
    assert ran == [
        (own, outside[0]),
        (own, outside[0]),
        (runner, stepped),
        (own, outside[0]),
        (own, outside[1]),
        (own, outside[1]),
        (runner, stepped),
        (runner, stepped),
    ]
    # Once per metadata object, and only the layer's own instance (the builder's is prepared in build()).
    assert prepared == [(own, outside[0]), (own, outside[1])]


def test_layers_with_different_parameters_keep_their_own_instances():
    """Layers of distinct step_keys in one step: each runs the instance prepared for its key."""

    class Backend:
        def __init__(self, key: Any) -> None:
            self.step_key = key
            self._prefill_metadata: Any = None

        def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
            return self

        def run_prefill_context_chunk(self, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
            return self

    class Impl:
        pass

    class Prefill:
        pass

    keys = [(object(), 1), (object(), 2)]  # unique to this test: no other test's layers share them
    impls = []
    for key in keys * 2:
        impl = Impl()
        bind_impl_to_backend(impl)
        impl.prefill_backend = Backend(key)
        impls.append(impl)
    # Two builders, each with its runners for good (as vLLM's), their steps taking turns.
    builders = [{key: Backend(key) for key in keys} for _ in range(2)]
    for step in range(6):
        prefill = Prefill()
        prefill.mla_prefill_runners = builders[step % 3 % 2]
        for impl in impls * 2:
            want = prefill.mla_prefill_runners[impl.prefill_backend.step_key]
            assert impl._run_prefill_new_tokens(prefill, None, None, None, False) is want
            assert impl._run_prefill_context_chunk(prefill, 0, None, None, None) is want


def test_an_impl_without_backend_refuses_every_call():
    class Impl:
        pass

    class Prefill:
        pass

    impl = Impl()
    bind_impl_to_backend(impl)
    prefill = Prefill()
    prefill.mla_prefill_runners = {}
    message = (
        "^Impl has no MLA prefill backend: it was not built by an MLAAttention layer "
        "patched by mla-prefill-ext$"
    )
    for _ in range(2):
        with pytest.raises(RuntimeError, match=message):
            impl._run_prefill_new_tokens(prefill, None, None, None, False)
        with pytest.raises(RuntimeError, match=message):
            impl._run_prefill_context_chunk(prefill, 0, None, None, None)
