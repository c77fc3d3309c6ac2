"""Conformance checks for MLA prefill backends, against the float64 reference.

A backend is run the way the engine runs it: constructed with the layer's seven
keyword arguments (``num_heads``, ``scale``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``, ``vllm_config=None``), then per step
``prepare_metadata(prefill_metadata)``, ``run_prefill_new_tokens(q, k, v,
return_softmax_lse)`` and ``run_prefill_context_chunk(chunk_idx, q, k, v)`` on
problems that carry vLLM's own ``MLACommonPrefillMetadata``
(:func:`mla_prefill_ext.testing.problem.make_problem`). V arrives as vLLM hands it over: a
strided view into kv_b_proj's ``[k_nope | v]`` rows (the columns before it are NaN
here, so a backend that reads them shows it).

Each property in :data:`PROPERTIES` is checked for every case (dtype x MLA dims x
head count) the backend's own ``validate_configuration`` accepts; a case it refuses
is skipped with its reasons and never run. Each property is tested in a way that
isolates it, so one bug is reported under its own name:

* ``causal`` and ``varlen.isolation`` perturb keys/values a token must not see
  (later new tokens; other requests) and compare with the unperturbed run, so they
  hold whatever the scale or the LSE convention.
* ``scale`` compares a path's output and LSE (LSE in either base) with the reference
  at the backend's ``self.scale`` (a non-default one: DeepSeek's YaRN-scaled scale).
  Where they differ it searches for the scale the backend really uses; when one fits,
  the value checks (``*.values``, ``lse.natural_log``, ``merge.whole_sequence``) are
  made at that scale, so a wrong scale is reported once, as ``scale``.
* Checks that cannot be made because another failed are reported as skipped with
  the reason (e.g. ``merge.whole_sequence`` after ``lse.layout``).

Tolerances (:data:`TOLERANCES`) depend on the input dtype. Outputs: relative to the
largest reference value, because attention outputs are weighted means of V and
every rounding is relative to their magnitude. bfloat16 ``2**-7`` and float16
``2**-10`` are four times the half-ulp rounding of the output (2**-9, 2**-12): the
output rounding itself, the probabilities a kernel may round to the input dtype
before P @ V, and one rounding per ``merge_attn_states`` over two chunks and the new
tokens; that is the tolerance the GPU kernel tests verified FLASH_ATTN and
FLASHINFER with on an H200. float32: ``2e-5``, for float32 accumulation over 192-long
dot products and a few hundred keys (measured: 5e-7). LSE: absolute (an error in the
log is a relative error of the softmax sum); always float32, from inputs the
reference sees exactly: ``1e-4`` for float32 inputs, ``2e-3`` for bf16/fp16 (the
tolerance the H200 runs verified, allowing kernels' blockwise rescaling and fast
``exp2``). A base-2 LSE is off by a factor 1.44 (about 1.0 here), a 2% scale error by
about 0.05-0.14: both far outside.

Merging: on CUDA, vLLM's own ``merge_attn_states``. vLLM's op needs CUDA or Triton
(on a CPU its Triton path fails: Triton has no CPU driver), so elsewhere
:func:`mla_prefill_ext.testing.reference.merge_attn_states_torch` is used: the same rule in
torch, with the kernel's float32 arithmetic, output dtype and treatment of
infinite LSEs (empty parts).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_prefill_ext.backends.base import R1_MLA_DIMS, MLAPrefillBackend
from mla_prefill_ext.testing.problem import PrefillProblem, deepseek_yarn_scale, make_problem
from mla_prefill_ext.testing.reference import ScaledReference, merge_attn_states_any

PASS, FAIL, SKIP = "pass", "fail", "skip"

PROPERTIES: dict[str, str] = {
    "runs": "the backend constructs with the layer's arguments, and prepare_metadata and the run methods "
    "complete without raising",
    "inputs.unmodified": "q, k, v (and the kv_b_proj rows V is a view of), the chunks' k and v and the "
    "metadata's tensors are not written to",
    "output.shape": "every output is [tokens, num_heads, v_head_dim]",
    "output.unpadded": "the output's last dim is v_head_dim, not the qk head dim a kernel padded V to",
    "output.dtype": "every output has the metadata's output_dtype",
    "output.dense": "every output is contiguous (vLLM's merge_attn_states indexes it densely)",
    "lse.layout": "with return_softmax_lse the result is (output, LSE), the LSE [num_heads, tokens] and "
    "contiguous (merge_attn_states reads it so)",
    "lse.dtype": "the LSE is float32",
    "lse.natural_log": "the LSE is log(sum(exp(scale * q.k))) in natural log, as merge_attn_states "
    "(which uses exp) expects",
    "scale": "the softmax scale is the backend's self.scale (the layer's scale; constructed non-default)",
    "causal": "a new token attends to no later new token (perturbing later tokens leaves it unchanged)",
    "varlen.isolation": "no attention across requests (perturbing one request leaves the others unchanged)",
    "new_tokens.values": "new-token output equals causal attention among each request's new tokens",
    "new_tokens.without_lse": "return_softmax_lse=False returns the output alone, with the same values",
    "context_chunk.values": "a chunk's output equals attention of each request over its keys in that chunk",
    "context_chunk.empty": "a request with no keys in a chunk gets LSE -inf (or +inf) and a finite output, "
    "so the merge gives it no weight",
    "merge.whole_sequence": "the chunks and new tokens merged with merge_attn_states, in vLLM's order, "
    "equal attention over the whole sequence",
    "metadata.restep": "after prepare_metadata with other shapes (more requests, more chunks, no context), "
    "results equal a fresh instance's",
}
"""Every property the suite checks, by name, with what it means."""


@dataclass(frozen=True)
class Tolerance:
    """Error allowed for one input dtype (see the module docstring for why)."""

    output_rel: float
    """Max |output - reference| allowed, relative to max |reference|."""
    lse_abs: float
    """Max |LSE - reference LSE| allowed (natural log)."""


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(output_rel=2e-5, lse_abs=1e-4),
    torch.bfloat16: Tolerance(output_rel=2.0**-7, lse_abs=2e-3),
    torch.float16: Tolerance(output_rel=2.0**-10, lse_abs=2e-3),
}

DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_DIMS: tuple[tuple[int, int, int], ...] = (R1_MLA_DIMS, (64, 32, 64))
DEFAULT_NUM_HEADS: tuple[int, ...] = (16, 1)
KV_LORA_RANK = 512

# The step every case runs: three requests (25 new tokens), cached context in two
# chunks; request 1 has no context, request 2 none in chunk 1 (empty chunk rows).
NEW_LENS = [7, 13, 5]
CONTEXT_LENS = [20, 0, 9]
NUM_CHUNKS = 2
# Steps with other shapes for metadata.restep: (new tokens, context, chunks).
RESTEP_SHAPES: list[tuple[list[int], list[int] | None, int]] = [
    ([3, 11, 1, 6], [5, 30, 2, 0], 3),
    ([9, 4], None, 1),
]
_SAME_SCALE = 2e-3  # fitted scales closer than this (relative) are one scale
_EMPTY_LSE = -1e4  # an LSE at or below this gets no weight in a float32 merge (exp underflows)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(t: Any) -> str:
    return f"[{', '.join(str(s) for s in t.shape)}]" if isinstance(t, torch.Tensor) else type(t).__name__


def _json_number(x: float | None) -> float | str | None:
    """Floats for JSON: a non-finite error (NaN output, say) as the string 'inf' or 'nan'."""
    return x if x is None or math.isfinite(x) else str(x)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 or x == 0 else f"{x:.2e}"


@dataclass
class CheckResult:
    """One property checked on one case."""

    property: str
    case: str
    status: str  # "pass" | "fail" | "skip"
    message: str = ""
    measured: float | None = None
    tolerance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "property": self.property,
            "case": self.case,
            "status": self.status,
            "message": self.message,
            "measured": _json_number(self.measured),
            "tolerance": _json_number(self.tolerance),
        }


@dataclass(frozen=True)
class ConformanceCase:
    """One configuration the suite runs: input dtype, MLA dims, head count."""

    dtype: torch.dtype
    dims: tuple[int, int, int]
    num_heads: int
    scale: float

    @property
    def label(self) -> str:
        nope, rope, v = self.dims
        return f"{_dtype_name(self.dtype)}, qk {nope}+{rope} v {v}, {self.num_heads} heads"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "dtype": _dtype_name(self.dtype),
            "dims": list(self.dims),
            "num_heads": self.num_heads,
            "scale": self.scale,
        }


@dataclass
class ConformanceReport:
    """What :func:`run_conformance` found: one :class:`CheckResult` per property and case."""

    backend: str
    backend_class: str
    device: str
    capability: str | None
    merge: str
    cases: list[ConformanceCase]
    skipped_cases: dict[str, str]  # case label -> why the backend cannot serve it
    results: list[CheckResult] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def ran(self) -> bool:
        """Whether at least one case ran (was not refused by validate_configuration)."""
        return len(self.skipped_cases) < len(self.cases)

    @property
    def ok(self) -> bool:
        """At least one case ran and no property failed."""
        return self.ran and not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def failed_properties(self) -> list[str]:
        failed = {r.property for r in self.failures}
        return [p for p in PROPERTIES if p in failed]

    def results_for(self, prop: str) -> list[CheckResult]:
        return [r for r in self.results if r.property == prop]

    def status_of(self, prop: str) -> str:
        """``fail`` if any case failed it, else ``pass`` if any case passed it, else ``skip``."""
        statuses = {r.status for r in self.results_for(prop)}
        return FAIL if FAIL in statuses else PASS if PASS in statuses else SKIP

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "class": self.backend_class,
            "device": self.device,
            "capability": self.capability,
            "merge": self.merge,
            "tolerances": {
                _dtype_name(c.dtype): vars(TOLERANCES[c.dtype]) for c in self.cases if c.dtype in TOLERANCES
            },
            "cases": [{**c.to_dict(), "skipped": self.skipped_cases.get(c.label)} for c in self.cases],
            "properties": {p: {"status": self.status_of(p), "description": d} for p, d in PROPERTIES.items()},
            "failed_properties": self.failed_properties,
            "results": [r.to_dict() for r in self.results],
            "duration_s": self.duration_s,
        }

    def format(self, verbose: bool = False) -> str:
        """A human summary: each property's status, and every failure with its measured error."""
        lines = [
            f"MLA prefill conformance: {self.backend} ({self.backend_class})",
            f"device: {self.device}"
            + (f", compute capability {self.capability}" if self.capability else "")
            + f"; merge: {self.merge}",
        ]
        run = [c for c in self.cases if c.label not in self.skipped_cases]
        lines.append(f"cases: {len(run)} run, {len(self.skipped_cases)} skipped (backend cannot serve them)")
        for c in run:
            tol = TOLERANCES[c.dtype]
            lines.append(
                f"  run   {c.label} (scale {c.scale:.6g}; tolerance: output {tol.output_rel:.3g} "
                f"x max |ref|, LSE {tol.lse_abs:g})"
            )
        for label, reason in self.skipped_cases.items():
            lines.append(f"  SKIP  {label}: {reason}")
        width = max(len(p) for p in PROPERTIES)
        lines.append("properties:")
        for prop in PROPERTIES:
            rs = self.results_for(prop)
            if not rs:
                continue
            status = self.status_of(prop)
            if status == FAIL:
                shown = [r for r in rs if r.status == FAIL]
            elif status == SKIP or verbose:
                shown = [r for r in rs if r.status == status or verbose]
            else:
                shown = []
            n = sum(r.status == status for r in rs)
            lines.append(f"  {status.upper():4}  {prop:{width}}  ({n} of {len(rs)} cases)")
            seen: set[str] = set()
            for r in shown:
                text = f"{r.case}: {r.message}" if r.status == FAIL or verbose else r.message
                if text in seen:
                    continue
                seen.add(text)
                lines.append(f"        {prop}: {text}")
        if not self.ran:
            lines.append("RESULT: FAIL (nothing was checked: the backend cannot serve any case here)")
        elif self.failures:
            lines.append(f"RESULT: FAIL ({', '.join(self.failed_properties)})")
        else:
            lines.append("RESULT: PASS")
        lines.append(f"({self.duration_s:.2f} s)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


# ----------------------------------------------------------------------------- helpers


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, nan_equal: bool = False) -> float:
    """max |a - b| in float64: NaN is inf (unless both are NaN and ``nan_equal``); equal infinities
    count as equal."""
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    d = (a64 - b64).abs()
    same = torch.isinf(a64) & (a64 == b64)
    if nan_equal:
        same |= torch.isnan(a64) & torch.isnan(b64)
    d = torch.where(same, 0.0, d)
    return torch.nan_to_num(d, nan=math.inf).max().item()


def _changed(before: torch.Tensor, after: torch.Tensor) -> tuple[int, float]:
    """(elements changed, max |change|) with NaN == NaN; shapes must match."""
    if before.shape != after.shape:
        return before.numel(), math.inf
    same = (before == after) | (torch.isnan(before) & torch.isnan(after))
    n = int((~same).sum().item())
    return n, (_max_abs_diff(before, after) if n else 0.0)


def _with_lead(t: torch.Tensor) -> torch.Tensor:
    """The whole rows ``t`` (a kv_b_proj tail, see problem.kv_b_proj_tail) is a view of."""
    if t.dim() != 3 or t.stride(-1) != 1:
        return t
    lead = t.stride(-2) - t.shape[-1]
    if lead <= 0 or t.storage_offset() < lead:
        return t
    return t.as_strided((*t.shape[:-1], t.shape[-1] + lead), t.stride(), t.storage_offset() - lead)


def _input_tensors(p: PrefillProblem) -> dict[str, torch.Tensor]:
    named = {"q": p.q, "k": p.k, "v (and the kv_b_proj rows it is a view of)": _with_lead(p.v)}
    for i, (kc, vc) in enumerate(zip(p.chunk_k, p.chunk_v, strict=True)):
        named[f"chunk {i} k"] = kc
        named[f"chunk {i} v (and its rows)"] = _with_lead(vc)
    m = p.metadata
    named["metadata.query_start_loc"] = m.query_start_loc
    if m.chunked_context is not None:
        for name in ("cu_seq_lens", "starts", "seq_lens"):
            t = getattr(m.chunked_context, name)
            if isinstance(t, torch.Tensor):
                named[f"metadata.chunked_context.{name}"] = t
    return named


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Step:
    """What one step returned: run_prefill_new_tokens with/without LSE, and each chunk."""

    new: Any = None
    plain: Any = None
    chunks: list[Any] = field(default_factory=list)
    error: str | None = None


def _run_step(
    backend: MLAPrefillBackend, p: PrefillProblem, with_lse: bool, plain: PrefillProblem | None
) -> _Step:
    """One step as vLLM runs it: q shared by the new tokens and every chunk; k/v used once.

    ``plain``: also call ``run_prefill_new_tokens(..., return_softmax_lse=False)``, on these
    inputs (a copy of ``p``'s: in vLLM no k or v reaches two calls).
    """
    step = _Step()
    where = "prepare_metadata"
    try:
        backend.prepare_metadata(p.metadata)
        if with_lse:
            where = "run_prefill_new_tokens(return_softmax_lse=True)"
            step.new = backend.run_prefill_new_tokens(p.q, p.k, p.v, True)
        if plain:
            where = "run_prefill_new_tokens(return_softmax_lse=False)"
            step.plain = backend.run_prefill_new_tokens(plain.q, plain.k, plain.v, False)
        for i, (kc, vc) in enumerate(zip(p.chunk_k, p.chunk_v, strict=True)):
            where = f"run_prefill_context_chunk({i})"
            step.chunks.append(backend.run_prefill_context_chunk(i, p.q, kc, vc))
        where = "the step (synchronizing the device)"
        _sync(p.q.device)
    except Exception as e:  # reported, never raised: the report says where
        step.error = f"{where} raised {type(e).__name__}: {e}"
    return step


def _pair(ret: Any) -> tuple[Any, Any]:
    """(output, lse) from a result that should be a 2-tuple; (ret, None) otherwise."""
    if isinstance(ret, (tuple, list)) and len(ret) == 2:
        return ret[0], ret[1]
    return ret, None


@dataclass
class _Piece:
    """One request's part of one path: its rows and its reference at any scale."""

    rows: slice
    ref: ScaledReference


@dataclass
class _Path:
    """New tokens or one context chunk: the backend's usable tensors and the references."""

    name: str
    pieces: list[_Piece]
    out: torch.Tensor | None
    lse: torch.Tensor | None

    def __post_init__(self) -> None:
        self._out64 = [None if self.out is None else self.out[p.rows].double() for p in self.pieces]
        self._lse64 = [None if self.lse is None else self.lse[:, p.rows].double() for p in self.pieces]

    def errors(self, scale: float) -> tuple[float, float, float, float]:
        """At ``scale``: (max |out - ref|, max |ref|, max |lse - ref lse|, max |lse * ln 2 - ref lse|).

        The last is the LSE's error if it were in base 2 (0 for LSE-less paths).
        """
        out_err = ref_max = lse_err = lse2_err = 0.0
        for piece, out, lse in zip(self.pieces, self._out64, self._lse64, strict=True):
            ro, rl = piece.ref(scale)
            if out is not None:
                out_err = max(out_err, _max_abs_diff(out, ro))
                ref_max = max(ref_max, ro.abs().max().item() if ro.numel() else 0.0)
            if lse is not None:
                lse_err = max(lse_err, _max_abs_diff(lse, rl))
                lse2_err = max(lse2_err, _max_abs_diff(lse * math.log(2), rl))
        return out_err, ref_max, lse_err, lse2_err


def _fit(norm_err: Callable[[float], float], s0: float) -> tuple[float, float]:
    """The scale in [s0/4, 4 s0] that minimises ``norm_err``: a log grid, then golden section."""
    grid = [s0 * 2.0 ** (x / 8.0) for x in range(-16, 17)]
    errs = [norm_err(s) for s in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = norm_err(math.exp(a)), norm_err(math.exp(b))
    for _ in range(30):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = norm_err(math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = norm_err(math.exp(b))
    best = min([(errs[i], grid[i]), (fa, math.exp(a)), (fb, math.exp(b))])
    return best[1], best[0]


# ----------------------------------------------------------------------------- one case


class _CaseCheck:
    """Runs every property on one case and collects the results."""

    def __init__(
        self,
        cls: type[MLAPrefillBackend],
        case: ConformanceCase,
        device: torch.device,
        seed: int,
        kv_lora_rank: int,
    ) -> None:
        self.cls, self.case, self.device, self.seed = cls, case, device, seed
        self.tol = TOLERANCES[case.dtype]
        self.kwargs = dict(
            num_heads=case.num_heads,
            scale=case.scale,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=case.dims[0],
            qk_rope_head_dim=case.dims[1],
            v_head_dim=case.dims[2],
            vllm_config=None,
        )
        self.results: list[CheckResult] = []
        self.status: dict[str, str] = {}

    # -- recording

    def add(
        self,
        prop: str,
        status: str,
        message: str = "",
        measured: float | None = None,
        tolerance: float | None = None,
    ) -> None:
        assert prop in PROPERTIES, prop
        self.status[prop] = status
        self.results.append(CheckResult(prop, self.case.label, status, message, measured, tolerance))

    def measured(self, prop: str, what: str, err: float, tol: float, extra: str = "") -> bool:
        ok = err <= tol
        msg = f"{what} = {_fmt(err)} (tolerance {_fmt(tol)})" + (f"; {extra}" if extra else "")
        self.add(prop, PASS if ok else FAIL, msg, err, tol)
        return ok

    def blocked(self, prop: str, by: Iterable[str]) -> bool:
        """Record ``prop`` as not evaluated when a property it needs failed; True if so."""
        failed = [b for b in by if self.status.get(b) == FAIL]
        if failed:
            self.add(prop, SKIP, f"not evaluated: {', '.join(failed)} failed")
        return bool(failed)

    def skip_rest(self, reason: str) -> None:
        for prop in PROPERTIES:
            if prop not in self.status:
                self.add(prop, SKIP, reason)

    # -- problems

    def problem(self, new_lens: list[int], context_lens: list[int] | None, chunks: int) -> PrefillProblem:
        nope, rope, v = self.case.dims
        return make_problem(
            new_lens,
            context_lens,
            num_chunks=chunks,
            num_heads=self.case.num_heads,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=v,
            dtype=self.case.dtype,
            device=self.device,
            seed=self.seed,
        )

    def new_backend(self) -> MLAPrefillBackend:
        return self.cls(**self.kwargs)

    # -- the checks

    def run(self) -> list[CheckResult]:
        self.p = self.problem(NEW_LENS, CONTEXT_LENS, NUM_CHUNKS)
        self.T, self.H, self.dv = self.p.q.shape[0], self.case.num_heads, self.case.dims[2]
        self.qb, self.cb = self.p.query_bounds(), self.p.chunk_bounds()
        pristine = {n: t.clone() for n, t in _input_tensors(self.p).items()}
        try:
            self.backend = self.new_backend()
        except Exception as e:
            self.add(
                "runs",
                FAIL,
                f"constructing {self.cls.__name__}(**{self.kwargs}) raised {type(e).__name__}: {e}",
            )
            self.skip_rest("not evaluated: the backend could not be constructed")
            return self.results
        inputs, plain_inputs = self.p.clone(), self.p.clone()
        self.main = _run_step(self.backend, inputs, with_lse=True, plain=plain_inputs)
        if self.main.error:
            self.add("runs", FAIL, self.main.error)
            self.skip_rest("not evaluated: the step raised")
            return self.results
        self.add("runs", PASS, "constructed; prepare_metadata, new tokens (with and without LSE), chunks ran")
        self.outputs_usable = self.lse_usable = False
        values = [
            "scale",
            "new_tokens.values",
            "new_tokens.without_lse",
            "context_chunk.values",
            "lse.natural_log",
            "context_chunk.empty",
            "merge.whole_sequence",
        ]
        structure = [p for p in PROPERTIES if p.startswith(("output.", "lse.")) and p != "lse.natural_log"]
        for check, props in (
            (lambda: self.check_inputs(pristine, inputs, plain_inputs), ["inputs.unmodified"]),
            (self.check_structure, structure),
            (self.check_causal, ["causal"]),
            (self.check_isolation, ["varlen.isolation"]),
            (self.check_scale_and_values, values),
            (self.check_restep, ["metadata.restep"]),
        ):
            try:
                check()
            except Exception as e:  # what the backend returned defeats the comparison itself
                for prop in props:
                    if prop not in self.status:
                        self.add(
                            prop,
                            FAIL,
                            f"could not be checked on what the backend returned: {type(e).__name__}: {e}",
                        )
        return self.results

    def check_inputs(
        self, pristine: dict[str, torch.Tensor], inputs: PrefillProblem, plain_inputs: PrefillProblem
    ) -> None:
        changes = []
        worst = 0.0
        for where, p in (("", inputs), (" (of the return_softmax_lse=False call)", plain_inputs)):
            for name, after in _input_tensors(p).items():
                n, d = _changed(pristine[name], after)
                if n:
                    changes.append(f"{name}{where}: {n} of {after.numel()} elements, max |change| {_fmt(d)}")
                    worst = max(worst, d)
        if changes:
            self.add(
                "inputs.unmodified",
                FAIL,
                "after one step the backend had written to " + "; ".join(changes),
                worst,
                0.0,
            )
        else:
            self.add("inputs.unmodified", PASS, "no input tensor changed")

    def outputs(self) -> list[tuple[str, Any]]:
        outs = [("new tokens", _pair(self.main.new)[0]), ("new tokens without LSE", self.main.plain)]
        outs += [(f"context chunk {i}", _pair(c)[0]) for i, c in enumerate(self.main.chunks)]
        return outs

    def lses(self) -> list[tuple[str, Any, Any]]:
        """(where, raw result, lse or None)."""
        res = [("run_prefill_new_tokens(return_softmax_lse=True)", self.main.new)]
        res += [(f"run_prefill_context_chunk({i})", c) for i, c in enumerate(self.main.chunks)]
        return [(w, r, _pair(r)[1]) for w, r in res]

    def check_structure(self) -> None:
        T, H, dv, qk = self.T, self.H, self.dv, self.case.dims[0] + self.case.dims[1]
        want_dtype = self.p.metadata.output_dtype
        shape, unpadded, dtype, dense = [], [], [], []
        for where, out in self.outputs():
            if where == "new tokens without LSE" and isinstance(out, (tuple, list)):
                out = out[0] if out else None  # reported under new_tokens.without_lse
            if not isinstance(out, torch.Tensor):
                shape.append(f"{where}: got {type(out).__name__}, not a tensor")
                continue
            if out.dim() != 3 or tuple(out.shape[:2]) != (T, H):
                shape.append(f"{where}: {_shape(out)}, expected [{T}, {H}, {dv}]")
            elif out.shape[2] != dv:
                if out.shape[2] > dv:
                    padded = " (the qk head dim: V padded for the kernel, output not sliced back)"
                    unpadded.append(
                        f"{where}: last dim {out.shape[2]}, expected v_head_dim {dv}"
                        + (padded if out.shape[2] == qk else "")
                    )
                else:
                    shape.append(f"{where}: {_shape(out)}, expected [{T}, {H}, {dv}]")
            if out.dtype != want_dtype:
                dtype.append(f"{where}: {_dtype_name(out.dtype)}, expected {_dtype_name(want_dtype)}")
            if not out.is_contiguous():
                dense.append(
                    f"{where}: strides {tuple(out.stride())} for shape {_shape(out)} (not contiguous)"
                )
        for prop, bad, good in (
            ("output.shape", shape, f"[{T}, {H}, {dv}]"),
            ("output.unpadded", unpadded, f"last dim {dv}"),
            ("output.dtype", dtype, _dtype_name(want_dtype)),
            ("output.dense", dense, "contiguous"),
        ):
            self.add(prop, FAIL if bad else PASS, "; ".join(bad) if bad else good)

        layout, ltype = [], []
        for where, raw, lse in self.lses():
            if lse is None:
                layout.append(f"{where} returned {type(raw).__name__}, not a tuple (output, lse)")
                continue
            if not isinstance(lse, torch.Tensor):
                layout.append(f"{where}: LSE is {type(lse).__name__}, not a tensor")
                continue
            if tuple(lse.shape) != (H, T):
                hint = " (transposed: [tokens, heads])" if tuple(lse.shape) == (T, H) else ""
                layout.append(
                    f"{where}: LSE shape {_shape(lse)}, expected [num_heads, tokens] = [{H}, {T}]{hint}"
                )
            elif not lse.is_contiguous():
                layout.append(
                    f"{where}: LSE strides {tuple(lse.stride())} (not contiguous; a transposed view?)"
                )
            if lse.dtype != torch.float32:
                ltype.append(f"{where}: LSE {_dtype_name(lse.dtype)}, expected float32")
        self.add(
            "lse.layout", FAIL if layout else PASS, "; ".join(layout) if layout else f"[{H}, {T}], contiguous"
        )
        self.add("lse.dtype", FAIL if ltype else PASS, "; ".join(ltype) if ltype else "float32")
        self.outputs_usable = self.status["output.shape"] == PASS and self.status["output.unpadded"] == PASS
        self.lse_usable = self.status["lse.layout"] == PASS

    # Probes: rerun with keys/values a token must not see perturbed; its results must not move.

    def perturbed(self, rows_new: list[slice], rows_chunk: list[list[slice]]) -> PrefillProblem:
        p = self.p.clone()
        for r in rows_new:
            p.k[r] = p.k[r] * 2 + 3
            p.v[r] += 8
        for c, rs in enumerate(rows_chunk):
            for r in rs:
                p.chunk_k[c][r] = p.chunk_k[c][r] * 2 + 3
                p.chunk_v[c][r] += 8
        return p

    def probe_diff(self, step: _Step, rows: list[slice], chunks: bool) -> tuple[float, float, float, float]:
        """(max |Δout|, out tolerance, max |ΔLSE|, lse tolerance) over ``rows``, vs the main step."""
        pairs = [(_pair(self.main.new), _pair(step.new))]
        if chunks:
            pairs += [(_pair(a), _pair(b)) for a, b in zip(self.main.chunks, step.chunks, strict=True)]
        dout = dlse = ref_max = 0.0
        for (o0, l0), (o1, l1) in pairs:
            for r in rows:
                if isinstance(o0, torch.Tensor) and isinstance(o1, torch.Tensor) and o0.shape == o1.shape:
                    if o0.dim() >= 1 and o0.shape[0] == self.T:
                        dout = max(dout, _max_abs_diff(o0[r], o1[r], nan_equal=True))
                        ref_max = max(ref_max, torch.nan_to_num(o0[r].double()).abs().max().item())
                for a, b in ((l0, l1),):
                    if (
                        isinstance(a, torch.Tensor)
                        and isinstance(b, torch.Tensor)
                        and a.shape == (self.H, self.T)
                    ):
                        if b.shape == a.shape:
                            dlse = max(dlse, _max_abs_diff(a[:, r], b[:, r], nan_equal=True))
        return dout, self.tol.output_rel * ref_max, dlse, self.tol.lse_abs

    def probe(self, prop: str, p: PrefillProblem, rows: list[slice], chunks: bool, what: str) -> bool | None:
        step = _run_step(self.backend, p, with_lse=True, plain=None)
        if step.error:
            self.add(prop, FAIL, f"the probe step raised: {step.error}")
            return False
        dout, out_tol, dlse, lse_tol = self.probe_diff(step, rows, chunks)
        if dout > out_tol or dlse > lse_tol:
            self.add(
                prop,
                FAIL,
                f"{what}: their output moved by max {_fmt(dout)} (tolerance {_fmt(out_tol)}), "
                f"their LSE by max {_fmt(dlse)} (tolerance {_fmt(lse_tol)})",
                dout if dout / max(out_tol, 1e-300) >= dlse / lse_tol else dlse,
                out_tol if dout / max(out_tol, 1e-300) >= dlse / lse_tol else lse_tol,
            )
            return False
        return True

    def check_causal(self) -> None:
        # One request at a time, so that attention across requests (varlen.isolation's) cannot show here.
        for r, (s, e) in enumerate(zip(self.qb[:-1], self.qb[1:], strict=True)):
            if e - s < 2:
                continue
            m = s + (e - s) // 2
            ok = self.probe(
                "causal",
                self.perturbed([slice(m, e)], [[] for _ in self.cb]),
                [slice(s, m)],
                chunks=False,
                what=f"with the second half of request {r}'s new tokens perturbed, its first half must not "
                "change (new tokens see later tokens)",
            )
            if not ok:
                return
        self.add("causal", PASS, "earlier tokens unchanged when later new tokens are perturbed")

    def check_isolation(self) -> None:
        n = len(self.qb) - 1
        for r in (0, n - 1):
            rows_new = [slice(self.qb[r], self.qb[r + 1])]
            rows_chunk = [[slice(cu[r], cu[r + 1])] for cu in self.cb]
            others = [slice(self.qb[j], self.qb[j + 1]) for j in range(n) if j != r]
            ok = self.probe(
                "varlen.isolation",
                self.perturbed(rows_new, rows_chunk),
                others,
                chunks=True,
                what=f"with request {r}'s keys and values perturbed (new tokens and context), the other "
                "requests must not change (attention crosses requests)",
            )
            if not ok:
                return
        self.add("varlen.isolation", PASS, "other requests unchanged when one request is perturbed")

    def paths(self) -> tuple[_Path | None, list[_Path]]:
        """The new-token path and the chunk paths, with their references, on usable tensors."""
        p = self.p
        out_ok, lse_ok = self.outputs_usable, self.lse_usable
        new_out, new_lse = _pair(self.main.new)
        pieces = []
        for s, e in zip(self.qb[:-1], self.qb[1:], strict=True):
            if e > s:
                pieces.append(_Piece(slice(s, e), ScaledReference(p.q[s:e], p.k[s:e], p.v[s:e], causal=True)))
        new_path = _Path("new tokens", pieces, new_out if out_ok else None, new_lse if lse_ok else None)
        chunk_paths = []
        for c, cu in enumerate(self.cb):
            out, lse = _pair(self.main.chunks[c])
            pieces = []
            for r in range(len(self.qb) - 1):
                s, e, ks, ke = self.qb[r], self.qb[r + 1], cu[r], cu[r + 1]
                if e > s and ke > ks:
                    kc, vc = p.chunk_k[c][ks:ke], p.chunk_v[c][ks:ke]
                    pieces.append(_Piece(slice(s, e), ScaledReference(p.q[s:e], kc, vc, causal=False)))
            chunk_paths.append(
                _Path(f"context chunk {c}", pieces, out if out_ok else None, lse if lse_ok else None)
            )
        return new_path, chunk_paths

    def norm_err(self, paths: list[_Path], scale: float) -> tuple[float, float, float, float, float]:
        """(normalised error, out err, out tol, lse err (best base), lse tol) of ``paths`` at ``scale``."""
        out_err = ref_max = lse_err = 0.0
        has_out = has_lse = False
        for path in paths:
            oe, rm, le, le2 = path.errors(scale)
            if path.lse is not None:
                le = min(le, le2)  # either base: the base is lse.natural_log's business
                has_lse = True
            has_out = has_out or path.out is not None
            out_err, ref_max, lse_err = max(out_err, oe), max(ref_max, rm), max(lse_err, le)
        out_tol = self.tol.output_rel * ref_max
        norm = max(
            out_err / out_tol if has_out and out_tol > 0 else 0.0,
            lse_err / self.tol.lse_abs if has_lse else 0.0,
        )
        return norm, out_err, out_tol, lse_err, self.tol.lse_abs

    def check_scale_and_values(self) -> None:
        s0 = self.case.scale
        new_path, chunk_paths = self.paths()
        groups: list[tuple[str, list[_Path]]] = []
        if self.status["causal"] == PASS:
            groups.append(("new tokens", [new_path]))
        if chunk_paths:
            groups.append(("context chunks", chunk_paths))
        usable = self.outputs_usable or self.lse_usable
        isolated = self.status["varlen.isolation"] != FAIL
        eff: dict[str, float] = {}
        fails, undetermined, passes = [], [], []
        worst: tuple[float, float] = (0.0, 0.0)
        for name, paths in groups if usable and isolated else []:
            norm, oe, ot, le, lt = self.norm_err(paths, s0)
            at_s0 = (
                f"max |out - ref| = {_fmt(oe)} (tolerance {_fmt(ot)}), "
                f"max |lse - ref| = {_fmt(le)} (tolerance {_fmt(lt)})"
            )
            if norm <= 1.0:
                eff[name] = s0
                passes.append(name)
                continue
            best, best_norm = _fit(lambda s, paths=paths: self.norm_err(paths, s)[0], s0)
            if oe / max(ot, 1e-300) >= le / lt:
                worst = max(worst, (oe, ot), key=lambda x: x[0] / max(x[1], 1e-300))
            else:
                worst = max(worst, (le, lt), key=lambda x: x[0] / max(x[1], 1e-300))
            if best_norm <= 1.0:
                eff[name] = best
                fails.append((name, best, at_s0))
            else:
                undetermined.append(f"{name}: no scale in [self.scale/4, 4 x self.scale] fits ({at_s0})")
        if not isolated:
            self.blocked("scale", ["varlen.isolation"])
        elif not usable or not groups:
            self.add(
                "scale",
                SKIP,
                "not evaluated: neither outputs nor LSEs are usable"
                if not usable
                else "not evaluated: no path to check",
            )
        elif fails:
            self.add("scale", FAIL, self.scale_message(fails), worst[0], worst[1])
        elif undetermined:
            self.add("scale", SKIP, "not determined (see the value checks): " + "; ".join(undetermined))
        else:
            self.add("scale", PASS, f"self.scale {s0:.6g} used ({', '.join(passes)})")
        if self.status["scale"] == FAIL:
            note = " (at the scale the backend uses; see scale)"
        else:
            note = ""
        self.check_values(new_path, chunk_paths, eff, note)

    def scale_message(self, fails: list[tuple[str, float, str]]) -> str:
        s0 = self.case.scale
        bests = [b for _, b, _ in fails]
        if max(bests) / min(bests) - 1 < _SAME_SCALE:  # one wrong scale for every path
            best = sum(bests) / len(bests)
            fitted = [(" and ".join(n for n, _, _ in fails), best)]
        else:
            fitted = [(n, b) for n, b, _ in fails]
        parts = [
            f"{names} compute with scale {b:.6g} = {b / s0:.4f} x self.scale {s0:.6g}{self.known_scale(b)}"
            for names, b in fitted
        ]
        at_s0 = "; ".join(f"{n}: {a}" for n, _, a in fails)
        return "; ".join(parts) + f" (at self.scale, {at_s0})"

    def known_scale(self, s: float) -> str:
        nope, rope, v = self.case.dims
        for name, value in (
            ("1/sqrt(qk_head_dim), the default scale: self.scale is ignored", (nope + rope) ** -0.5),
            ("1/sqrt(v_head_dim)", v**-0.5),
            ("1/sqrt(qk_nope_head_dim)", nope**-0.5),
            ("1", 1.0),
        ):
            if abs(s / value - 1) < 5e-3:
                return f" = {name}"
        return ""

    def check_values(
        self, new_path: _Path, chunk_paths: list[_Path], eff: dict[str, float], note: str
    ) -> None:
        s0 = self.case.scale
        s_new = eff.get("new tokens", s0)
        s_ctx = eff.get("context chunks", s0)
        # new_tokens.values
        if not self.blocked(
            "new_tokens.values", ["output.shape", "output.unpadded", "causal", "varlen.isolation"]
        ):
            oe, rm, _, _ = new_path.errors(s_new)
            self.measured("new_tokens.values", "max |out - ref|" + note, oe, self.tol.output_rel * rm)
        # new_tokens.without_lse
        plain = self.main.plain
        if isinstance(plain, (tuple, list)):
            self.add(
                "new_tokens.without_lse",
                FAIL,
                f"return_softmax_lse=False returned a {type(plain).__name__} of {len(plain)}, "
                "not the output tensor",
            )
        elif not self.blocked(
            "new_tokens.without_lse", ["output.shape", "output.unpadded", "causal", "varlen.isolation"]
        ):
            oe, rm, _, _ = _Path("plain", new_path.pieces, plain, None).errors(s_new)
            self.measured("new_tokens.without_lse", "max |out - ref|" + note, oe, self.tol.output_rel * rm)
        # context_chunk.values
        if not chunk_paths:
            self.add("context_chunk.values", SKIP, "no context in this case")
        elif not self.blocked(
            "context_chunk.values", ["output.shape", "output.unpadded", "varlen.isolation"]
        ):
            oe = rm = 0.0
            for path in chunk_paths:
                e, m, _, _ = path.errors(s_ctx)
                oe, rm = max(oe, e), max(rm, m)
            self.measured("context_chunk.values", "max |out - ref|" + note, oe, self.tol.output_rel * rm)
        # lse.natural_log
        if not self.blocked("lse.natural_log", ["lse.layout", "varlen.isolation"]):
            lse_paths = [(new_path, s_new)] if self.status["causal"] == PASS else []
            lse_paths += [(cp, s_ctx) for cp in chunk_paths]
            errs = [p.errors(s) for p, s in lse_paths]
            err = max((e[2] for e in errs), default=0.0)
            err2 = max((e[3] for e in errs), default=0.0)
            extra = ""
            if err > self.tol.lse_abs and err2 <= self.tol.lse_abs:
                extra = (
                    f"the LSE is in base 2 (times ln 2 it matches to {_fmt(err2)}): convert it "
                    "(lse * ln 2) for merge_attn_states, which uses exp"
                )
            if self.status["causal"] != PASS:
                extra += ("; " if extra else "") + "new-token LSE not compared (causal failed)"
            self.measured("lse.natural_log", "max |lse - ref|" + note, err, self.tol.lse_abs, extra)
        # context_chunk.empty
        self.check_empty_rows()
        # merge.whole_sequence
        if not self.blocked("merge.whole_sequence", ["output.shape", "output.unpadded", "lse.layout"]):
            if not self.cb:
                self.add("merge.whole_sequence", SKIP, "no context in this case")
            else:
                # One scale for the whole sequence: the paths' own, when they agree.
                s = (s_new + s_ctx) / 2 if abs(s_new / s_ctx - 1) < _SAME_SCALE else s0
                self.check_merge(s, note if s != s0 else "")

    def check_empty_rows(self) -> None:
        if not self.cb:
            self.add("context_chunk.empty", SKIP, "no context in this case")
            return
        if self.blocked("context_chunk.empty", ["output.shape", "lse.layout"]):
            return
        bad, n = [], 0
        for c, cu in enumerate(self.cb):
            out, lse = _pair(self.main.chunks[c])
            for r in range(len(self.qb) - 1):
                s, e = self.qb[r], self.qb[r + 1]
                if cu[r + 1] > cu[r] or e == s:
                    continue
                n += 1
                lr, orow = lse[:, s:e].float(), out[s:e]
                if not bool((torch.isinf(lr) | (lr <= _EMPTY_LSE)).all()):
                    bad.append(f"chunk {c}, request {r}: LSE max {_fmt(lr.max().item())}, expected -inf")
                if not bool(torch.isfinite(orow).all()):
                    bad.append(f"chunk {c}, request {r}: output not finite (NaN or inf poisons the merge)")
        if bad:
            self.add("context_chunk.empty", FAIL, "; ".join(bad))
        else:
            self.add(
                "context_chunk.empty", PASS, f"{n} empty (chunk, request) pairs: LSE -inf, output finite"
            )

    def check_merge(self, scale: float, note: str) -> None:
        p = self.p
        outs = [_pair(c) for c in self.main.chunks]
        try:
            ctx_out, ctx_lse = outs[0]
            for o, lse in outs[1:]:
                ctx_out, ctx_lse = merge_attn_states_any(ctx_out, ctx_lse, o, lse)
            new_out, new_lse = _pair(self.main.new)
            merged, _ = merge_attn_states_any(ctx_out, ctx_lse, new_out, new_lse)
            _sync(self.device)
        except Exception as e:
            self.add("merge.whole_sequence", FAIL, f"merge_attn_states raised {type(e).__name__}: {e}")
            return
        err = ref_max = 0.0
        for r in range(len(self.qb) - 1):
            s, e = self.qb[r], self.qb[r + 1]
            if e == s:
                continue
            ks = [p.chunk_k[c][cu[r] : cu[r + 1]] for c, cu in enumerate(self.cb)] + [p.k[s:e]]
            vs = [p.chunk_v[c][cu[r] : cu[r + 1]] for c, cu in enumerate(self.cb)] + [p.v[s:e]]
            ref, _ = ScaledReference(p.q[s:e], torch.cat(ks), torch.cat(vs), causal=True)(scale)
            err = max(err, _max_abs_diff(merged[s:e], ref))
            ref_max = max(ref_max, ref.abs().max().item())
        upstream = [
            prop
            for prop in (
                "causal",
                "varlen.isolation",
                "lse.natural_log",
                "new_tokens.values",
                "context_chunk.values",
                "context_chunk.empty",
            )
            if self.status.get(prop) == FAIL
        ]
        extra = (
            f"expected, given {', '.join(upstream)}"
            if upstream and err > self.tol.output_rel * ref_max
            else ""
        )
        self.measured(
            "merge.whole_sequence", "max |merged - ref|" + note, err, self.tol.output_rel * ref_max, extra
        )

    def check_restep(self) -> None:
        """Steps of other shapes on one instance; each must equal a fresh instance's step."""
        try:
            reused = self.new_backend()
        except Exception as e:
            self.add(
                "metadata.restep", FAIL, f"constructing a second instance raised {type(e).__name__}: {e}"
            )
            return
        sequence: list[tuple[str, PrefillProblem, _Step | None]] = [("step 1", self.p, None)]
        for i, (new, ctx, chunks) in enumerate(RESTEP_SHAPES):
            sequence.append((f"step {i + 2}", self.problem(new, ctx, chunks), None))
        sequence.append((f"step {len(sequence) + 1} (the first shapes again)", self.p, self.main))
        worst, problems = (0.0, 0.0), []
        for label, prob, fresh_step in sequence:
            has_ctx = prob.has_context
            c = prob.clone()
            got = _run_step(reused, c, with_lse=has_ctx, plain=None if has_ctx else c)
            if label == "step 1":
                continue
            if fresh_step is None:
                try:
                    c = prob.clone()
                    fresh_step = _run_step(
                        self.new_backend(), c, with_lse=has_ctx, plain=None if has_ctx else c
                    )
                except Exception as e:
                    fresh_step = _Step(error=f"constructing raised {type(e).__name__}: {e}")
            desc = f"{label}: {len(prob.new_lens)} requests, new tokens {prob.new_lens}, " + (
                f"context {prob.context_lens} in {len(prob.chunk_k)} chunks" if has_ctx else "no context"
            )
            if got.error:
                problems.append(f"{desc}: {got.error}")
                continue
            if fresh_step.error:
                continue  # a fresh instance fails too: not a restep problem (runs covers the main shapes)
            if has_ctx:  # as vLLM calls them: with LSE and the chunks with context, else without
                pairs = [("new tokens", got.new, fresh_step.new)]
                pairs += [
                    (f"chunk {i}", x, y)
                    for i, (x, y) in enumerate(zip(got.chunks, fresh_step.chunks, strict=True))
                ]
            else:
                pairs = [("new tokens without LSE", got.plain, fresh_step.plain)]
            for what, a, b in pairs:
                if b is None:
                    continue
                for part, x, y in zip(("output", "LSE"), _pair(a), _pair(b), strict=True):
                    if not isinstance(y, torch.Tensor):
                        continue
                    if not isinstance(x, torch.Tensor) or x.shape != y.shape:
                        problems.append(
                            f"{desc}: {what} {part} shape {_shape(x)}, a fresh instance's {_shape(y)}"
                        )
                        continue
                    d = _max_abs_diff(x, y, nan_equal=True)
                    tol = (
                        self.tol.lse_abs
                        if part == "LSE"
                        else self.tol.output_rel
                        * torch.nan_to_num(y.double(), posinf=0, neginf=0).abs().max().item()
                    )
                    if d > tol:
                        problems.append(
                            f"{desc}: {what} {part} differs from a fresh instance's by {_fmt(d)} "
                            f"(tolerance {_fmt(tol)})"
                        )
                        if d / max(tol, 1e-300) > worst[0] / max(worst[1], 1e-300):
                            worst = (d, tol)
        if problems:
            self.add(
                "metadata.restep",
                FAIL,
                "the backend carries state of an earlier step: " + "; ".join(problems),
                worst[0] if worst[1] else None,
                worst[1] if worst[1] else None,
            )
        else:
            self.add("metadata.restep", PASS, f"{len(sequence) - 1} further steps equal fresh instances'")


# ----------------------------------------------------------------------------- entry points


def _resolve(backend: Any) -> type[MLAPrefillBackend]:
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, load_backend_class, lookup

    if isinstance(backend, type):
        if not issubclass(backend, MLAPrefillBackend):
            raise TypeError(f"{backend!r} is not a subclass of mla_prefill_ext.MLAPrefillBackend")
        return backend
    if isinstance(backend, MLAPrefillBackendEnum):
        return backend.get_class()
    if isinstance(backend, str):
        if ":" in backend or "." in backend:  # a class path, 'pkg.mod.Class' or 'pkg.mod:Class'
            return load_backend_class(backend.replace(":", "."), backend)
        return lookup(backend).get_class()
    raise TypeError(
        "run_conformance() takes a backend class, an MLAPrefillBackendEnum member, a backend name or a "
        f"class path, not {type(backend).__name__}"
    )


def _dtypes(dtype: Any) -> list[torch.dtype]:
    if dtype is None:
        return list(DEFAULT_DTYPES)
    items = [dtype] if isinstance(dtype, (torch.dtype, str)) else list(dtype)
    out = []
    for d in items:
        if isinstance(d, str):
            d = getattr(torch, d.removeprefix("torch."), None)
        if d not in TOLERANCES:
            raise ValueError(
                f"conformance dtype must be one of {', '.join(map(_dtype_name, TOLERANCES))}, not {d}"
            )
        out.append(d)
    return out


def run_conformance(
    backend: type[MLAPrefillBackend] | str | Any,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | Sequence[torch.dtype | str] | None = None,
    *,
    dims: Sequence[tuple[int, int, int]] = DEFAULT_DIMS,
    num_heads: Sequence[int] = DEFAULT_NUM_HEADS,
    scale: float | None = None,
    seed: int = 0,
    kv_lora_rank: int = KV_LORA_RANK,
) -> ConformanceReport:
    """Check ``backend`` against every property in :data:`PROPERTIES`; never raises for a bad backend.

    ``backend``: a backend class, an ``MLAPrefillBackendEnum`` member, a registered name
    (``"TORCH_SDPA"``) or a class path (``"pkg.mod.Class"`` or ``"pkg.mod:Class"``).
    ``device``: ``"cpu"`` or ``"cuda"`` (default: CUDA when available).
    ``dtype``: one dtype, several, or None for bfloat16, float16 and float32 (each case the
    backend's ``validate_configuration`` refuses is skipped with its reasons).
    ``dims``: (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) triples; ``num_heads``: head
    counts. ``scale``: the softmax scale to construct the backend with (default:
    DeepSeek's YaRN-scaled scale for the qk head dim, about 1.59 / sqrt(qk_head_dim),
    so that a backend using 1/sqrt(qk_head_dim) is caught).
    """
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability

    t0 = time.perf_counter()
    cls = _resolve(backend)
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("run_conformance(device='cuda'): CUDA is not available in this process")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cap = current_device_capability() if dev.type == "cuda" else None
    cases = [
        ConformanceCase(d, tuple(dm), h, scale if scale is not None else deepseek_yarn_scale(dm[0] + dm[1]))
        for d in _dtypes(dtype)
        for dm in dims
        for h in num_heads
    ]
    merge = (
        "vLLM's merge_attn_states (vllm.v1.attention.ops.merge_attn_states)"
        if dev.type == "cuda"
        else "merge_attn_states_torch: vLLM's merge_attn_states rule in torch, same float32 math "
        "(vLLM's op needs CUDA or Triton, which a CPU lacks)"
    )
    report = ConformanceReport(
        backend=cls.get_name(),
        backend_class=f"{cls.__module__}.{cls.__qualname__}",
        device=str(dev),
        capability=None if cap is None else f"{cap.major}.{cap.minor}",
        merge=merge,
        cases=cases,
        skipped_cases={},
    )
    for case in cases:
        config = MLAPrefillSelectorConfig.from_dims(case.dtype, *case.dims)
        try:
            reasons = cls.validate_configuration(cap, config)
        except Exception as e:
            report.results.append(
                CheckResult(
                    "runs", case.label, FAIL, f"validate_configuration raised {type(e).__name__}: {e}"
                )
            )
            continue
        if reasons:
            report.skipped_cases[case.label] = "; ".join(reasons)
            continue
        report.results.extend(_CaseCheck(cls, case, dev, seed, kv_lora_rank).run())
    report.duration_s = time.perf_counter() - t0
    return report


def assert_conformant(backend: Any, *args: Any, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising AssertionError with the formatted report unless it passed.

    Also raises when every case was skipped: a backend that runs nowhere here proves nothing.
    """
    report = run_conformance(backend, *args, **kwargs)
    if not report.ok:
        raise AssertionError("\n" + report.format())
    return report
