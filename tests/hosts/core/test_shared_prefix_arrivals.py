"""An idle engine core gathers a burst of requests over a shared prefix into one step (arrivals.py).

The loop's timing with a real queue and a producer thread; the decision with vLLM's real configuration;
the wrapper on vLLM's real ``EngineCoreProc._process_input_queue``, ``_handle_client_request`` and
scheduler (an engine core process without its executor and sockets: only what those read is set).
"""

from __future__ import annotations

import collections
import json
import queue
import random
import threading
import time

import pytest

from mla_prefill_ext.hosts.core.shared_prefix import arrivals, counters, engine_core
from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher

BLOCK = 16


def _producer(q: queue.Queue, items: list, gaps_s: list[float]) -> threading.Thread:
    def run():
        for item, gap in zip(items, gaps_s, strict=True):
            time.sleep(gap)
            q.put(item)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _gather(q: queue.Queue, window_s: float, activity: arrivals.InputActivity) -> tuple[list, float]:
    got: list = []

    def handle(item) -> bool:
        got.append(item)
        return item != "utility"  # anything but a request ends the burst

    t = time.monotonic()
    arrivals.gather(lambda timeout: q.get(timeout=timeout), handle, window_s, lambda: True, activity.idle_s)
    return got, time.monotonic() - t


def test_a_queued_burst_is_taken_and_the_gathering_ends_when_the_input_thread_is_quiet():
    q: queue.Queue = queue.Queue()
    _producer(q, list(range(10)), [0.0005] * 10).join()  # all there before the gathering
    got, took = _gather(q, 0.5, arrivals.InputActivity())
    assert got == list(range(10))
    assert took < 0.1  # it ended when the queue was empty and the input thread quiet, not at the window


def test_a_call_that_is_not_a_request_ends_the_burst():
    q: queue.Queue = queue.Queue()
    for item in (1, 2, "utility", 3):
        q.put(item)
    got, _ = _gather(q, 0.5, arrivals.InputActivity())
    assert got == [1, 2, "utility"] and q.get_nowait() == 3


def _input_thread(
    q: queue.Queue, activity: arrivals.InputActivity, n: int, busy_s: float, stop: threading.Event
) -> threading.Thread:
    """Like vLLM's input thread over a burst already sent: each request preprocessed for ``busy_s``
    (stamped as the wrapper stamps it), then queued. The first beginning is stamped before the thread
    starts (the gathering must not begin before it)."""
    activity.began()

    def run():
        for i in range(n):
            if i:
                activity.began()
            time.sleep(busy_s)
            activity.ended()
            q.put(i)
            if stop.is_set():
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_quiet_gap_is_timed_from_the_input_thread(monkeypatch):
    """Items far apart (each preprocessed longer than the quiet gap) are one burst while the input
    thread is at work on the next; once it is quiet with nothing queued, the gathering ends."""
    monkeypatch.setattr(arrivals, "QUIET_S", 0.1)
    q: queue.Queue = queue.Queue()
    activity = arrivals.InputActivity()
    q.put("first")  # taken by vLLM's own wait; the input thread goes on with the rest
    thread = _input_thread(q, activity, 3, 0.25, threading.Event())
    got, took = _gather(q, 5.0, activity)
    thread.join()
    assert got == ["first", 0, 1, 2]
    assert took < 2.5  # ended one quiet gap after the last, far from the window


def test_the_window_bounds_a_burst_that_keeps_coming(monkeypatch):
    monkeypatch.setattr(arrivals, "QUIET_S", 0.05)
    q: queue.Queue = queue.Queue()
    activity = arrivals.InputActivity()
    stop = threading.Event()
    thread = _input_thread(q, activity, 20, 0.1, stop)  # 2 s of requests
    got, took = _gather(q, 0.35, activity)
    stop.set()
    thread.join()
    assert 1 <= len(got) <= 5 and took < 1.0


@pytest.fixture
def core_config(model_dirs, clean_selection):
    """An MLA model's configuration (prefix caching on) and vLLM's real scheduler for it."""
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX", raising=False)
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", raising=False)
    clean_selection.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the path serves (0.33: V2 default)
    from vllm_scheduler_objects import scheduler

    from mla_prefill_ext.testing import vllm_host as host

    config = host.make_vllm_config(model_dirs["yarn"])
    config.cache_config.enable_prefix_caching = True
    return config, scheduler(config, num_blocks=4096, block_size=BLOCK)


def test_the_window_is_on_with_the_path_and_says_why_not(core_config, clean_selection):
    config, _ = core_config
    assert arrivals.decide(config) == (
        0.1,
        "up to 100 ms (MLA_PREFILL_SHARED_PREFIX_GATHER_MS=0 turns it off)",
    )
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "25")
    assert arrivals.decide(config) == (0.025, "up to 25 ms (MLA_PREFILL_SHARED_PREFIX_GATHER_MS)")
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "5")
    assert arrivals.decide(config) == (0.005, "up to 5 ms (MLA_PREFILL_SHARED_PREFIX_GATHER_MS)")
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "0")
    assert arrivals.decide(config) == (0.0, "turned off by MLA_PREFILL_SHARED_PREFIX_GATHER_MS")
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "soon")
    with pytest.raises(ValueError, match="MLA_PREFILL_SHARED_PREFIX_GATHER_MS='soon' is not a window"):
        arrivals.decide(config)
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "25")
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX", "0")
    window, reason = arrivals.decide(config)
    assert window == 0.0 and reason.startswith("the shared-prefix path is off: turned off by")
    clean_selection.delenv("MLA_PREFILL_SHARED_PREFIX")
    config.parallel_config.data_parallel_size = 2  # with a window set
    try:
        assert arrivals.decide(config) == (0.0, "data parallelism is on (its engines step together)")
    finally:
        config.parallel_config.data_parallel_size = 1


def _hasher():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    factory = getattr(kv_cache_utils.get_request_block_hasher, "__wrapped__", None)
    factory = factory or kv_cache_utils.get_request_block_hasher
    return ReusingHasher(factory(BLOCK, hash_fn), BLOCK)


def _request(tokens: list[int], hasher) -> object:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=f"r{random.random()}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=hasher,
    )


def test_only_requests_that_took_a_long_shared_prefix_count():
    hasher = _hasher()
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(arrivals.MIN_SHARED_TOKENS)]
    donor = _request(prefix + [1] * BLOCK, hasher)
    sharing = _request(prefix + [2] * BLOCK, hasher)
    short = _request(prefix[: arrivals.MIN_SHARED_TOKENS - BLOCK] + [3] * BLOCK, hasher)
    assert not arrivals.shares_a_prefix(hasher, {donor.request_id: donor})  # it took nothing
    assert arrivals.shares_a_prefix(hasher, {sharing.request_id: sharing})
    assert not arrivals.shares_a_prefix(hasher, {short.request_id: short})  # below the minimum
    assert not arrivals.shares_a_prefix(hasher.inner, {sharing.request_id: sharing})  # vLLM's hasher


@pytest.fixture
def proc_class():
    """vLLM's ``EngineCoreProc`` with the engine core's wrappers on (and off again after)."""
    import importlib

    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE

    core = importlib.import_module(VLLM_ENGINE_CORE_MODULE)
    engine_core.INSTRUMENTOR.uninstrument(core)
    assert engine_core.arrival_problem() is None
    assert engine_core.INSTRUMENTOR.instrument(core), engine_core.INSTRUMENTOR.report()["problem"]
    yield core
    engine_core.INSTRUMENTOR.uninstrument(core)


def _idle_proc(core, config, scheduler, hasher):
    """An idle engine core process as ``EngineCoreProc.__init__`` leaves it, minus executor and sockets."""
    proc = object.__new__(core.EngineCoreProc)
    proc.vllm_config = config
    proc.scheduler = scheduler
    proc.request_block_hasher = hasher
    proc.engines_running = False
    proc.batch_queue = None
    proc.shutdown_state = core.EngineShutdownState.RUNNING
    proc.input_queue = queue.Queue()
    proc.aborts_queue = queue.Queue()
    proc.process_input_queue_block = True
    proc._idle_state_callbacks = []
    proc.reject_new_requests = False  # vLLM 0.33: not paused
    proc.mm_receiver_cache = None
    proc._deferred_inputs = collections.deque()  # vLLM 0.34: inputs a step put off, handled first
    proc.prefix_hash_config = None  # vLLM 0.34 (preprocess_add_request): no hashes from the front end
    return proc


def _burst(proc, prompts, gap_s, hold: threading.Event | None = None):
    """vLLM's input thread over a burst: each prompt (``gap_s`` apart) decoded as an
    ``EngineCoreRequest``, preprocessed by the engine core's own (wrapped) ``preprocess_add_request``
    and queued; the request ids, in order. With ``hold``: the requests after the first only once it is
    set (a late request that a slow busy loop on a loaded machine cannot find queued with the first)."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm_scheduler_objects import engine_core_request

    ids = [f"burst{random.random()}" for _ in prompts]

    def run():
        try:
            for i, (rid, tokens) in enumerate(zip(ids, prompts, strict=True)):
                if i:
                    time.sleep(gap_s)
                    if hold is not None:
                        hold.wait()
                request = engine_core_request(rid, tokens)
                proc.input_queue.put_nowait((EngineCoreRequestType.ADD, proc.preprocess_add_request(request)))
        except BaseException:
            # A wake-up, so that vLLM's wait (blocking) returns and the test fails instead of hanging.
            proc.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
            raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, ids


GAP_S = (
    0.05  # between a burst's requests; the quiet gap made longer below, so a loaded machine cannot split it
)
LONG_QUIET_S = 0.2


@pytest.fixture
def opted_in(clean_selection, monkeypatch):
    """A 1000 ms window and the longer quiet gap: a loaded machine cannot end a burst early."""
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "1000")
    monkeypatch.setattr(arrivals, "QUIET_S", LONG_QUIET_S)


def _wait_then_release(proc, prompts) -> list[str]:
    """vLLM's wait for work (wrapped) while the first prompt arrives; the rest are held until it
    returned (a late request a slow busy loop cannot find queued with the first). The request ids."""
    hold = threading.Event()
    producer, ids = _burst(proc, prompts, GAP_S, hold)
    proc._process_input_queue()
    hold.set()
    producer.join()
    return ids


@pytest.mark.parametrize("window_ms", ["1000", "0"])
def test_an_idle_engine_core_takes_a_shared_prefix_burst_into_one_step(
    proc_class, core_config, clean_selection, monkeypatch, window_ms
):
    config, scheduler = core_config
    monkeypatch.setattr(arrivals, "QUIET_S", LONG_QUIET_S)
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", window_ms)
    hasher = _hasher()
    rng = random.Random(1)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    # An earlier request over the prefix, finished: the burst's first hashes it again, and shares.
    _request(prefix + [0] * BLOCK, hasher)
    burst = [prefix + [i + 1] * BLOCK for i in range(8)]
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    gathers = counters.get("gathers")
    producer, ids = _burst(proc, burst, GAP_S)
    proc._process_input_queue()  # vLLM's wait for work, as its busy loop calls it
    producer.join()
    taken = len(scheduler.requests)
    if window_ms != "1000":  # vLLM's behaviour: the step starts with what had arrived (the first)
        assert taken < len(burst) and counters.get("gathers") == gathers
    else:
        assert taken == len(burst) and counters.get("gathers") == gathers + 1
        assert set(scheduler.requests) == set(ids)


def test_a_request_sharing_nothing_is_never_held(proc_class, core_config, opted_in):
    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(2)
    lone = [rng.randrange(1000) for _ in range(4096)]
    late = [rng.randrange(1000) for _ in range(64)]
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    gathers = counters.get("gathers")
    ids = _wait_then_release(proc, [lone, late])
    assert list(scheduler.requests) == ids[:1] and counters.get("gathers") == gathers


def test_a_busy_engine_core_takes_new_requests_as_vllm_does(proc_class, core_config, opted_in):
    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(3)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [9] * BLOCK, hasher)  # noqa: F841 (the hashes' donor; in flight, it lends)
    running = _request(prefix + [0] * BLOCK, hasher)  # it shares the prefix, and it is running:
    scheduler.add_request(running)  # the engine has work, nothing to gather for
    later = [prefix + [i + 1] * BLOCK for i in range(4)]
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    gathers = counters.get("gathers")
    _wait_then_release(proc, later)
    # The running request and at most the first of the later ones (put as the call began).
    assert counters.get("gathers") == gathers and len(scheduler.requests) <= 2


def test_only_the_requests_the_wait_took_decide(proc_class, core_config, opted_in):
    """A request the idle scheduler still holds (finished, its KV cache kept for a transfer) shared a
    prefix once; a new request sharing nothing does not make the engine core wait."""
    from vllm.v1.request import RequestStatus

    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(4)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [0] * BLOCK, hasher)  # noqa: F841 (the hashes' donor; in flight, it lends)
    kept = _request(prefix + [1] * BLOCK, hasher)  # it took the prefix's hashes
    kept.status = RequestStatus.FINISHED_STOPPED
    scheduler.requests[kept.request_id] = kept  # held, not running: the engine core is idle
    lone = [rng.randrange(1000) for _ in range(4096)]
    late = [rng.randrange(1000) for _ in range(64)]
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    assert not proc.has_work()
    gathers = counters.get("gathers")
    ids = _wait_then_release(proc, [lone, late])
    assert list(scheduler.requests) == [kept.request_id, ids[0]]
    assert counters.get("gathers") == gathers


# A vLLM whose engine core process hands a client call to another method: a row of the gathering's
# table (needs.py) that does not hold.
OTHER_HANDLER = "vllm.v1.engine.core.EngineCoreProc._handle_client_request lacks parameters ['request_type']"


def _other_handler(monkeypatch, proc_cls) -> None:
    monkeypatch.setattr(proc_cls, "_handle_client_request", lambda self, kind, request: None)


def test_a_busy_loop_of_another_shape_keeps_the_reuse_and_says_why_not_the_gathering(monkeypatch, addon_log):
    """The gathering's shape (its rows of needs.py) is checked apart from the block-hash and lookup
    reuse's."""
    import importlib
    import logging

    from mla_prefill_ext.hosts import VLLM_ENGINE_CORE_MODULE

    logging.getLogger("vllm.mla_prefill_ext").setLevel(logging.INFO)
    core = importlib.import_module(VLLM_ENGINE_CORE_MODULE)
    engine_core.INSTRUMENTOR.uninstrument(core)
    _other_handler(monkeypatch, core.EngineCoreProc)
    try:
        assert engine_core.arrival_problem() == OTHER_HANDLER
        assert engine_core.INSTRUMENTOR.instrument(core)
        paths = {path for path, _ in engine_core.INSTRUMENTOR.state().wrappers.handles}
        assert engine_core.FACTORY in paths and engine_core.KV_INIT in paths
        assert arrivals.TARGET not in paths and arrivals.INPUT_TARGET not in paths
        report = engine_core.INSTRUMENTOR.report()
        assert report["instrumented"] and report["gather_problem"] == OTHER_HANDLER
        assert any(
            "steps at its first request as vLLM does" in r.getMessage() and OTHER_HANDLER in r.getMessage()
            for r in addon_log
        )
    finally:
        engine_core.INSTRUMENTOR.uninstrument(core)


def test_an_invalid_window_stops_an_mla_engine_core_at_start(
    proc_class, core_config, clean_selection, tmp_path, monkeypatch
):
    """Checked where EngineCore.__init__ calls ``_initialize_kv_caches(config)``, before any request
    (here an engine core without an executor: vLLM's method stops right after the wrapper); an engine
    of another model is not the add-on's to stop."""
    from vllm_configs import LLAMA_CONFIG

    from mla_prefill_ext.hosts.core.shared_prefix import prefix_hits
    from mla_prefill_ext.testing import vllm_host as host

    config, _ = core_config
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "soon")
    engine = object.__new__(proc_class.EngineCore)
    try:
        with pytest.raises(RuntimeError, match="mla-prefill-ext: MLA_PREFILL_SHARED_PREFIX_GATHER_MS='soon'"):
            engine._initialize_kv_caches(config)
        assert getattr(engine_core._LOCAL, "config", None) is None  # nothing noted for a hasher
        llama = tmp_path / "tiny-llama"
        llama.mkdir()
        (llama / "config.json").write_text(json.dumps(LLAMA_CONFIG))
        not_mla = host.make_vllm_config(llama)
        assert not not_mla.model_config.use_mla
        with pytest.raises(AttributeError):  # into vLLM's own method
            engine._initialize_kv_caches(not_mla)
        clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "40")
        with pytest.raises(AttributeError):  # valid: into vLLM's own method
            engine._initialize_kv_caches(config)
        # A busy loop of another shape: no gathering there, so its window stops nothing.
        clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "soon")
        engine_core.INSTRUMENTOR.uninstrument(proc_class)
        _other_handler(monkeypatch, proc_class.EngineCoreProc)
        assert engine_core.INSTRUMENTOR.instrument(proc_class)
        assert engine_core.INSTRUMENTOR.report()["gather_problem"]
        with pytest.raises(AttributeError):
            engine._initialize_kv_caches(config)
    finally:
        engine_core._LOCAL.config = None
        prefix_hits.collect(False)


def test_a_request_that_fails_preprocessing_leaves_the_input_thread_quiet(proc_class, core_config):
    config, scheduler = core_config
    proc = _idle_proc(proc_class, config, scheduler, None)
    began = time.monotonic()
    with pytest.raises(AttributeError):  # vLLM's own preprocessing of something that is no request
        proc.preprocess_add_request(None)
    activity = arrivals._activity(proc)
    assert activity.busy == 0 and activity.last >= began


def test_a_call_other_than_a_request_ends_the_gathering(proc_class, core_config, opted_in, monkeypatch):
    """A utility call, an abort or a wake-up within a burst is handled as vLLM would, and the burst's
    step starts after it (a collective_rpc is not held back behind the rest of a burst)."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm_scheduler_objects import engine_core_request

    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(5)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [0] * BLOCK, hasher)  # noqa: F841 (the hashes' donor; in flight, it lends)
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    gathering = threading.Event()
    real_gather = arrivals.gather

    def gather(*args):
        gathering.set()
        return real_gather(*args)

    monkeypatch.setattr(arrivals, "gather", gather)
    ids = [f"call{i}" for i in range(3)]

    def add(i: int) -> None:  # as vLLM's input thread does: preprocess (stamped), then queue
        request = engine_core_request(ids[i], prefix + [i + 1] * BLOCK)
        proc.input_queue.put_nowait((EngineCoreRequestType.ADD, proc.preprocess_add_request(request)))

    def input_thread():
        add(0)  # taken by vLLM's own wait
        gathering.wait()
        add(1)
        proc.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        add(2)

    producer = threading.Thread(target=input_thread, daemon=True)
    producer.start()
    gathers = counters.get("gathers")
    proc._process_input_queue()
    producer.join()
    assert set(scheduler.requests) == set(ids[:2]) and counters.get("gathers") == gathers + 1
    assert proc.input_queue.get_nowait()[1][0].request_id == ids[2]  # left for the next wait


def test_an_engine_core_with_vllms_hasher_never_waits(proc_class, core_config, clean_selection):
    """vLLM's own hasher (not an MLA model, the path off, hashes that look ahead): no window read,
    nothing gathered."""
    config, scheduler = core_config
    clean_selection.setenv("MLA_PREFILL_SHARED_PREFIX_GATHER_MS", "1000")
    hasher = _hasher()
    rng = random.Random(6)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [0] * BLOCK, hasher)  # noqa: F841 (the hashes' donor; in flight, it lends)
    proc = _idle_proc(proc_class, config, scheduler, hasher.inner)
    producer, _ = _burst(proc, [prefix + [i + 1] * BLOCK for i in range(3)], 0.0)
    producer.join()
    gathers = counters.get("gathers")
    proc._process_input_queue()
    assert counters.get("gathers") == gathers and "_mla_gather_s" not in proc.__dict__


def test_an_engine_core_whose_hash_reuse_turned_off_never_waits(proc_class, core_config, opted_in):
    """A reusing hasher turned off (its first reuse differed from vLLM's hashes): its record of sharing
    is not trusted, the engine core steps at its first request as vLLM's."""
    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(7)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [0] * BLOCK, hasher)  # noqa: F841 (the hashes' donor; in flight, it lends)
    hasher._turn_off("a test says so")
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    gathers = counters.get("gathers")
    ids = _wait_then_release(proc, [prefix + [i + 1] * BLOCK for i in range(3)])
    assert list(scheduler.requests) == ids[:1] and counters.get("gathers") == gathers
    assert "_mla_gather_s" not in proc.__dict__  # nothing to wait for: the window not even read
    assert not arrivals.shares_a_prefix(hasher, set(ids))


def test_an_engine_core_without_what_the_gathering_reads_runs_as_vllms(proc_class, core_config, opted_in):
    """An engine core process of another shape at run time (here without the input queue the wrapper
    takes a burst from): vLLM's own wait alone, nothing gathered, also when the wait took a request
    that shares a prefix."""
    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(8)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [0] * BLOCK, hasher)  # noqa: F841 (the hashes' donor; in flight, it lends)
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    del proc.input_queue
    sharing = _request(prefix + [1] * BLOCK, hasher)

    def wait():  # vLLM's wait, taking one request over the shared prefix
        scheduler.add_request(sharing)

    gathers = counters.get("gathers")
    arrivals.process_input_queue(wait, proc, (), {})
    assert list(scheduler.requests) == [sharing.request_id] and counters.get("gathers") == gathers


def test_paused_an_idle_engine_core_steps_at_its_first_request(
    proc_class, core_config, opted_in, paused_parts
):
    config, scheduler = core_config
    hasher = _hasher()
    rng = random.Random(3)
    prefix = [rng.randrange(1000) for _ in range(4096)]
    donor = _request(prefix + [0] * BLOCK, hasher)  # noqa: F841 (the donor: the burst below would be gathered; in flight, it lends)
    paused_parts(["gather"])
    proc = _idle_proc(proc_class, config, scheduler, hasher)
    gathers = counters.get("gathers")
    ids = _wait_then_release(proc, [prefix + [i + 1] * BLOCK for i in range(3)])
    assert list(scheduler.requests) == ids[:1] and counters.get("gathers") == gathers
    assert hasher.reused_blocks > 0  # the hashes are another part: still reused
