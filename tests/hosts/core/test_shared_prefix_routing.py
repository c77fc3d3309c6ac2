"""The router's per-step record: what each step the runner reorders held, for the engine benchmark."""

from __future__ import annotations

import types

from vllm.v1.core.sched.output import SchedulerOutput

from mla_prefill_ext.hosts.core.shared_prefix import counters, routing


def _step(tokens: dict[str, int]) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()  # vLLM's own class, only the step's token counts filled in
    out.num_scheduled_tokens = dict(tokens)
    out.total_num_scheduled_tokens = sum(tokens.values())
    return out


def test_every_reordered_step_is_recorded_with_its_requests_and_tokens():
    calls = []
    runner = types.SimpleNamespace(reorder_batch_threshold=None)  # a backend without a decode split
    steps = counters.get("steps")
    for tokens in ({"a": 129}, {"b": 128, "c": 128, "d": 1}, {}):
        routing.may_reorder_batch(lambda *a, **k: calls.append(a), runner, (_step(tokens),), {})
    assert len(calls) == 3  # vLLM's reorder ran each time
    assert counters.get("steps") == steps + 3
    assert list(routing.SHAPES)[-3:] == [(1, 129, False), (3, 257, False), (0, 0, False)]


def test_the_record_keeps_the_last_256_steps():
    runner = types.SimpleNamespace(reorder_batch_threshold=None)
    for i in range(300):
        routing.may_reorder_batch(lambda *a, **k: None, runner, (), {"scheduler_output": _step({"r": i + 1})})
    assert len(routing.SHAPES) == 256
    assert routing.SHAPES[-1] == (1, 300, False) and routing.SHAPES[0] == (1, 45, False)
