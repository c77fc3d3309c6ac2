#!/usr/bin/env python3
"""Host time of vLLM's own handling of requests over a cached prefix, part by part, on the CPU.

    python -m scripts.bench prefix_host_cost [--requests 16] [--prefix 32768] [--private] [--new 1]
        [--block-size 64 [16 ...]] [--repeats 5] [--torch-threads 1] [--hasher stock|reuse]
        [--hits stock|reuse] [--prompts stock|reuse] [--json out.json]

What one ``LLM.generate`` call of ``--requests`` prompts (``--prefix`` tokens shared by all and
already in the prefix cache, then ``--new`` tokens of each request's own, ``max_tokens=1``) costs
vLLM 0.20.2 on the host, with vLLM's real classes and functions only, built for the CPU from a
``VllmConfig`` of the R1 TP=8 slice (scripts/bench/models/r1_tp8_slice, ``skip_tokenizer_init``,
prefix caching with its default sha256 block hash, async scheduling, 8192 batched tokens, model
length 40960), stage by stage in the order the request travels:

  driver  LLM's rendering of each ``TokensPrompt`` (``parse_model_prompt``, ``Renderer.render_cmpl``);
          ``InputProcessor.process_inputs`` and ``assign_request_id`` (``LLMEngine.add_request``);
          ``OutputProcessor.add_request``; ``MsgpackEncoder.encode`` of each ``EngineCoreRequest``
  core    ``MsgpackDecoder(EngineCoreRequest).decode``; ``Request.from_engine_core_request`` with
          the block hasher (``get_request_block_hasher``, ``init_none_hash``): what
          ``EngineCoreProc.preprocess_add_request`` does
  sched   the ``Scheduler`` class the configuration picks (``AsyncScheduler``), on a ``KVCacheConfig``
          from ``get_kv_cache_configs`` (one MLA group, 61 layers, blocks for 20 requests of the model
          length): ``add_request``, ``schedule()`` and ``update_from_output`` (a ``ModelRunnerOutput``
          with one sampled token per request: the requests finish and their blocks are freed); the
          ``KVCacheManager`` calls inside them are timed through timers around its real methods
  runner  the GPU model runner's persistent ``InputBatch`` on the CPU: ``CachedRequestState`` and
          ``add_request`` per new request, ``condense`` and ``refresh_metadata``; its ``BlockTable``'s
          ``commit_block_table``; next step, ``remove_request`` for the finished ones and ``condense``
          (``--prompts reuse``: ``add_request`` through the add-on's ``prompt_rows``, as its wrapper on
          the runner's ``_update_states`` has it: a prompt's leading tokens from the row of a request in
          the batch that holds the same KV blocks)
  back    ``MsgpackEncoder``/``MsgpackDecoder`` of the ``EngineCoreOutputs``;
          ``OutputProcessor.process_outputs`` (the ``RequestOutput``s ``generate`` returns)

Before the timed calls one request holding the prefix alone is allocated in the ``KVCacheManager``
and freed (its full blocks stay cached); every call then sends new request ids and new tokens after
the prefix, so only the prefix hits the cache (the cached tokens are recorded per call). ``--private``:
each request its own prefix of ``--prefix`` tokens (the engine benchmark's private point), each cached the
same way, the same ones in every call. One untimed
call first, then ``--repeats`` timed ones; per part the median and the minimum (ms), timed with
``time.perf_counter`` around all of a call's requests. The total adds the parts, not the "of which"
rows (already inside ``schedule()`` and ``update_from_output``). As EngineCore does after start-up,
the heap built until then is frozen for Python's garbage collector (vLLM's ``freeze_gc_heap``); the
collector's time inside each part is recorded (``gc.callbacks``). Driver and engine core share one
process here (in vLLM they are two, each with its own heap).

torch runs on one CPU thread (``--torch-threads``): on a GPU the block table goes to the device in
one asynchronous copy, while here a CPU copy of a 2560-block-wide table (block size 16) split over
two threads can wait milliseconds for the second thread where cores are few.

Not measured: the model's forward and attention, sampling, the copies to the GPU, ZeroMQ between
the driver and the engine-core process, the attention metadata builders, the empty ``schedule()``
async scheduling runs while a step is in flight. A part vLLM cannot build where the script runs is
listed with the reason, never skipped silently. The numbers are the running CPU's, not the GPU host's.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from . import common

# The engine benchmark's settings (shared_prefix_engine: max_num_batched_tokens, max_model_len).
MAX_MODEL_LEN = 40960
MAX_BATCHED = 8192
KV_REQUESTS = 20  # the KV cache holds this many requests of MAX_MODEL_LEN tokens

# KVCacheManager methods the scheduler calls for these requests, timed inside schedule() or
# update_from_output (rows "of which": the total does not add them again).
KV_METHODS = {
    "sched_schedule": (
        "get_computed_blocks",
        "can_fit_full_sequence",
        "allocate_slots",
        "get_blocks",
        "get_num_common_prefix_blocks",
    ),
    "sched_update": ("cache_blocks", "free"),
}

# (key, what it times, whether the total adds it): the order a request travels.
PARTS = [
    ("render", "driver: parse_model_prompt + Renderer.render_cmpl (LLM, per prompt)", True),
    ("process_inputs", "driver: InputProcessor.process_inputs + assign_request_id", True),
    ("output_state", "driver: OutputProcessor.add_request", True),
    ("encode_request", "driver: MsgpackEncoder.encode(EngineCoreRequest)", True),
    ("decode_request", "core: MsgpackDecoder(EngineCoreRequest).decode", True),
    ("request_hash", "core: Request.from_engine_core_request + block hasher", True),
    ("sched_add", "sched: Scheduler.add_request", True),
    ("sched_schedule", "sched: Scheduler.schedule()", True),
    *[(f"kv_{m}", f"  of which KVCacheManager.{m}", False) for m in KV_METHODS["sched_schedule"]],
    ("runner_add", "runner: CachedRequestState + InputBatch.add_request, condense, refresh", True),
    ("runner_commit", "runner: BlockTable.commit_block_table", True),
    ("sched_update", "sched: Scheduler.update_from_output (finish, free)", True),
    *[(f"kv_{m}", f"  of which KVCacheManager.{m}", False) for m in KV_METHODS["sched_update"]],
    ("encode_outputs", "core: MsgpackEncoder.encode(EngineCoreOutputs)", True),
    ("decode_outputs", "driver: MsgpackDecoder(EngineCoreOutputs).decode", True),
    ("process_outputs", "driver: OutputProcessor.process_outputs", True),
    ("runner_remove", "runner: next step's InputBatch.remove_request + condense", True),
    ("gc", "of which Python's garbage collector, in any part above", False),
]


IN_TOTAL = {key for key, _, in_total in PARTS if in_total}


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo, where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


class GCClock:
    """Time spent in Python's garbage collector since it was made (through ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.ms, self.collections, self._start = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.ms += (time.perf_counter() - self._start) * 1e3
            self.collections += 1
            self._start = None

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class Engine:
    """vLLM's real objects for one block size, each built where it can be (else the reason why)."""

    def __init__(self, block_size: int, hasher: str = "stock", hits: str = "stock", prompts: str = "stock"):
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

        from .engine import MODEL_DIR

        self.block_size = block_size
        self.hasher = hasher
        self.hits = hits
        self.prompts = prompts
        self.missing: dict[str, str] = {}  # component -> why it could not be built
        model = ModelConfig(
            model=str(MODEL_DIR), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
        )
        self.config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=MAX_BATCHED,
                is_encoder_decoder=False,
                async_scheduling=True,
            ),
            device_config=DeviceConfig(device="cpu"),
        )
        self.vocab = model.get_vocab_size()
        self.driver = self._build("driver", self._driver)
        self.core = self._build("core", self._core)
        self.scheduler = self._build("scheduler", self._scheduler)
        self.kv_timer = None if self.scheduler is None else KVTimer(self.scheduler)
        self.runner = self._build("runner", self._runner)

    def _build(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # vLLM cannot build it here: say so in the output and the JSON
            self.missing[name] = common.failure(e)
            return None

    def _driver(self) -> dict[str, Any]:
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.engine.output_processor import OutputProcessor
        from vllm.v1.serial_utils import MsgpackEncoder

        processor = InputProcessor(self.config)
        return {
            "processor": processor,
            "renderer": processor.renderer,
            # LLM: disable_log_stats=True by default; LLMEngine builds it with the tokenizer (none here)
            "outputs": OutputProcessor(processor.tokenizer, log_stats=False),
            "encoder": MsgpackEncoder(),  # SyncMPClient's, for the EngineCoreRequests it sends
        }

    def _core(self) -> dict[str, Any]:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        # What EngineCore.__init__ does with prefix caching on (one KV cache group: hash block = block)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(self.block_size, hash_fn)
        if self.hasher == "reuse":  # the add-on's engine-core hasher around vLLM's (prefix_hashes)
            from mla_prefill_ext.hosts.core.shared_prefix.prefix_hashes import ReusingHasher

            hasher = ReusingHasher(hasher, self.block_size)
        return {
            "hash_algo": self.config.cache_config.prefix_caching_hash_algo,
            "hasher": hasher,
            "request_decoder": MsgpackDecoder(EngineCoreRequest),
            "outputs_encoder": MsgpackEncoder(),
            "outputs_decoder": MsgpackDecoder(EngineCoreOutputs),
        }

    def kv_cache_config(self) -> Any:
        """vLLM's KV cache configuration for the model's 61 MLA layers, as EngineCore derives it."""
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
        )
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        hf = self.config.model_config.hf_config
        # MLAAttention.get_kv_cache_spec: one latent head of kv_lora_rank + qk_rope_head_dim
        spec = MLAAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=1,
            head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
            dtype=self.config.model_config.dtype,
            cache_dtype_str=self.config.cache_config.cache_dtype,
        )
        specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}
        blocks = KV_REQUESTS * -(-MAX_MODEL_LEN // self.block_size) + 1  # + the null block
        memory = blocks * spec.page_size_bytes * len(specs)
        configs = get_kv_cache_configs(self.config, [specs], [memory])
        kv = generate_scheduler_kv_cache_config(configs)
        self.config.cache_config.num_gpu_blocks = kv.num_blocks  # as EngineCore._initialize_kv_caches
        return kv

    def _scheduler(self) -> Any:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.structured_output import StructuredOutputManager

        kv = self.kv_cache_config()
        self.num_blocks = kv.num_blocks
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, self.config)
        cls = self.config.scheduler_config.get_scheduler_cls()
        self.scheduler_cls = f"{cls.__module__}.{cls.__qualname__}"
        scheduler = cls(
            vllm_config=self.config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(self.config),
            include_finished_set=False,
            log_stats=False,
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
        )
        if self.hits == "reuse":  # the add-on's lookups around vLLM's (prefix_hits), as its wrapper does
            from mla_prefill_ext.hosts.core.shared_prefix.prefix_hits import PrefixHits, lookup_problem

            coordinator = scheduler.kv_cache_manager.coordinator
            problem = lookup_problem(coordinator)
            if problem is not None:
                raise RuntimeError(f"prefix-cache hits cannot be reused here: {problem}")
            hits, lookup = PrefixHits(self.block_size), coordinator.find_longest_cache_hit
            coordinator.find_longest_cache_hit = lambda hashes, max_len: hits.find(lookup, hashes, max_len)
            self.prefix_hits = hits
        return scheduler

    def _runner(self) -> Any:
        import torch
        from vllm.v1.sample.logits_processor import build_logitsprocs
        from vllm.v1.worker.gpu_input_batch import InputBatch

        # GPUModelRunner.__init__'s InputBatch, on the CPU device and unpinned
        device = torch.device("cpu")
        sched = self.config.scheduler_config
        return InputBatch(
            max_num_reqs=sched.max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            device=device,
            pin_memory=False,
            vocab_size=self.vocab,
            block_sizes=[self.block_size],
            kernel_block_sizes=[self.block_size],
            is_spec_decode=False,
            logitsprocs=build_logitsprocs(self.config, device, False, False, ()),
            logitsprocs_need_output_token_ids=False,
            is_pooling_model=False,
            cp_kv_cache_interleave_size=self.config.parallel_config.cp_kv_cache_interleave_size,
        )


class Call:
    """One ``generate`` call's worth of requests through the engine's parts; ``times``: ms per part."""

    def __init__(self, engine: Engine, prompts: list[list[int]], tag: str):
        self.e, self.prompts, self.tag = engine, prompts, tag
        self.times: dict[str, float] = {}
        self.gc_ms: dict[str, float] = {}  # part -> ms of it spent in the garbage collector
        self.gc = GCClock()
        self.skipped: dict[str, str] = {}  # part -> why it did not run
        self.cached_tokens: int | None = None
        self.scheduled_tokens: int | None = None
        self.finished: int | None = None
        self.states: dict[str, Any] = {}  # the runner's requests in flight (lenders are only those)

    def part(self, key: str, fn: Callable[[], Any], needs: tuple[Any, ...] = ()) -> Any:
        missing = [n for n in needs if isinstance(n, str)]
        if missing:
            self.skipped[key] = missing[0]
            return None
        in_gc = self.gc.ms
        start = time.perf_counter()
        out = fn()
        self.times[key] = (time.perf_counter() - start) * 1e3
        self.gc_ms[key] = self.gc.ms - in_gc
        return out

    def run(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.renderers.inputs.preprocess import extract_prompt_components, parse_model_prompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.request import Request

        e = self.e
        driver = e.driver or f"not built: {e.missing.get('driver')}"
        core = e.core or f"not built: {e.missing.get('core')}"
        sched = e.scheduler or f"not built: {e.missing.get('scheduler')}"
        runner = e.runner if e.runner is not None else f"not built: {e.missing.get('runner')}"
        # The engine benchmark's parameters; LLM._add_request asks for the final output only
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        prompts = [TokensPrompt(prompt_token_ids=p) for p in self.prompts]
        ids = [f"{self.tag}-{i}" for i in range(len(prompts))]

        def render() -> list[Any]:  # LLM._preprocess_cmpl_one, per prompt
            renderer, model = driver["renderer"], e.config.model_config
            tok_params = renderer.default_cmpl_tok_params.with_kwargs()
            return [
                renderer.render_cmpl([parse_model_prompt(model, p)], tok_params, prompt_extras=None)[0]
                for p in prompts
            ]

        inputs = self.part("render", render, (driver,))

        def process() -> list[Any]:  # LLMEngine.add_request up to the output processor
            proc, out = driver["processor"], []
            tasks = ("generate",)
            for rid, prompt in zip(ids, inputs, strict=True):
                req = proc.process_inputs(rid, prompt, params, supported_tasks=tasks)
                extract_prompt_components(e.config.model_config, prompt)
                proc.assign_request_id(req)
                out.append(req)
            return out

        requests = self.part("process_inputs", process, (driver, inputs or "needs render"))

        def output_state() -> None:
            for req in requests:
                driver["outputs"].add_request(req, None, None, 0)

        self.part("output_state", output_state, (driver, requests or "needs process_inputs"))
        frames = self.part(
            "encode_request",
            lambda: [driver["encoder"].encode(r) for r in requests],
            (driver, requests or "needs process_inputs"),
        )
        decoded = self.part(
            "decode_request",
            lambda: [core["request_decoder"].decode(f) for f in frames],
            (core, frames or "needs encode_request"),
        )
        core_requests = self.part(
            "request_hash",
            lambda: [Request.from_engine_core_request(r, core["hasher"]) for r in decoded],
            (core, decoded or "needs decode_request"),
        )

        def add() -> None:
            for r in core_requests:
                sched.add_request(r)

        self.part("sched_add", add, (sched, core_requests or "needs request_hash"))
        out = None
        if self.skipped.get("sched_add"):
            self.skipped["sched_schedule"] = self.skipped["sched_add"]
        else:
            out = e.kv_timer.timed("sched_schedule", self, sched.schedule)
        if out is not None:  # what the prefix cache served: the new requests' computed tokens
            self.cached_tokens = sum(new.num_computed_tokens for new in out.scheduled_new_reqs)
            self.scheduled_tokens = out.total_num_scheduled_tokens
        order = self.runner_step(runner, out)
        if out is not None:
            self.finish(sched, out, order, core, driver)
        self.runner_remove(runner, sched)

    def runner_step(self, runner: Any, out: Any) -> list[str] | None:
        """The runner's _update_states for the new requests, then _prepare_inputs' block-table commit."""
        needs = (runner, out if out is not None else "needs sched_schedule")

        def add() -> list[str]:
            from vllm.v1.worker.gpu_input_batch import CachedRequestState

            from mla_prefill_ext.hosts.core.shared_prefix import prompt_rows

            lend = self.e.block_size if self.e.prompts == "reuse" else 0
            for new in out.scheduled_new_reqs:
                state = self.states[new.req_id] = CachedRequestState(
                    req_id=new.req_id,
                    prompt_token_ids=new.prompt_token_ids,
                    prompt_embeds=new.prompt_embeds,
                    mm_features=new.mm_features,
                    sampling_params=new.sampling_params,
                    pooling_params=new.pooling_params,
                    generator=None,
                    block_ids=new.block_ids,
                    num_computed_tokens=new.num_computed_tokens,
                    output_token_ids=[],
                    lora_request=new.lora_request,
                )
                if lend:  # the add-on's wrapper around vLLM's add_request, inside its _update_states'
                    with prompt_rows.lending(lend):
                        prompt_rows.add_request(runner.add_request, runner, (state,), {})
                else:
                    runner.add_request(state)
            runner.condense()
            runner.refresh_metadata()
            return list(runner.req_ids)

        order = self.part("runner_add", add, needs)
        self.part("runner_commit", lambda: runner.block_table.commit_block_table(runner.num_reqs), needs)
        return order

    def finish(self, sched: Any, out: Any, order: list[str] | None, core: Any, driver: Any) -> None:
        """One sampled token per request back into the scheduler, then to the driver."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = order if order is not None else list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] for _ in req_ids],
        )
        engine_outputs = self.e.kv_timer.timed(
            "sched_update", self, lambda: sched.update_from_output(out, result)
        )
        batch = engine_outputs.get(0)
        if batch is None:
            self.skipped["encode_outputs"] = "the scheduler returned no outputs"
            return
        frames = self.part("encode_outputs", lambda: core["outputs_encoder"].encode(batch), (core,))
        decoded = self.part(
            "decode_outputs",
            lambda: core["outputs_decoder"].decode(frames),
            (core, frames or "needs encode_outputs"),
        )
        processed = self.part(
            "process_outputs",
            lambda: driver["outputs"].process_outputs(decoded.outputs, decoded.timestamp, None),
            (driver, decoded or "needs decode_outputs"),
        )
        if processed is not None:  # generate's results: every request done after its one token
            self.finished = sum(o.finished for o in processed.request_outputs)

    def runner_remove(self, runner: Any, sched: Any) -> None:
        """The next step: the scheduler reports the finished requests, the runner drops them."""
        if isinstance(sched, str):
            self.skipped["runner_remove"] = sched
            return
        nxt = sched.schedule()  # nothing left to schedule: it carries the finished request ids

        def remove() -> None:
            for req_id in nxt.finished_req_ids:
                runner.remove_request(req_id)
                self.states.pop(req_id, None)
            runner.condense()

        self.part("runner_remove", remove, (runner,))


class KVTimer:
    """Timers around the scheduler's KVCacheManager methods (the real ones run inside)."""

    def __init__(self, scheduler: Any):
        self.ms: dict[str, float] = {}
        kvm = scheduler.kv_cache_manager
        for method in (m for methods in KV_METHODS.values() for m in methods):
            if hasattr(kvm, method):  # can_fit_full_sequence: vLLM 0.20 only (its row stays empty elsewhere)
                setattr(kvm, method, self._timed(getattr(kvm, method), f"kv_{method}"))

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[key] = self.ms.get(key, 0.0) + (time.perf_counter() - start) * 1e3

        return call

    def timed(self, part: str, call: Call, fn: Callable[[], Any]) -> Any:
        """``call.part(part, fn)``, and the KVCacheManager's share of it."""
        self.ms = {}
        out = call.part(part, fn)
        call.times.update({f"kv_{m}": self.ms.get(f"kv_{m}", 0.0) for m in KV_METHODS[part]})
        return out


def warm_prefix(engine: Engine, prefix: list[int], request_id: str = "prefix") -> int:
    """One request holding the prefix alone, allocated in the KVCacheManager and freed: its full
    blocks stay in the prefix cache. Returns how many blocks it cached."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    proc, kvm = engine.driver["processor"], engine.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = proc.renderer.render_cmpl([{"prompt_token_ids": prefix}])[0]
    core_req = proc.process_inputs(request_id, prompt, params, supported_tasks=("generate",))
    req = Request.from_engine_core_request(core_req, engine.core["hasher"])
    blocks, hit = kvm.get_computed_blocks(req)
    kvm.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    kvm.free(req)
    return len(req.block_hashes)


def run_block_size(args: Any, block_size: int) -> dict[str, Any]:
    from mla_prefill_ext.hosts.core.shared_prefix import prompt_rows

    engine = Engine(block_size, args.hasher, args.hits, args.prompts)
    copied_before = list(prompt_rows.COPIED)
    if args.private:  # each request its own cached prefix, the same ones in every call
        prefixes = [
            common.seeded_tokens(f"prefix{i}", args.prefix, engine.vocab) for i in range(args.requests)
        ]
    else:
        prefixes = [common.seeded_tokens("prefix", args.prefix, engine.vocab)] * args.requests
    res: dict[str, Any] = {
        "private": args.private,
        "block_size": block_size,
        "hasher": args.hasher,
        "hits": args.hits,
        "prompts": args.prompts,
        "not_built": dict(engine.missing),
        "hash_algo": engine.core["hash_algo"] if engine.core else None,
        "scheduler_cls": getattr(engine, "scheduler_cls", None),
        "kv_cache_blocks": getattr(engine, "num_blocks", None),
        "max_num_seqs": engine.config.scheduler_config.max_num_seqs,
        "runner_block_table_width": None
        if engine.runner is None
        else engine.runner.block_table[0].max_num_blocks_per_req,
    }
    if args.prefix and engine.scheduler is not None and engine.core is not None and engine.driver is not None:
        distinct = list(dict.fromkeys(map(tuple, prefixes)))
        res["prefix_blocks_cached"] = sum(
            warm_prefix(engine, list(p), f"prefix{i}") for i, p in enumerate(distinct)
        )
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()  # as EngineCore.__init__ ends: the collector skips what start-up built
    calls = []
    try:
        for rep in range(args.repeats + 1):  # the first untimed
            prompts = [
                prefixes[i]
                + common.seeded_tokens(f"bs{block_size}/rep{rep}/request{i}", args.new, engine.vocab)
                for i in range(args.requests)
            ]
            call = Call(engine, prompts, f"bs{block_size}-rep{rep}")
            try:
                call.run()
            finally:
                call.gc.close()
            call.prompts = None  # a finished call's prompts are garbage, as in the engine
            call.times["gc"] = sum(ms for key, ms in call.gc_ms.items() if key in IN_TOTAL)
            calls.append(call)
    finally:
        gc.unfreeze()  # as EngineCore.shutdown
    timed = calls[1:]
    res["cached_tokens"] = [c.cached_tokens for c in timed]  # per call, all requests together
    res["scheduled_tokens"] = [c.scheduled_tokens for c in timed]
    res["finished_requests"] = [c.finished for c in timed]
    res["gc_ms"] = [c.gc_ms for c in timed]  # per call: each part's time in the garbage collector
    res["gc_collections"] = [c.gc.collections for c in timed]
    res["raw_ms"] = {key: [c.times[key] for c in timed if key in c.times] for key, _, _ in PARTS}
    res["not_run"] = {k: v for c in timed for k, v in c.skipped.items()}
    if args.prompts == "reuse":  # over every call of this block size, the untimed one's included
        copied = [now - then for now, then in zip(prompt_rows.COPIED, copied_before, strict=True)]
        res["prompts_copied"] = {"requests": copied[0], "tokens": copied[1]}
    hits = getattr(engine, "prefix_hits", None)
    if hits is not None:  # over every call, the warm-up's and the untimed one's included
        res["prefix_hits"] = {"reused": hits.reused_hits, "looked_up": hits.looked_up}
    res["parts"] = {}
    for key, what, in_total in PARTS:
        raw = res["raw_ms"][key]
        entry: dict[str, Any] = {"what": what, "in_total": in_total}
        if raw:
            entry.update(median_ms=statistics.median(raw), min_ms=min(raw))
        else:
            entry["not_run"] = res["not_run"].get(key, "not run")
        res["parts"][key] = entry
    totals = [sum(c.times.get(k, 0.0) for k, _, t in PARTS if t) for c in timed]
    res["total"] = {"median_ms": statistics.median(totals), "min_ms": min(totals), "raw_ms": totals}
    return res


def table(res: dict[str, Any], args: Any) -> list[str]:
    lines = [
        f"block size {res['block_size']}: {args.requests} requests x ({args.prefix} cached"
        f"{', each its own' if args.private else ''} + {args.new} new)"
        f" tokens, {args.repeats} repeats; cached tokens per call {res['cached_tokens']}",
        "| part | median ms | min ms |",
        "| --- | --- | --- |",
    ]
    for part in res["parts"].values():
        if "median_ms" in part:
            lines.append(f"| {part['what']} | {part['median_ms']:.2f} | {part['min_ms']:.2f} |")
        else:
            lines.append(f"| {part['what']} | not run: {part['not_run']} | |")
    total = res["total"]
    lines.append(f"| total (rows not marked 'of which') | {total['median_ms']:.2f} | {total['min_ms']:.2f} |")
    ran = [ms for ms in res["raw_ms"]["gc"] if ms > 0]
    if ran:
        lines.append(
            f"Python's garbage collector ran inside the timed parts in {len(ran)} of"
            f" {len(res['raw_ms']['gc'])} calls, up to {max(ran):.2f} ms (gc_ms in the JSON: in which part)"
        )
    for name, why in res["not_built"].items():
        lines.append(f"not built on this machine: {name}: {why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--requests", type=int, default=16, help="requests per generate call")
    parser.add_argument(
        "--prefix",
        type=int,
        default=32768,
        help="cached prefix tokens: shared by all (each request's own with --private)",
    )
    parser.add_argument(
        "--private",
        action="store_true",
        help="each request its own cached prefix of --prefix tokens (the engine benchmark's private point)",
    )
    parser.add_argument("--new", type=int, default=1, help="new tokens of each request's own")
    parser.add_argument("--block-size", type=int, nargs="+", default=[64], help="KV cache block size(s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (one more untimed first)")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch's CPU threads (the block-table copy's)"
    )
    parser.add_argument(
        "--hasher",
        choices=("stock", "reuse"),
        default="stock",
        help="vLLM's block hasher, or the add-on's around it (hashes of leading blocks equal to a recent"
        " request's reused: the engine core's part of the shared-prefix path)",
    )
    parser.add_argument(
        "--hits",
        choices=("stock", "reuse"),
        default="stock",
        help="vLLM's prefix-cache lookup, or the add-on's around it (hits of leading blocks a recent lookup"
        " found, still cached, reused: the engine core's part of the shared-prefix path)",
    )
    parser.add_argument(
        "--prompts",
        choices=("stock", "reuse"),
        default="stock",
        help="the runner's copy of each prompt into its input batch as vLLM does, or the add-on's (leading"
        " tokens from the row of a request holding the same KV blocks: the runner's part of the path)",
    )
    parser.add_argument("--json", help="write the results and every raw time here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.new < 1 or args.repeats < 1:
        parser.error("--requests, --new and --repeats must be at least 1")
    if args.prefix + args.new + 1 > MAX_MODEL_LEN:
        parser.error(f"--prefix + --new must stay below the model length {MAX_MODEL_LEN}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["MLA_PREFILL_EXT_DISABLE"] = "1"  # stock vLLM: the add-on neither stamps nor patches
    import torch

    torch.set_num_threads(args.torch_threads)
    results = []
    for block_size in args.block_size:
        res = run_block_size(args, block_size)
        results.append(res)
        print("\n".join(table(res, args)) + "\n", flush=True)
    out = common.record(
        args=vars(args),
        settings={
            "max_model_len": MAX_MODEL_LEN,
            "max_num_batched_tokens": MAX_BATCHED,
            "kv_requests": KV_REQUESTS,
        },
        prefix_host_cost=results,
    )
    out["environment"]["cpu"] = cpu_model()
    out["environment"]["cpu_count"] = os.cpu_count()
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
