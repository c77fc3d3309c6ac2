"""Each backend over each shape, called as the installed vLLM calls it: time, TFLOP/s, ratio to built-ins.

A backend is built and driven through the conformance kit's calling convention for the installed
vLLM (:func:`mla_prefill_ext.testing.conventions.bridged.installed_vllm_convention`: vLLM 0.20's
positional calls with chunk indices, or vLLM 0.23+'s keyword calls through the bridge's adapter,
with vLLM's own chunk objects on 0.29+). The first step of each backend on each shape runs through
the convention itself, so that a call that raises is named as the conformance report names it.
The timed step then makes the same calls on metadata prepared once, as every layer of a model
does after the step's one ``prepare_metadata``: the new tokens (with the LSE when there is cached
context), then each context chunk. vLLM's merge of their results is not timed: it is vLLM's op,
the same for every backend.

FLOPs are counted as ``scripts/bench/kernel.py`` counts them
(:meth:`mla_prefill_ext.testing.problem.PrefillProblem.flops`): QK^T and PV, the causal half of
the new tokens' square plus every new token against its cached context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mla_prefill_ext.bench.spec import BenchShape, MLADims
from mla_prefill_ext.bench.timing import Timing, median_time
from mla_prefill_ext.testing.conventions import CallingConvention, synchronize
from mla_prefill_ext.testing.conventions.bridged import BridgedConvention, vllm_chunked_metadata
from mla_prefill_ext.testing.problem import PrefillProblem, deepseek_yarn_scale, make_problem

KV_LORA_RANK = 512  # DeepSeek's; the prefill kernels do not use it


@dataclass(frozen=True)
class Candidate:
    """A backend to time: under test (named on the command line), a built-in, or both."""

    name: str
    cls: type
    under_test: bool
    builtin: bool

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


@dataclass
class Measurement:
    """One backend on one shape: its timing, or the error that stopped it."""

    backend: str
    shape: BenchShape
    flops: float
    timing: Timing | None = None
    error: str | None = None
    fastest_builtin: str | None = None  # the fastest built-in measured on this shape
    fastest_builtin_s: float | None = None

    @property
    def tflops(self) -> float | None:
        return None if self.timing is None else self.flops / self.timing.median_s / 1e12

    @property
    def speed_vs_fastest_builtin(self) -> float | None:
        """The fastest built-in's time over this backend's: above 1, faster than every built-in."""
        if self.timing is None or self.fastest_builtin_s is None:
            return None
        return self.fastest_builtin_s / self.timing.median_s


def layer_kwargs(dims: MLADims, scale: float) -> dict[str, Any]:
    """The seven keyword arguments vLLM's MLA layer constructs its prefill backend with."""
    return dict(
        num_heads=dims.num_heads,
        scale=scale,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        vllm_config=None,
    )


def prepared_step(convention: CallingConvention, backend: Any, problem: PrefillProblem) -> Callable[[], None]:
    """Prepare ``problem``'s metadata once; the returned call makes one step's run calls as the host does."""
    p = problem
    with_lse = p.has_context  # vLLM asks for the LSE of the new tokens only to merge the context's
    chunks = list(zip(p.chunk_k, p.chunk_v, strict=True))
    if isinstance(convention, BridgedConvention):
        # vLLM 0.29+ describes each chunk as an object (the problem then has no per-chunk lists).
        objects = p.has_context and p.metadata.chunked_context is None
        metadata = vllm_chunked_metadata(p) if objects else p.metadata
        backend.prepare_metadata(metadata)
        if objects:
            calls = [
                (
                    lambda c=c, q=p.q[c.token_slice], kc=kc, vc=vc: backend.run_prefill_context_chunk(
                        chunk=c, q=q, k=kc, v=vc
                    )
                )
                for c, (kc, vc) in zip(metadata.chunked_context.chunks, chunks, strict=True)
            ]
        else:
            calls = [
                (lambda i=i, kc=kc, vc=vc: backend.run_prefill_context_chunk(chunk_idx=i, q=p.q, k=kc, v=vc))
                for i, (kc, vc) in enumerate(chunks)
            ]

        def new_tokens() -> Any:
            return backend.run_prefill_new_tokens(
                q=p.q, k=p.k, v=p.v, return_softmax_lse=with_lse, out=None, output_scale=None
            )

    else:
        backend.prepare_metadata(p.metadata)
        calls = [
            (lambda i=i, kc=kc, vc=vc: backend.run_prefill_context_chunk(i, p.q, kc, vc))
            for i, (kc, vc) in enumerate(chunks)
        ]

        def new_tokens() -> Any:
            return backend.run_prefill_new_tokens(p.q, p.k, p.v, with_lse)

    def step() -> None:
        new_tokens()
        for call in calls:
            call()

    return step


def check_step(convention: CallingConvention, backend: Any, problem: PrefillProblem) -> str | None:
    """One step through the convention itself (warm-up, JIT); the failing call, named, or None."""
    if problem.has_context:
        result = convention.run_step(backend, problem, with_lse=True, plain=None)
    else:
        result = convention.run_step(backend, problem, with_lse=False, plain=problem)
    return result.error


def describe_error(e: BaseException) -> str:
    """An error as a result's line: out of memory said briefly, else the exception's type and text."""
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of memory ({str(e).splitlines()[0]})"
    return f"{type(e).__name__}: {e}"


def step_to_time(
    cls: type, problem: PrefillProblem, dims: MLADims, convention: CallingConvention
) -> tuple[Callable[[], None] | None, str | None]:
    """The backend built as the host builds it, its first step checked call by call (warm-up, JIT);
    then the step to time on metadata prepared once, or the failing call, named."""
    kwargs = layer_kwargs(dims, deepseek_yarn_scale(dims.qk_nope_head_dim + dims.qk_rope_head_dim))
    backend = convention.construct(cls, kwargs)
    error = check_step(convention, backend, problem)
    if error is not None:
        return None, error
    return prepared_step(convention, backend, problem), None


def device_sync(problem: PrefillProblem) -> Callable[[], None]:
    """Wait for the device the problem's tensors are on."""
    device = problem.q.device
    return lambda: synchronize(device)


def timed_warmup(warmup: int) -> int:
    """The untimed steps left after the checked one (``warmup`` counts it)."""
    return max(0, warmup - 1)


def measure_one(
    candidate: Candidate,
    shape: BenchShape,
    problem: PrefillProblem,
    dims: MLADims,
    convention: CallingConvention,
    repeat: int,
    warmup: int,
) -> Measurement:
    """One backend on one shape; an error (a call that raises, out of memory) is the result."""
    row = Measurement(candidate.name, shape, problem.flops())
    try:
        step, row.error = step_to_time(candidate.cls, problem, dims, convention)
        if step is not None:
            row.timing = median_time(
                step, sync=device_sync(problem), repeat=repeat, warmup=timed_warmup(warmup)
            )
    except Exception as e:  # the backend failed on this shape: that is its result
        row.error = describe_error(e)
    return row


def rank_builtins(rows: list[Measurement], builtins: set[str]) -> None:
    """Set each row's fastest built-in on its shape (of the built-ins measured without error)."""
    for shape in {r.shape for r in rows}:
        timed = [r for r in rows if r.shape == shape and r.backend in builtins and r.timing is not None]
        if not timed:
            continue
        best = min(timed, key=lambda r: r.timing.median_s)  # type: ignore[union-attr]
        for r in rows:
            if r.shape == shape:
                r.fastest_builtin, r.fastest_builtin_s = best.backend, best.timing.median_s  # type: ignore[union-attr]


def make_shape_problem(
    shape: BenchShape, dims: MLADims, dtype: torch.dtype, device: str, seed: int = 0
) -> PrefillProblem:
    """The step ``shape`` describes, at ``dims``, on vLLM's own prefill metadata."""
    return make_problem(
        shape.new_lens(),
        shape.context_lens(),
        num_chunks=shape.chunks,
        num_heads=dims.num_heads,
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
    )


def run_bench(
    candidates: list[Candidate],
    shapes: list[BenchShape],
    dims: MLADims,
    dtype: torch.dtype,
    device: str,
    convention: CallingConvention,
    repeat: int,
    warmup: int,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[Measurement]:
    """Every candidate on every shape, in that order; then each row's ratio to the fastest built-in."""
    rows: list[Measurement] = []
    total, done = len(candidates) * len(shapes), 0
    for shape in shapes:
        try:
            problem = make_shape_problem(shape, dims, dtype, device, seed)
        except Exception as e:  # e.g. out of memory: every backend's result on this shape
            for candidate in candidates:
                rows.append(Measurement(candidate.name, shape, 0.0, error=f"the inputs: {describe_error(e)}"))
            done += len(candidates)
            continue
        for candidate in candidates:
            if progress is not None:
                progress(f"[{done + 1}/{total}] {candidate.name} on {shape.label}")
            rows.append(measure_one(candidate, shape, problem, dims, convention, repeat, warmup))
            done += 1
        del problem  # free this shape's tensors before the next one
        if device == "cuda":
            torch.cuda.empty_cache()
    rank_builtins(rows, {c.name for c in candidates if c.builtin})
    return rows
