"""The GPU suite's sharp-attention checkpoint (scripts/gpu_harness/make_sharp_checkpoint.py) loads into vLLM.

CPU tests (they run in CI): vLLM's own ``DeepseekV2ForCausalLM`` is built and its own
``load_weights`` reads the checkpoint, with the strict "every parameter loaded" check
vLLM's default loader applies. The full-size configuration is checked on the meta
device (names and shapes, no memory); a shrunken one is generated for real.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from mla_prefill_ext import versions
from mla_prefill_ext.testing import vllm_host as host
from scripts.gpu_harness import make_sharp_checkpoint as msc


@contextlib.contextmanager
def vllm_build_context(cfg: Any, meta: bool) -> Iterator[None]:
    """What building vLLM's whole DeepseekV2 needs on a CPU box (see mla_prefill_ext/testing/vllm_host.py).

    Beyond host.gpu_view: the unquantized MoE kernel choice, which has no answer on the
    "unspecified" platform, answers CPU (weights are created the same way for every kernel).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.utils.torch_utils import set_default_torch_dtype

    with contextlib.ExitStack() as stack:
        if versions.decide().mode == versions.BRIDGE:
            # vLLM 0.23+ gives every MLA layer a prefill backend; its own cannot load on a CPU box.
            import mla_prefill_ext

            mla_prefill_ext.activate()
            stack.enter_context(mock.patch.dict(os.environ, {"MLA_PREFILL_BACKEND": "TORCH_SDPA"}))
        stack.enter_context(host.gpu_view(None))
        stack.enter_context(set_current_vllm_config(cfg))
        stack.enter_context(set_default_torch_dtype(torch.bfloat16))
        stack.enter_context(
            mock.patch(
                "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.select_unquantized_moe_backend",
                lambda moe_config: (UnquantizedMoeBackend.CPU, None),
            )
        )
        if meta:
            stack.enter_context(torch.device("meta"))
        yield


def vllm_model(model_dir: Path, meta: bool) -> tuple[Any, Any]:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    cfg = host.make_vllm_config(model_dir)
    host.ensure_distributed(cfg)
    with vllm_build_context(cfg, meta):
        return DeepseekV2ForCausalLM(vllm_config=cfg), cfg


def load_strictly(model: Any, cfg: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """vLLM's DefaultModelLoader: load_weights, then every parameter must have been loaded."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg):
        loaded = model.load_weights(weights)
    params = {name for name, _ in model.named_parameters()}
    assert params - loaded == set(), "not initialized from the checkpoint"
    assert loaded - params == set()


def test_full_size_names_and_shapes_are_what_vllm_loads(clean_selection):
    """The GPU suite's model (scripts/gpu_harness/tiny_deepseek_v2): every tensor name and shape."""
    shapes = msc.vllm_checkpoint_shapes(msc.transformers_parameter_shapes(msc.DEFAULT_CONFIG))
    model, cfg = vllm_model(msc.DEFAULT_CONFIG.parent, meta=True)
    load_strictly(
        model, cfg, ((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes.items())
    )
    n_experts = json.loads(msc.DEFAULT_CONFIG.read_text())["n_routed_experts"]
    assert f"model.layers.1.mlp.experts.{n_experts - 1}.down_proj.weight" in shapes
    assert sum(math.prod(s) for s in shapes.values()) > 2e8


def test_a_wrong_shape_is_refused_by_vllm(clean_selection):
    """So the test above would notice a shape that vLLM cannot take."""
    shapes = msc.vllm_checkpoint_shapes(msc.transformers_parameter_shapes(msc.DEFAULT_CONFIG))
    shapes["model.layers.0.self_attn.kv_b_proj.weight"] = (4096, 511)
    model, cfg = vllm_model(msc.DEFAULT_CONFIG.parent, meta=True)
    with pytest.raises(AssertionError):
        load_strictly(
            model, cfg, ((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes.items())
        )


def test_fused_experts_of_transformers_5_are_split_per_expert():
    hf = {
        "model.layers.1.mlp.experts.gate_up_proj": (3, 2 * 8, 16),
        "model.layers.1.mlp.experts.down_proj": (3, 16, 8),
        "model.layers.1.mlp.gate.weight": (3, 16),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (8, 16),
    }
    out = msc.vllm_checkpoint_shapes(hf)
    assert out == {
        **{f"model.layers.1.mlp.experts.{e}.gate_proj.weight": (8, 16) for e in range(3)},
        **{f"model.layers.1.mlp.experts.{e}.up_proj.weight": (8, 16) for e in range(3)},
        **{f"model.layers.1.mlp.experts.{e}.down_proj.weight": (16, 8) for e in range(3)},
        "model.layers.1.mlp.gate.weight": (3, 16),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (8, 16),
    }


def test_weight_rule():
    assert msc.std_of("model.layers.0.self_attn.q_proj.weight") == 0.06
    assert msc.std_of("model.layers.0.self_attn.q_b_proj.weight") == 0.06
    assert msc.std_of("model.layers.0.self_attn.kv_b_proj.weight") == 0.06
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
        "lm_head.weight",
    ):
        assert msc.std_of(name) == 0.02, name
    for name in (
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
    ):
        assert msc.std_of(name) is None, name


SMALL = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
}


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = json.loads(msc.DEFAULT_CONFIG.read_text()) | SMALL
    path = tmp_path_factory.mktemp("small-config") / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_small_checkpoint_loads_into_vllm_with_the_rule(clean_selection, small_config, tmp_path):
    from safetensors import safe_open

    out = msc.make_checkpoint(tmp_path / "ckpt", seed=0, config_path=small_config)
    assert json.loads((out / "config.json").read_text()) == json.loads(small_config.read_text())
    marker = json.loads((out / msc.MARKER_FILE).read_text())
    assert marker["seed"] == 0 and marker["generator_version"] == msc.GENERATOR_VERSION

    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    model, cfg = vllm_model(out, meta=False)
    load_strictly(model, cfg, safetensors_weights_iterator([str(out / msc.WEIGHTS_FILE)], False))
    params = dict(model.named_parameters())
    # vLLM's fused experts of layer 1 (the module path differs between vLLM releases)
    w13_name = next(n for n in params if n.startswith("model.layers.1.mlp.") and n.endswith("w13_weight"))
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    for name, std in (
        ("model.layers.0.self_attn.q_proj.weight", 0.06),
        ("model.layers.1.self_attn.kv_b_proj.weight", 0.06),
        ("model.layers.0.self_attn.o_proj.weight", 0.02),
        (w13_name, 0.02),
        ("lm_head.weight", 0.02),
    ):
        assert params[name].float().std().item() == pytest.approx(std, rel=0.05), name
    with safe_open(str(out / msc.WEIGHTS_FILE), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        gate = f.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight")
        up = f.get_tensor("model.layers.1.mlp.experts.2.up_proj.weight")
        assert gate.dtype == torch.bfloat16
    w13 = params[w13_name][2]  # vLLM: [gate; up] per expert
    assert torch.equal(w13, torch.cat([gate, up]))


def test_generation_is_seeded_and_idempotent(small_config, tmp_path):
    a = msc.make_checkpoint(tmp_path / "a", seed=0, config_path=small_config)
    stamp = (a / msc.WEIGHTS_FILE).stat().st_mtime_ns
    msc.make_checkpoint(a, seed=0, config_path=small_config)  # already there: untouched
    assert (a / msc.WEIGHTS_FILE).stat().st_mtime_ns == stamp
    b = msc.make_checkpoint(tmp_path / "b", seed=0, config_path=small_config)
    assert (a / msc.WEIGHTS_FILE).read_bytes() == (b / msc.WEIGHTS_FILE).read_bytes()
    msc.make_checkpoint(b, seed=1, config_path=small_config)  # another seed: rewritten
    assert json.loads((b / msc.MARKER_FILE).read_text())["seed"] == 1
    assert (a / msc.WEIGHTS_FILE).read_bytes() != (b / msc.WEIGHTS_FILE).read_bytes()
    assert msc.is_complete(b, 1, small_config) and not msc.is_complete(b, 0, small_config)


def test_command_line(small_config, tmp_path, capsys):
    assert msc.main([str(tmp_path / "c"), "--seed", "3", "--config", str(small_config)]) == 0
    assert msc.is_complete(tmp_path / "c", 3, small_config)
    assert msc.main([str(tmp_path / "c"), "--seed", "3", "--config", str(small_config)]) == 0
    assert "already in" in capsys.readouterr().out
