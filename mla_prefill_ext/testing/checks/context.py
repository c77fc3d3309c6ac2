"""What every check of one case reads: the case's driver, its main problem, the backend and its main step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.testing.cases import ConformanceCase
from mla_prefill_ext.testing.conventions import CallingConvention, StepResult
from mla_prefill_ext.testing.problem import PrefillProblem
from mla_prefill_ext.testing.tolerances import TOLERANCES, Tolerance


class BackendDriver:
    """Builds a case's backend instances and problems, and runs steps through one calling convention."""

    def __init__(
        self,
        cls: type[MLAPrefillBackend],
        case: ConformanceCase,
        device: torch.device,
        seed: int,
        kv_lora_rank: int,
        convention: CallingConvention,
    ) -> None:
        self.cls, self.case, self.device, self.seed = cls, case, device, seed
        self.kwargs: dict[str, Any] = case.layer_kwargs(kv_lora_rank)
        self.convention = convention

    def new_backend(self) -> MLAPrefillBackend:
        return self.convention.construct(self.cls, self.kwargs)

    def problem(self, new_lens: list[int], context_lens: list[int] | None, chunks: int) -> PrefillProblem:
        return self.case.problem(new_lens, context_lens, chunks, self.device, self.seed)

    def step(
        self,
        backend: MLAPrefillBackend,
        problem: PrefillProblem,
        with_lse: bool,
        plain: PrefillProblem | None,
    ) -> StepResult:
        return self.convention.run_step(backend, problem, with_lse, plain)


@dataclass(frozen=True)
class CaseContext:
    """The backend instance that ran the case's main step, what it returned, and the step's shape."""

    driver: BackendDriver
    problem: PrefillProblem  # the main step's inputs as made (the backend ran on copies)
    backend: MLAPrefillBackend
    main: StepResult
    query_bounds: list[int]  # token offsets of the requests: [0, n0, n0 + n1, ...]
    chunk_bounds: list[list[int]]  # per chunk, the offsets of the requests' keys in it

    @classmethod
    def of(
        cls, driver: BackendDriver, problem: PrefillProblem, backend: MLAPrefillBackend, main: StepResult
    ) -> CaseContext:
        return cls(driver, problem, backend, main, problem.query_bounds(), problem.chunk_bounds())

    @property
    def case(self) -> ConformanceCase:
        return self.driver.case

    @property
    def tol(self) -> Tolerance:
        return TOLERANCES[self.case.dtype]

    @property
    def tokens(self) -> int:
        return self.problem.q.shape[0]

    @property
    def heads(self) -> int:
        return self.case.num_heads

    @property
    def v_head_dim(self) -> int:
        return self.case.dims[2]

    @property
    def num_requests(self) -> int:
        return len(self.query_bounds) - 1

    def request_rows(self, r: int) -> slice:
        """Request ``r``'s new tokens (rows of q and of every output)."""
        return slice(self.query_bounds[r], self.query_bounds[r + 1])
