"""The shared-prefix path inside vLLM's own builder and ``forward_mha``, on the host this vLLM has.

vLLM 0.20.2 (the patch), 0.25.1 and 0.33.0 (the bridge): real layer, real metadata builder, the runner's
real ``BlockTable`` (its host buffer is what the path reads); the context path's CUDA-only gather
and merge done in torch (``cpu_step_kernels``). A step of four prefill requests, three of them
sharing two cached blocks (two with private context after them), one with a context of its own,
is checked against float64 attention over each request's whole sequence, with the path on and
off; with it on the shared blocks are up-projected once. vLLM 0.33.0 (its context loop on
``MLACommonBaseImpl``, chunk objects) takes the same path. On a vLLM whose context path has another
shape, nothing is wrapped and one line says why.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import numpy as np
import pytest
import torch
from mla_layer_on_cpu import (
    TOLERANCE,
    activate_on_this_vllm,
    build_layer,
    cpu_step_kernels,
    make_builder,
    recording,
)
from vllm_runner_objects import (
    runner_block_table,
    runner_input_batch,
    v2_apply,
    v2_gather,
    v2_tables,
    v2_write_one,
)

from mla_prefill_ext import versions
from mla_prefill_ext.testing import vllm_host as host
from mla_prefill_ext.testing.reference import reference_attention

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
BS = 16
LORA, ROPE, NOPE, DV = 512, 64, 128, 128
SHARED = [9, 4]  # the shared prefix's two blocks (32 tokens)
LONG_SHARED = [9, 4, 14, 15, 16]  # five blocks (80 tokens): more than one 64-row workspace pass
# (blocks after the shared ones or of its own, private context tokens, new tokens); the first three
# share the prefix, the last has a context of its own.
REQUESTS = [
    ([2, 11], 21, 3),
    ([7], 5, 4),
    ([12], 0, 2),  # the shared prefix and nothing of its own
    ([1, 5, 6], 40, 3),
]
NUM_BLOCKS = 17


def context_lens(shared: list[int]) -> list[int]:
    return [(len(shared) * BS if i < 3 else 0) + private for i, (_, private, _) in enumerate(REQUESTS)]


def _path() -> Any:
    return importlib.import_module("mla_prefill_ext.hosts.core.shared_prefix.instrumentor").INSTRUMENTOR


@pytest.fixture
def activated(clean_selection: pytest.MonkeyPatch) -> Any:
    """The add-on active on this vLLM's host, vLLM's MLA module loaded (the path wraps it then)."""
    clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # vLLM's own runner choice
    return activate_on_this_vllm(clean_selection)


@pytest.fixture(params=["V1", "V2"])
def runner(request: pytest.FixtureRequest, activated: Any) -> str:
    """Each model runner whose block tables the path reads on this vLLM (0.33: both; 0.34: V2; before: V1)."""
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    missing = needs.problems("plan", request.param)
    if missing:
        pytest.skip(f"the path does not read the {request.param} runner's block tables here: {missing[0]}")
    return request.param


@pytest.fixture
def small_groups_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any shared block is worth a segment (this step's 32 shared tokens are far below the guard)."""
    from mla_prefill_ext.hosts.core.shared_prefix import costs
    from mla_prefill_ext.shared_prefix import FlopCostModel

    monkeypatch.setattr(costs, "GROUP_VALUE", FlopCostModel())


def _block_table(rows: list[list[int]], runner: str | None = None) -> tuple[Any, Any]:
    """vLLM's runner block table (on the CPU), holding ``rows``: the tensor the runner hands a builder and
    the V2 runner's ``req_idx`` (None on V1)."""
    return runner_block_table(rows, BS, runner)


class Step:
    """One step's inputs (written into a paged cache) and each request's float64 expectation."""

    def __init__(self, layer: Any, shared: list[int] = SHARED, runner: str | None = None) -> None:
        gen = torch.Generator().manual_seed(11)
        dtype = torch.bfloat16
        self.layer = layer
        self.w = (torch.randn(layer.kv_b_proj.weight.shape, generator=gen) * 0.05).to(dtype)
        layer.kv_b_proj.weight.data = self.w
        self.cache = torch.randn(NUM_BLOCKS, BS, LORA + ROPE, generator=gen).to(dtype)
        self.rows = [(shared + own if i < 3 else own) for i, (own, _, _) in enumerate(REQUESTS)]
        self.ctx = context_lens(shared)
        self.new = [n for _, _, n in REQUESTS]
        heads = layer.num_heads
        self.q = torch.randn(sum(self.new), heads, NOPE + ROPE, generator=gen).to(dtype)
        self.kv_c = torch.randn(sum(self.new), LORA, generator=gen).to(dtype)
        self.k_pe = torch.randn(sum(self.new), 1, ROPE, generator=gen).to(dtype)
        self.device_table, self.req_idx = _block_table(self.rows, runner)
        slots = []
        for row, c, n in zip(self.rows, self.ctx, self.new, strict=True):
            slots += [row[p // BS] * BS + p % BS for p in range(c, c + n)]
        self.slots = torch.tensor(slots, dtype=torch.int64)
        flat = self.cache.view(-1, LORA + ROPE)
        flat[self.slots] = torch.cat([self.kv_c, self.k_pe.squeeze(1)], dim=-1)

    def batch(self) -> Any:
        batch = host.prefill_batch(self.new, self.ctx, self.device_table, BS, req_idx=self.req_idx)
        batch.slot_mapping = self.slots
        return batch

    def expected(self) -> torch.Tensor:
        heads, flat, out, start = self.layer.num_heads, self.cache.view(-1, LORA + ROPE), [], 0
        for row, c, n in zip(self.rows, self.ctx, self.new, strict=True):
            latent = flat[[row[p // BS] * BS + p % BS for p in range(c + n)]]
            kv = torch.nn.functional.linear(latent[:, :LORA], self.w).double().view(c + n, heads, NOPE + DV)
            k = torch.cat([kv[..., :NOPE], latent[:, None, LORA:].double().expand(-1, heads, ROPE)], dim=-1)
            o, _ = reference_attention(
                self.q[start : start + n].double(), k, kv[..., NOPE:], self.layer.scale, causal=True
            )
            out.append(o)
            start += n
        return torch.cat(out).reshape(sum(self.new), -1)


def run_step(
    cfg: Any,
    layer: Any,
    mla_module: Any,
    workspace: int = 64,
    shared: list[int] = SHARED,
    runner: str | None = None,
) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config

    builder = make_builder(cfg, [layer], None)
    builder.chunked_prefill_workspace_size = workspace
    impl = layer.impl
    impl.dcp_world_size = 1  # what MLAAttention.forward_impl sets before calling forward_mha
    step = Step(layer, shared, runner)
    with cpu_step_kernels(mla_module), host.gpu_view(None), set_current_vllm_config(cfg):
        metadata = builder.build(0, step.batch())
    output = torch.full((sum(step.new), layer.num_heads * DV), float("nan"), dtype=torch.bfloat16)
    with cpu_step_kernels(mla_module), recording(type(layer.kv_b_proj), "forward") as projected:
        impl.forward_mha(step.q, step.kv_c, step.k_pe, step.cache, metadata, torch.ones(()), output=output)
    expected = step.expected()
    assert torch.isfinite(output).all()
    return {
        "error": ((output.double() - expected).abs().max() / expected.abs().max()).item(),
        "shared": getattr(metadata.prefill, "mla_shared_step", None),
        # kv_b_proj rows: the new tokens once, then each context row vLLM's loop or the path projected.
        "projected_rows": sum(args[0].shape[0] for _, args, _ in projected),
        "new_tokens": sum(step.new),
    }


def test_the_path_wraps_vllms_context_code_where_it_has_the_known_shape(activated):
    from mla_prefill_ext.hosts.core.shared_prefix import block_tables, needs

    path = _path()
    if versions.installed_vllm_version() in versions.TESTED:
        assert path.is_instrumented(), path.state().skipped_reason
        # Each runner this vLLM has is served (0.20 and 0.25: V1, whose V2 builders lack req_idx).
        served = {r for r, why in block_tables.RUNNER_PROBLEMS.items() if why is None}
        line = versions.release(versions.installed_vllm_version())[:2]
        assert served == ({"V1", "V2"} if line == (0, 33) else {"V2"} if line >= (0, 34) else {"V1"})
        assert needs.runners_here() == (["V2"] if line >= (0, 34) else ["V1", "V2"])
    elif not path.is_instrumented():
        assert path.state().skipped_reason and "vLLM" in path.state().skipped_reason


@pytest.mark.parametrize("row", range(7))
def test_a_row_of_the_table_that_does_not_hold_leaves_vllm_untouched_with_its_reason(
    activated, monkeypatch, row
):
    """Every row the context path needs on any runner, made not to hold (its attribute gone): nothing
    is wrapped, and the one line names that row's module and attribute."""
    import mla_prefill_ext
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    need = needs.rows("plan", needs.ANY)[row]
    module = importlib.import_module(need.module)
    path, _ = needs.resolve(need, module)
    mla_prefill_ext.deactivate()
    try:
        broken = need._replace(check=lambda obj: "was changed (this test)")
        monkeypatch.setattr(needs, "NEEDS", tuple(broken if n is need else n for n in needs.NEEDS))
        assert not _path().instrument(activated)
        assert not _path().state().wrappers.installed
        assert f"{need.module}.{path} was changed (this test)" in _path().state().skipped_reason
    finally:
        monkeypatch.undo()
        mla_prefill_ext.activate()
        if versions.decide().mode == versions.BRIDGE:
            from mla_prefill_ext.hosts import vllm_0_23

            importlib.import_module(vllm_0_23.PREFILL_PACKAGE)
    assert _path().is_instrumented()


def test_a_shared_prefix_is_projected_once_and_the_step_matches_the_reference(
    activated, runner, model_dirs, small_groups_pay
):
    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    before = path.report()["steps_with_segments"]
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    result = run_step(cfg, layer, activated, runner=runner)
    print("shared-prefix path on:", {k: v for k, v in result.items() if k != "shared"})
    assert path.report()["steps_with_segments"] == before + 1  # the counter the benchmarks read
    assert result["shared"] is not None and len(result["shared"].plan.segments) == 1
    assert result["shared"].plan.segments[0].members == (0, 1, 2)
    context = sum(context_lens(SHARED))
    assert result["projected_rows"] == result["new_tokens"] + context - 2 * 32  # 32 shared rows once
    assert result["error"] <= TOLERANCE, result


def test_a_layers_parts_are_made_once_and_again_when_its_projection_changes(activated, model_dirs):
    from mla_prefill_ext.hosts.core.shared_prefix.layer import _CACHED, _layer_parts, layer_context

    cfg = host.make_vllm_config(model_dirs["yarn"])
    impl = build_layer(cfg, None).impl
    parts = _layer_parts(impl)
    assert _layer_parts(impl) is parts  # the next layer call: nothing made again
    assert parts[1].num_heads == impl.num_heads and parts[1].kv_lora_rank == LORA
    # Nothing cached refers back to the impl: vLLM dropping it frees its weights at once.
    cached = impl.__dict__[_CACHED]
    assert all(getattr(part, "__self__", None) is not impl for part in (*cached, *parts))
    context = layer_context(impl, None, None, None)
    assert context.concat_k.__self__ is impl and context.kv_b_proj is parts[0]
    # A projection replaced or requantized after loading: the parts follow it.
    impl.kv_b_proj = type(impl.kv_b_proj)(LORA, impl.num_heads * (NOPE + DV), bias=False)
    replaced = _layer_parts(impl)
    assert replaced is not parts and _layer_parts(impl) is replaced
    impl.kv_b_proj.weight.data = impl.kv_b_proj.weight.data.to(torch.float16)
    assert _layer_parts(impl) is not replaced


def test_a_shared_prefix_longer_than_the_workspace_takes_several_passes(
    activated, model_dirs, small_groups_pay
):
    """80 shared tokens and a 64-row workspace: the segment runs in two passes, merged by LSE."""
    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    result = run_step(cfg, build_layer(cfg, None), activated, shared=LONG_SHARED)
    plan = result["shared"].plan
    print(
        "80 shared tokens:", len(plan.segment_passes), "segment passes,", len(plan.private_passes), "private"
    )
    assert len(plan.segment_passes) == 2 and plan.segments[0].num_tokens == 80
    context = sum(context_lens(LONG_SHARED))
    assert result["projected_rows"] == result["new_tokens"] + context - 2 * 80
    assert result["error"] <= TOLERANCE, result


def test_a_prefix_too_small_to_pay_is_left_to_vllm(activated, model_dirs):
    """With the default guard, 2 x 32 shared rows saved are not worth a segment's launches."""
    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    result = run_step(cfg, build_layer(cfg, None), activated)
    assert result["shared"] is None
    assert result["projected_rows"] == result["new_tokens"] + sum(context_lens(SHARED))
    assert result["error"] <= TOLERANCE, result


def test_turned_off_the_step_runs_vllms_own_context_path(
    activated, model_dirs, clean_selection, addon_log, small_groups_pay
):
    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    result = run_step(cfg, layer, activated)
    assert result["shared"] is None
    assert result["projected_rows"] == result["new_tokens"] + sum(context_lens(SHARED))
    assert result["error"] <= TOLERANCE, result
    lines = [r.getMessage() for r in addon_log if "shared-prefix" in r.getMessage()]
    assert any("off (turned off by MLA_PREFILL_SHARED_PREFIX)" in line for line in lines), lines


@pytest.mark.parametrize("fault", ["other group's prefix", "segment LSE left out"])
def test_a_wrong_shared_path_fails_the_same_check(activated, model_dirs, small_groups_pay, fault):
    """The check above fails the path if a request attends another prefix or the segment's LSE is dropped."""
    from mla_prefill_ext.shared_prefix import execute

    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    original = execute.compute_context

    def wrong(q, plan, table, step_backend, segment_backend, layer_ctx):
        if fault == "other group's prefix":
            # The segment gathers the private context's first blocks instead of the shared ones.
            plan = dataclasses.replace(plan, segment_block_table=torch.tensor([[1, 5]], dtype=torch.int32))
            return original(q, plan, table, step_backend, segment_backend, layer_ctx)
        # Keep only the private part, as if the segment's LSE never reached the merge.
        no_segment = dataclasses.replace(plan, segments=())
        return original(q, no_segment, table, step_backend, None, layer_ctx)

    layer_module = importlib.import_module("mla_prefill_ext.hosts.core.shared_prefix.layer")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_module, "compute_context", wrong)
        result = run_step(cfg, layer, activated)
    print(f"{fault}: error {result['error']:.3g} (bound {TOLERANCE:.3g})")
    assert result["shared"] is not None
    assert result["error"] > TOLERANCE, result


# --- Routing short extends -------------------------------------------------------------------------


def _input_batch(requests: list[tuple[list[int], int, int]]) -> Any:
    """vLLM's runner ``InputBatch`` (on the CPU) holding ``(block ids, computed tokens, prompt tokens)``."""
    return runner_input_batch(requests, BS)


def _short_extends(
    prefix_blocks: int, new: int, count: int, shared: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step of ``count`` short extends of ``new`` tokens each over ``prefix_blocks`` cached blocks
    (the same blocks, or each its own) and 8 blocks of their own: (host rows, cached tokens, new tokens)."""
    rows, ctx, q = [], [], []
    for i in range(count):
        first = 1 if shared else 1 + i * prefix_blocks
        rows.append(list(range(first, first + prefix_blocks)) + list(range(100000 + 8 * i, 100008 + 8 * i)))
        ctx.append(prefix_blocks * BS)
        q.append(new)
    return np.array(rows, dtype=np.int32), np.array(ctx), np.array(q)


def _route(rows: np.ndarray, ctx: np.ndarray, q: np.ndarray) -> int | None:
    from mla_prefill_ext.hosts.core.shared_prefix import routing

    return routing.route_threshold(rows, ctx, q, BS, 512)


@pytest.mark.parametrize("new", [64, 128, 512])
def test_short_extends_sharing_a_long_prefix_are_routed_to_the_prefill_path(activated, new):
    assert _route(*_short_extends(prefix_blocks=256, new=new, count=16, shared=True)) == 1  # 4,096 shared


def test_very_short_extends_over_a_shared_prefix_stay_where_the_h200_found_no_gain(activated):
    """16 x 32 new tokens: the prefix's one up-projection costs about what absorbed attention saves (one
    R1 layer on the H200: 1.06x; routing.H200_TFLOPS), so the step stays on vLLM's decode path."""
    assert _route(*_short_extends(prefix_blocks=256, new=32, count=16, shared=True)) is None


@pytest.mark.parametrize("new", [32, 512])
def test_short_extends_with_private_contexts_stay_where_vllm_puts_them(activated, new):
    assert _route(*_short_extends(prefix_blocks=256, new=new, count=16, shared=False)) is None


def test_a_few_short_queries_over_a_small_shared_prefix_stay_on_the_decode_path(activated):
    """Two requests, 8 new tokens each over 2 shared blocks: absorbed attention is cheaper there."""
    from mla_prefill_ext.hosts.core.shared_prefix import routing

    absorbed, prefill = routing.route_cost(np.array([8, 8]), np.array([32, 32]), np.array([32, 32]), [32])
    assert prefill > routing.ROUTE_BELOW * absorbed
    assert _route(*_short_extends(prefix_blocks=2, new=8, count=2, shared=True)) is None


def test_true_decodes_and_prefills_in_the_step_are_not_what_routing_weighs(activated):
    """One-token decodes and long prefills beside the short extends change nothing: routing weighs the
    short extends only (the same 16 x 128 step, routed, with both kinds around it)."""
    rows, ctx, q = _short_extends(prefix_blocks=256, new=128, count=16, shared=True)
    rows = np.concatenate([rows[:2], rows])
    ctx = np.concatenate([[4096, 4096], ctx])
    q = np.concatenate([[1, 1], q])
    assert _route(rows, ctx, q) == 1
    q_long = q.copy()
    q_long[2:] = 600  # above the threshold: prefills already, nothing to route
    assert _route(rows, ctx, q_long) is None


def test_the_v1_runner_reads_the_same_step_from_its_input_batch(activated):
    """V1 runner: ``step_threshold`` takes the rows, cached and new tokens from vLLM's real ``InputBatch``."""
    from mla_prefill_ext.hosts.core.shared_prefix import needs, routing

    if needs.problems("route", "V1") or needs.problems("plan", "V1"):
        pytest.skip("this vLLM has no V1 runner the path routes on")
    rows, ctx, q = _short_extends(prefix_blocks=256, new=128, count=16, shared=True)
    batch = _input_batch([(list(r), int(c), int(c + n)) for r, c, n in zip(rows, ctx, q, strict=True)])
    scheduled = {f"r{i}": int(n) for i, n in enumerate(q)}
    assert routing.step_threshold(batch, scheduled, 512) == 1
    private = _short_extends(prefix_blocks=256, new=128, count=16, shared=False)
    batch = _input_batch([(list(r), int(c), int(c + n)) for r, c, n in zip(*private, strict=True)])
    assert routing.step_threshold(batch, scheduled, 512) is None


def test_the_builder_splits_a_routed_step_at_the_lowered_threshold(activated, model_dirs, small_groups_pay):
    """vLLM's own split in the real builder: short extends are decodes at 512 and prefills when routed."""
    from vllm.config import set_current_vllm_config

    from mla_prefill_ext.hosts.core.shared_prefix import routing

    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    builder = make_builder(cfg, [layer], None)
    builder.reorder_batch_threshold = 512  # FLASH_ATTN_MLA's, on a GPU
    step = Step(layer)
    split = {}
    for lowered in (None, 1):
        routing._LOCAL.threshold = lowered
        try:
            with cpu_step_kernels(activated), host.gpu_view(None), set_current_vllm_config(cfg):
                metadata = builder.build(0, step.batch())
        finally:
            routing._LOCAL.threshold = None
        split[lowered] = (metadata.num_decodes, metadata.num_prefills)
        assert builder.reorder_batch_threshold == 512
    # At 512 vLLM counts leading short extends as decodes (here 1: this builder wants uniform
    # decode lengths and the next request has another); routed, every one is a prefill.
    assert split[None][0] >= 1 and split[1] == (0, 4), split


def test_deactivate_removes_the_paths_wrappers_and_activate_puts_them_back(activated):
    import wrapt

    import mla_prefill_ext
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    context = next(n for n in needs.rows("plan", needs.ANY) if "_compute_prefill_context" in n.attributes[0])
    owner_name, _, name = needs.resolve(context, activated)[0].rpartition(".")
    owner = getattr(activated, owner_name)
    assert isinstance(owner.__dict__[name], wrapt.FunctionWrapper)
    mla_prefill_ext.deactivate()
    try:
        assert not path.is_instrumented() and not path.state().wrappers.installed
        assert not isinstance(owner.__dict__[name], wrapt.FunctionWrapper)
    finally:
        mla_prefill_ext.activate()
        if versions.decide().mode == versions.BRIDGE:
            from mla_prefill_ext.hosts import vllm_0_23

            importlib.import_module(vllm_0_23.PREFILL_PACKAGE)
    assert path.is_instrumented() and isinstance(owner.__dict__[name], wrapt.FunctionWrapper)


def test_a_failure_while_planning_leaves_vllms_own_step(activated, model_dirs, small_groups_pay, monkeypatch):
    """The add-on's own planning fails (making the segments' step): the step runs vLLM's own context
    path with vLLM's own chunks, correctly (an ERROR line says so). A backend that raises is another
    matter: see the next test."""
    from mla_prefill_ext.shared_prefix import views

    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    failed = []

    def segment_step(*args, **kwargs):
        failed.append(True)
        raise RuntimeError("a planning fault (a test's)")

    monkeypatch.setattr(views, "SegmentStep", segment_step)
    cfg = host.make_vllm_config(model_dirs["yarn"])
    result = run_step(cfg, build_layer(cfg, None), activated)
    assert failed and result["shared"] is None
    assert result["projected_rows"] == result["new_tokens"] + sum(context_lens(SHARED))
    assert result["error"] <= TOLERANCE, result


# A backend raising on its Nth call on the path (found in a clean run: (method, what it served), which
# of those, what the note says): its own exception stops the step, named once; vLLM's path does not
# take over. custom_backends.RaisingSDPABackend, registered as CUSTOM (test_backend_raising_mid_step.py
# has the same for the calls outside the path).
RAISING = {
    "a segment pass": ("run_prefill_context_chunk", "SegmentStep", 0, "shared-prefix segment pass 0"),
    "a private pass": (
        "run_prefill_context_chunk",
        "MLACommonPrefillMetadata",
        0,
        "shared-prefix private pass 0",
    ),
    "the segments' preparation": ("prepare_metadata", "SegmentStep", 0, "(the shared-prefix segments)"),
    "the private chunks' preparation": (
        "prepare_metadata",
        "MLACommonPrefillMetadata",
        -1,
        "(the shared-prefix private chunks)",
    ),
}


@pytest.mark.parametrize("case", RAISING)
def test_a_backend_raising_on_the_path_stops_the_step_with_its_own_exception(
    activated, model_dirs, small_groups_pay, clean_selection, case
):
    from custom_backends import RaisingSDPABackend

    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.RaisingSDPABackend")
    clean_selection.setenv("MLA_PREFILL_BACKEND", "CUSTOM")
    method, served, which, said = RAISING[case]
    cfg = host.make_vllm_config(model_dirs["yarn"])
    try:
        RaisingSDPABackend.arm(None)
        clean = run_step(cfg, build_layer(cfg, None), activated)
        cfg = host.make_vllm_config(model_dirs["yarn"])  # a fresh model for the second run
        assert clean["shared"] is not None and clean["error"] <= TOLERANCE, clean
        calls = [(m, w) for m, w, _ in RaisingSDPABackend.calls]
        print(case, "- the clean run's calls:", calls)
        n = [i for i, (m, w) in enumerate(calls, 1) if m == method and w.split()[0] == served][which]

        RaisingSDPABackend.arm(n)
        with pytest.raises(RuntimeError) as info:
            run_step(cfg, build_layer(cfg, None), activated)
        made, raised = list(RaisingSDPABackend.calls), list(RaisingSDPABackend.raised)
    finally:
        RaisingSDPABackend.arm(None)
    error = info.value
    assert error is raised[0]  # the backend's own exception, unwrapped and unchanged
    assert str(error) == f"RAISING_SDPA: call {n} ({method}) fails, as asked"
    (note,) = error.__notes__
    print(case, "- the note:", note)
    assert f"RAISING_SDPA (custom_backends.RaisingSDPABackend) raised in {method}" in note
    assert said in note
    assert [(m, w) for m, w, _ in made] == calls[:n]  # as the clean run, to the Nth call; nothing after
    assert [outcome for _, _, outcome in made] == ["returned"] * (n - 1) + ["raised"]


def test_short_extends_with_private_contexts_behind_one_shared_header_stay_put(activated):
    """One common 16-token block (a chat template) is not worth a segment: no routing either."""
    rows = np.array([[1, *range(100 + 300 * i, 100 + 300 * i + 256)] for i in range(16)], dtype=np.int32)
    assert _route(rows, np.full(16, 257 * BS), np.full(16, 256)) is None


def test_the_host_block_table_is_found_for_the_runners_device_view_only(activated, runner):
    from mla_prefill_ext.hosts.core.shared_prefix import block_tables

    device, req_idx = _block_table([[3, 4], [5]], runner)
    common = host.prefill_batch([1, 1], [20, 4], device, BS, req_idx=req_idx)
    rows = block_tables.host_rows(common)
    assert rows is not None and rows[0, :2].tolist() == [3, 4] and rows[1, 0] == 5
    other = host.prefill_batch([1, 1], [20, 4], torch.zeros(2, 8, dtype=torch.int32), BS, req_idx=req_idx)
    assert block_tables.host_rows(other) is None  # a tensor the runner did not hand out
    held = block_tables.held()  # what a soak reads: the table it found is remembered
    assert held["twins" if req_idx is None else "mirror_addresses"] >= 1
    if req_idx is None:
        narrowed = host.prefill_batch([1, 1], [4, 4], device[:, :1], BS)
        assert block_tables.host_rows(narrowed) is None  # same address, another layout


@pytest.mark.parametrize("seed", range(4))
def test_the_v2_mirror_holds_what_vllms_block_tables_hold_through_requests_coming_and_going(activated, seed):
    """vLLM's real V2 ``BlockTables`` (0.33+), written through its own ``append_block_ids`` (the add-on's
    wrapper in place) with new requests, appended blocks, rows given to other requests and resumed
    requests written again (``overwrite``): after each step the mirror's rows equal vLLM's own, up to
    each row's block count; and the rows the builder reads for a step's ``req_idx`` are vLLM's."""
    from mla_prefill_ext.hosts.core.shared_prefix import block_tables, needs

    if needs.problems("plan", "V2"):
        pytest.skip(f"the path does not read the V2 runner here: {needs.problems('plan', 'V2')[0]}")
    rng = np.random.default_rng(seed)
    block_tables.forget()  # earlier tests' tables, remembered by address: this test's alone below
    tables = v2_tables(BS, max_num_reqs=8, max_blocks=32)
    live: dict[int, int] = {}
    for _ in range(40):
        v2_write_one(tables, live, rng)
        if rng.random() < 0.5:
            v2_apply(tables)
            step = np.array(sorted(live, key=lambda r: rng.random()), dtype=np.int32)
            device = v2_gather(tables, step)
            common = host.prefill_batch([1] * len(step), [1] * len(step), device, BS, req_idx=step)
            rows = block_tables.host_rows(common)
            assert rows is not None
            for batch_row, r in enumerate(step):
                n = int(tables.num_blocks.np[0, r])
                assert n == live[r]
                assert rows[batch_row, :n].tolist() == tables.block_tables[0].gpu[r, :n].tolist()
    # The mirror grows with the runner's rows and blocks, by doubling: never past twice its table.
    rows = 2 * tables.max_num_reqs
    assert 0 < block_tables.held()["mirror_bytes"] <= rows * (2 * 32) * 4 + rows * 8


def test_paused_the_plan_leaves_the_step_to_vllm_and_routing_leaves_the_threshold(
    activated, model_dirs, small_groups_pay, paused_parts
):
    """The benchmarks' pause (``scripts/bench/path_parts.py``), as they use it between calls of one
    engine: each part, paused, does what the path off does."""
    import types

    from vllm.v1.core.sched.output import SchedulerOutput

    from mla_prefill_ext.hosts.core.shared_prefix import block_tables, needs, routing

    path = _path()
    if not path.is_instrumented():
        pytest.skip(f"the shared-prefix path is not available here: {path.state().skipped_reason}")
    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    paused_parts(["plan"])
    result = run_step(cfg, layer, activated)
    assert result["shared"] is None
    assert result["projected_rows"] == result["new_tokens"] + sum(context_lens(SHARED))
    assert result["error"] <= TOLERANCE, result

    rows, ctx, q = _short_extends(prefix_blocks=256, new=128, count=16, shared=True)
    if not needs.problems("plan", "V2"):  # V2: the builder decides, from its step's metadata
        builder = make_builder(cfg, [layer], None)
        builder.reorder_batch_threshold = 512
        tables = v2_tables(BS, max_num_reqs=16, max_blocks=rows.shape[1])
        req_idx = np.arange(16, dtype=np.int32)[::-1].copy()
        for r, row in zip(req_idx, rows, strict=True):
            tables.append_block_ids(int(r), (row.tolist(),), True)
        v2_apply(tables)
        common = host.prefill_batch(q.tolist(), ctx.tolist(), v2_gather(tables, req_idx), BS, req_idx=req_idx)
        decided = []
        for parts in ((), ["route"], ["plan"]):
            paused_parts(parts)
            decided.append(routing.builder_threshold(builder, common, block_tables.host_rows(common)))
        assert decided == [1, None, None]
    if needs.problems("plan", "V1") or needs.problems("route", "V1"):
        return  # no V1 runner here
    batch = _input_batch([(list(r), int(c), int(c + n)) for r, c, n in zip(rows, ctx, q, strict=True)])
    scheduled = {f"r{i}": int(n) for i, n in enumerate(q)}
    runner = types.SimpleNamespace(reorder_batch_threshold=512, input_batch=batch, _mla_shared_routing=True)
    seen = []

    def reorder(scheduler_output):
        seen.append(runner.reorder_batch_threshold)

    step = SchedulerOutput.make_empty()
    step.num_scheduled_tokens = scheduled
    step.total_num_scheduled_tokens = sum(scheduled.values())
    usable = routing._USABLE.is_set()
    routing.mark_usable()
    try:
        paused_parts(())
        routing.may_reorder_batch(reorder, runner, (step,), {})
        paused_parts(["route"])
        routing.may_reorder_batch(reorder, runner, (step,), {})
        paused_parts(["plan"])  # a routed step needs its plan: routing pauses with it
        routing.may_reorder_batch(reorder, runner, (step,), {})
    finally:
        if not usable:
            routing._USABLE.clear()
    assert seen == [1, 512, 512] and runner.reorder_batch_threshold == 512
    assert [shape[2] for shape in list(routing.SHAPES)[-3:]] == [True, False, False]  # routed, then not
