"""The conformance checks reach a backend only through the calling convention they are given."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.testing.case_run import check_case
from mla_prefill_ext.testing.cases import make_cases
from mla_prefill_ext.testing.conventions import ChunkIndexConvention, StepResult
from mla_prefill_ext.testing.problem import PrefillProblem

pytestmark = pytest.mark.usefixtures("clean_selection")


class Watched(TorchSDPAPrefillBackend):
    """TORCH_SDPA that records each instance built and each call made while no convention runs a step."""

    built: ClassVar[list[int]] = []
    stepping: ClassVar[list[bool]] = []  # non-empty while a convention runs a step
    outside: ClassVar[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Watched.built.append(id(self))

    def _called(self, name: str) -> None:
        if not Watched.stepping:
            Watched.outside.append(name)

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        self._called("prepare_metadata")
        super().prepare_metadata(prefill_metadata)

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
        self._called("run_prefill_new_tokens")
        return super().run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):  # type: ignore[no-untyped-def]
        self._called("run_prefill_context_chunk")
        return super().run_prefill_context_chunk(chunk_idx, q, k, v)


class RecordingConvention(ChunkIndexConvention):
    """vLLM 0.20's convention, recording what it constructs and the steps it runs."""

    def __init__(self) -> None:
        self.constructed: list[int] = []
        self.steps: list[tuple[int, bool, bool]] = []  # (instance, with LSE, without LSE too)

    def construct(self, cls: type[MLAPrefillBackend], kwargs: dict[str, Any]) -> MLAPrefillBackend:
        backend = super().construct(cls, kwargs)
        self.constructed.append(id(backend))
        return backend

    def run_step(
        self,
        backend: MLAPrefillBackend,
        problem: PrefillProblem,
        with_lse: bool,
        plain: PrefillProblem | None,
    ) -> StepResult:
        self.steps.append((id(backend), with_lse, plain is not None))
        Watched.stepping.append(True)
        try:
            return super().run_step(backend, problem, with_lse, plain)
        finally:
            Watched.stepping.pop()


def test_every_check_goes_through_the_calling_convention() -> None:
    Watched.built.clear()
    Watched.outside.clear()
    convention = RecordingConvention()
    (case,) = make_cases([torch.float32], [(64, 32, 64)], [2], None)
    results = check_case(Watched, case, torch.device("cpu"), 0, 512, convention)

    assert {r.status for r in results} == {"pass"}, [r for r in results if r.status != "pass"]
    assert Watched.outside == []
    # The main instance, the one metadata.restep reuses, and a fresh one per new restep shape.
    assert len(convention.constructed) == 4 and Watched.built == convention.constructed
    main = convention.constructed[0]
    # The main step (with and without LSE), 3 causal probes, 2 isolation probes; then restep's.
    assert convention.steps[:6] == [(main, True, True)] + [(main, True, False)] * 5
    assert {b for b, _, _ in convention.steps[6:]} == set(convention.constructed[1:])
