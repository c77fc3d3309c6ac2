"""The V2 runner's graph choice for a decode step the shared-prefix decode serves (vLLM 0.33+).

A step of one-token decodes replays vLLM's full decode graph, inside which the path cannot serve its rows;
``decode_rows.uniform_unless_served`` wraps ``GPUModelRunner.gather_batch_req_state`` and drops the uniform
decode token count of a step whose rows hold a group worth a shared call, so that vLLM dispatches it to its
piecewise graphs. Here: the runner's real ``BlockTables`` written through the real (wrapped)
``append_block_ids``, vLLM's real ``BatchReqState``. The runner itself cannot be built without a GPU: a
double holds the four attributes the decision reads (``block_tables``, ``cache_config``, ``vllm_config``, and
its ``__dict__`` for the per-runner decision), and ``wrapped`` stands for vLLM's method, returning its pair.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
from mla_layer_on_cpu import activate_on_this_vllm
from vllm_runner_objects import v2_tables

from mla_prefill_ext.testing import vllm_host as host

BS = 64
PREFIX_BLOCKS = 512  # 32k tokens: the measured crossover's prefix
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


@pytest.fixture
def runner(clean_selection, model_dirs):
    """A V2 runner's block tables holding 64 requests over one 32k prefix, the decode rows turned on."""
    from mla_prefill_ext.hosts.core.shared_prefix import needs

    clean_selection.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    clean_selection.setenv("MLA_PREFILL_SHARED_DECODE", "1")
    activate_on_this_vllm(clean_selection)
    missing = needs.problems("decode", needs.V2) + needs.problems("plan", needs.V2)
    if missing:
        pytest.skip(f"no V2 runner the path serves here: {missing[0]}")
    from mla_prefill_ext.hosts.core.shared_prefix import decode_rows

    # What its post-import hook does when the variable is set at import; forward_mqa's module needs FA3's
    # extension (absent on a CPU), so the decision's "served" is taken as given for that part.
    path = importlib.import_module("mla_prefill_ext.hosts.core.shared_prefix.instrumentor").INSTRUMENTOR
    path._instrument_decode("V2", importlib.import_module(V2_RUNNER))
    assert decode_rows.WRAP_PROBLEMS["V2"] is None
    clean_selection.setitem(decode_rows.WRAP_PROBLEMS, "any", None)
    tables = v2_tables(BS, max_num_reqs=128, max_blocks=PREFIX_BLOCKS + 2)
    prefix = list(range(1, PREFIX_BLOCKS + 1))
    for req in range(128):
        tables.append_block_ids(req, ([*prefix, 1000 + req],), True)  # the prefix, then a block of its own
    cfg = host.make_vllm_config(model_dirs["yarn"])
    return SimpleNamespace(block_tables=tables, cache_config=SimpleNamespace(block_size=BS), vllm_config=cfg)


def batch_state(requests: list[int]):
    module = importlib.import_module(V2_RUNNER)
    fields = dict.fromkeys(module.BatchReqState._fields)
    fields["idx_mapping_np"] = np.asarray(requests, dtype=np.intp)
    return module.BatchReqState(**fields)


def dispatch(runner, requests: list[int], uniform: int | None = 1):
    from mla_prefill_ext.hosts.core.shared_prefix import decode_rows

    state = batch_state(requests)
    return decode_rows.uniform_unless_served(lambda *a, **k: (state, uniform), runner, (None, False), {})


def test_a_step_whose_decode_rows_pay_is_dispatched_as_a_mixed_batch(runner):
    from mla_prefill_ext.hosts.core.shared_prefix import counters

    before = counters.get("steps_dispatched_piecewise")
    state, uniform = dispatch(runner, list(range(100, 36, -1)))  # 64 rows, any runner slots
    assert uniform is None and list(state.idx_mapping_np[:2]) == [100, 99]
    assert counters.get("steps_dispatched_piecewise") == before + 1


@pytest.mark.parametrize(
    ("requests", "uniform"),
    [
        (list(range(32)), 1),  # 32 rows: below the crossover, vLLM's full decode graph
        (list(range(64)), 2),  # two tokens a row (speculative decoding): not a one-token step
        (list(range(64)), None),  # not a uniform decode step: vLLM's choice already
    ],
)
def test_other_steps_keep_vllms_choice(runner, requests, uniform):
    assert dispatch(runner, requests, uniform)[1] == uniform


def test_rows_with_no_mirror_or_a_fault_keep_vllms_choice(runner, caplog):
    runner.block_tables = v2_tables(BS)  # never written: nothing mirrored
    assert dispatch(runner, list(range(64)))[1] == 1
    del runner.cache_config  # a runner without the attribute read: logged once, vLLM's result stands
    runner.block_tables = v2_tables(BS, max_num_reqs=128, max_blocks=PREFIX_BLOCKS + 2)
    for req in range(64):
        runner.block_tables.append_block_ids(req, ([*range(1, PREFIX_BLOCKS + 1), 1000 + req],), True)
    assert dispatch(runner, list(range(64)))[1] == 1


def test_an_engine_without_decode_rows_keeps_vllms_choice(runner, clean_selection):
    clean_selection.setenv("MLA_PREFILL_SHARED_DECODE", "0")
    runner.__dict__.pop("_mla_shared_decode", None)  # the per-runner decision, taken again
    assert dispatch(runner, list(range(64)))[1] == 1
