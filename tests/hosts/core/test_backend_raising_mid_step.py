"""A backend that raises mid-run: its own exception reaches vLLM's caller with one note, nothing falls back.

On the host this vLLM has (0.20.2: the patch; 0.25.1, 0.33.0, 0.34.0: the bridge): vLLM's real MLA
layer, metadata builder and ``forward_mha`` on the CPU (``mla_layer_on_cpu``), two steps (the second
over cached context, in several chunks), with CUSTOM registered to ``custom_backends.RaisingSDPABackend``
(TORCH_SDPA raising on its Nth call) and selected as a user would. A clean run lists the calls; each
case then makes one of them the Nth and fails there. The shared-prefix path's calls are checked in
test_shared_prefix_path.py; examples/failing_backend.py (the GPU check's backend) in the last test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from custom_backends import RaisingSDPABackend
from mla_layer_on_cpu import (
    CHUNK_WORKSPACE,
    SeededRequests,
    activate_on_this_vllm,
    build_layer,
    cpu_step_kernels,
    make_builder,
    recording,
)

from mla_prefill_ext.testing import vllm_host as host

STEPS = [([37, 20], [0, 0]), ([9, 5, 7], [37, 20, 0])]  # (new tokens, cached context) per request
NOTED_AS = "RAISING_SDPA (custom_backends.RaisingSDPABackend) raised in "


@pytest.fixture
def raising(clean_selection: pytest.MonkeyPatch) -> Any:
    """vLLM's MLA module with the add-on active, CUSTOM registered to the raising backend and chosen."""
    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend

    module = activate_on_this_vllm(clean_selection)
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "custom_backends.RaisingSDPABackend")
    clean_selection.setenv("MLA_PREFILL_BACKEND", "CUSTOM")
    RaisingSDPABackend.arm(None)
    yield module
    RaisingSDPABackend.arm(None)


def two_steps(mla_module: Any, model_dirs: dict) -> None:
    """Both steps through vLLM's builder and ``forward_mha``, on a layer built for this run."""
    from vllm.config import set_current_vllm_config

    cfg = host.make_vllm_config(model_dirs["yarn"])
    layer = build_layer(cfg, None)
    builder = make_builder(cfg, [layer], None)
    builder.chunked_prefill_workspace_size = CHUNK_WORKSPACE  # step 2's context in several chunks
    layer.impl.dcp_world_size = 1  # what MLAAttention.forward_impl sets before calling forward_mha
    inputs = SeededRequests(layer, [c + n for c, n in zip(STEPS[1][1], STEPS[1][0], strict=True)])
    for new_lens, ctx_lens in STEPS:
        batch = inputs.batch(new_lens, ctx_lens)
        with cpu_step_kernels(mla_module), host.gpu_view(None), set_current_vllm_config(cfg):
            metadata = builder.build(0, batch)
            q, kv_c, k_pe, output, _ = inputs.step(new_lens, ctx_lens, batch.slot_mapping)
            layer.impl.forward_mha(q, kv_c, k_pe, inputs.cache, metadata, torch.ones(()), output=output)
        assert torch.isfinite(output).all()


def clean_calls(mla_module: Any, model_dirs: dict) -> list[tuple[str, str]]:
    RaisingSDPABackend.arm(None)
    two_steps(mla_module, model_dirs)
    calls = [(method, what) for method, what, _ in RaisingSDPABackend.calls]
    assert all(outcome == "returned" for _, _, outcome in RaisingSDPABackend.calls)
    return calls


# The call made to raise, found in the clean run: (method, which of its calls, what the note says).
CASES = {
    "step 2's new tokens": ("run_prefill_new_tokens", -1, "run_prefill_new_tokens (q ["),
    "a context chunk": ("run_prefill_context_chunk", 1, "run_prefill_context_chunk, context chunk 1 (q ["),
    "step 2's preparation": ("prepare_metadata", -1, "prepare_metadata (the step)."),
}


@pytest.mark.parametrize("case", CASES)
def test_a_backend_raising_on_its_nth_call_stops_the_forward_with_its_own_exception_named_once(
    raising, model_dirs, case
):
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    method, which, said = CASES[case]
    calls = clean_calls(raising, model_dirs)
    print(case, "- the clean run's calls:", calls)
    n = [i for i, (m, _) in enumerate(calls, 1) if m == method][which]
    assert n > 1  # the backend has served before it fails

    RaisingSDPABackend.arm(n)
    with recording(TorchSDPAPrefillBackend, method) as ran, pytest.raises(RuntimeError) as info:
        two_steps(raising, model_dirs)
    error = info.value
    assert error is RaisingSDPABackend.raised[0]  # the backend's own exception, unwrapped and unchanged
    assert str(error) == f"RAISING_SDPA: call {n} ({method}) fails, as asked"
    notes = getattr(error, "__notes__", [])
    print(case, "- the note:", notes)
    assert len(notes) == 1 and notes[0].startswith(f"mla-prefill-ext: MLA prefill backend {NOTED_AS}")
    assert said in notes[0] and "No other backend takes over" in notes[0]
    # The N-1 calls before it ran as in the clean run and returned; nothing ran after it (no retry).
    made = RaisingSDPABackend.calls
    assert [(m, w) for m, w, _ in made] == calls[:n]
    assert [outcome for _, _, outcome in made] == ["returned"] * (n - 1) + ["raised"]
    # No other instance of TORCH_SDPA (the CPU's automatic choice) ran the failed call in its place.
    assert len(ran) == sum(m == method for m, _, _ in made) - 1


def test_the_note_names_the_chunk_vllm_was_running(raising, model_dirs):
    """Each context chunk's failure says which chunk: the index vLLM gave (or its chunk object's)."""
    calls = clean_calls(raising, model_dirs)
    chunks = [i for i, (m, _) in enumerate(calls, 1) if m == "run_prefill_context_chunk"]
    assert len(chunks) >= 2
    for index, n in enumerate(chunks):
        RaisingSDPABackend.arm(n)
        with pytest.raises(RuntimeError) as info:
            two_steps(raising, model_dirs)
        (note,) = info.value.__notes__
        assert f"{NOTED_AS}run_prefill_context_chunk, context chunk {index} (q [" in note, note


def test_the_failing_example_stops_on_its_nth_call_as_the_gpu_check_reads_it(
    raising, model_dirs, clean_selection, tmp_path
):
    """examples/failing_backend.py, registered as CUSTOM as scripts/gpu_failing_backend_suite.sh does:
    its Nth call (the first context chunk) raises with the note naming it; its count file holds the
    N-1 calls before, as a clean run made them, and no kernel ran the Nth or anything after it."""
    from pathlib import Path

    from mla_prefill_ext import MLAPrefillBackendEnum, register_mla_prefill_backend
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    clean_selection.syspath_prepend(str(Path(__file__).parents[3] / "examples"))
    from failing_backend import FailingPrefillBackend

    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, "failing_backend.FailingPrefillBackend")

    def run(fail_at: int, count_file: Path) -> list[str]:
        clean_selection.setenv("MLA_PREFILL_COUNT_FILE", str(count_file))  # one file per run
        clean_selection.setenv("MLA_PREFILL_FAIL_AT", str(fail_at))
        FailingPrefillBackend.calls_made = 0
        two_steps(raising, model_dirs)
        return [line.split(" ", 1)[1] for line in count_file.read_text().splitlines()]

    clean = run(10_000, tmp_path / "clean.txt")
    n = clean.index("context_chunk 0") + 1
    assert n > 1  # the backend has served before it fails
    with (
        recording(TorchSDPAPrefillBackend, "run_prefill_new_tokens") as new_tokens,
        recording(TorchSDPAPrefillBackend, "run_prefill_context_chunk") as chunks,
        pytest.raises(RuntimeError, match=rf"^FAILING: prefill call {n} \(context chunk 0\) fails") as info,
    ):
        run(n, tmp_path / "failing.txt")
    (note,) = info.value.__notes__
    assert (
        "mla-prefill-ext: MLA prefill backend FAILING (failing_backend.FailingPrefillBackend) raised in "
        "run_prefill_context_chunk, context chunk 0 (q [" in note
    ), note
    assert FailingPrefillBackend.calls_made == n
    recorded = [line.split(" ", 1)[1] for line in (tmp_path / "failing.txt").read_text().splitlines()]
    assert recorded == clean[: n - 1]
    # The built-in kernel under it ran the N-1 calls: not the Nth in its place, nothing after.
    assert len(new_tokens) + len(chunks) == n - 1
