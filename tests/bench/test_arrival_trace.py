"""The engine benchmark's arrival trace: stamps in vLLM's real ``EngineCoreProc`` methods (on a subclass
put in the module's place, so vLLM's class stays untouched) and the call's timeline from them."""

from __future__ import annotations

import importlib
import queue

import pytest

from scripts.bench import arrival_trace


def test_the_timeline_reads_each_request_in_the_order_sent_and_the_steps_after_the_first_send():
    driver = [("sent", "a", 10.000), ("sent", "b", 10.004)]
    core = [
        ("step0", None, 9.0),  # an earlier call's step: before the first send
        ("step1", None, 9.1),
        ("ready0", "a", 10.001),
        ("ready1", "a", 10.002),
        ("taken", "a", 10.0025),
        ("step0", None, 10.003),
        ("ready0", "b", 10.005),
        ("ready1", "b", 10.006),
        ("step1", None, 10.020),
        ("taken", "b", 10.021),
        ("step0", None, 10.022),
        ("step1", None, 10.030),
    ]
    trace = arrival_trace.timeline(driver, core)
    assert trace["requests"] == [[0.0, 1.0, 2.0, 2.5], [4.0, 5.0, 6.0, 21.0]]
    assert trace["steps"] == [(3.0, 20.0), (22.0, 30.0)]
    lines = arrival_trace.timeline_lines("FLASH_ATTN 2 x 10", trace)
    assert lines[0] == "FLASH_ATTN 2 x 10: sent   0.0 4.0"
    assert lines[-1] == "  steps            [3.0-20.0] [22.0-30.0]"
    assert arrival_trace.timeline([], core) == {"requests": [], "steps": []}


def _trace(taken: list[float | None], steps: list[tuple[float, float]]) -> dict:
    return {"requests": [[0.0, 0.1, 0.2, t] for t in taken], "steps": steps}


def test_a_calls_requests_arrive_in_the_first_step_that_begins_after_each_is_taken():
    steps = [(1.0, 20.0), (21.0, 30.0), (31.0, 35.0)]  # the third: a chunk's continuation, no arrival
    assert arrival_trace.arrival_split(_trace([0.5, 0.9, 0.95], steps)) == [3]
    assert arrival_trace.arrival_split(_trace([0.5, 5.0, 20.5, 0.9], steps)) == [2, 2]
    assert arrival_trace.arrival_split(_trace([1.0], steps)) == [1]  # taken as the step began: in it
    # What the trace cannot say: a request never seen taken, one taken after the last step began, none.
    assert arrival_trace.arrival_split(_trace([0.5, None], steps)) is None
    assert arrival_trace.arrival_split(_trace([0.5, 32.0], steps)) is None
    assert arrival_trace.arrival_split(_trace([0.5], [])) is None
    assert arrival_trace.arrival_split(_trace([], steps)) is None


@pytest.fixture
def traced_core(monkeypatch):
    core = importlib.import_module("vllm.v1.engine.core")
    traced = type("EngineCoreProc", (core.EngineCoreProc,), {})
    monkeypatch.setattr(core, "EngineCoreProc", traced)
    arrival_trace.take_events()
    yield core, traced
    arrival_trace.take_events()


def test_the_engine_core_stamps_a_request_ready_and_taken(traced_core, core_config):
    from vllm.v1.engine import EngineCoreRequestType
    from vllm_scheduler_objects import engine_core_request

    core, traced = traced_core
    config, scheduler = core_config
    assert arrival_trace.install_in_engine_core() and arrival_trace.install_in_engine_core()  # idempotent
    assert core.EngineCoreProc is traced and "preprocess_add_request" in traced.__dict__
    proc = object.__new__(traced)
    proc.vllm_config, proc.scheduler, proc.request_block_hasher = config, scheduler, None
    proc.prefix_hash_config = None  # vLLM 0.34+: read for frontend-computed hashes (None: the engine hashes)
    proc.mm_receiver_cache = None
    proc.shutdown_state = core.EngineShutdownState.RUNNING
    proc.reject_new_requests = False  # vLLM 0.33: not paused
    proc.input_queue, proc.aborts_queue = queue.Queue(), queue.Queue()
    request = engine_core_request("r1", list(range(40)))
    ready = proc.preprocess_add_request(request)  # vLLM's own, stamped
    proc._handle_client_request(EngineCoreRequestType.ADD, ready)
    assert list(scheduler.requests) == ["r1"]
    events = arrival_trace.take_events()
    assert [(kind, rid) for kind, rid, _ in events] == [("ready0", "r1"), ("ready1", "r1"), ("taken", "r1")]
    assert [t for *_, t in events] == sorted(t for *_, t in events)


def test_without_an_engine_core_class_there_is_nothing_to_trace(monkeypatch):
    core = importlib.import_module("vllm.v1.engine.core")
    monkeypatch.delattr(core, "EngineCoreProc")
    assert arrival_trace.install_in_engine_core() is False


@pytest.fixture
def core_config(model_dirs, clean_selection):
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm_scheduler_objects import scheduler

    from mla_prefill_ext.testing import vllm_host as host

    config = host.make_vllm_config(model_dirs["yarn"])
    config.cache_config.enable_prefix_caching = True
    return config, scheduler(config, num_blocks=256, block_size=16)
