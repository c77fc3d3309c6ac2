"""What a calling convention is: how the suite constructs a backend and runs one step, and what it gets back.

The checks see a backend only through a :class:`CallingConvention` and the :class:`StepResult`
it returns, so a host that calls backends differently (a newer vLLM that hands each context
chunk as an object) is one more convention beside ``chunk_index``, not a change to the checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.testing.problem import PrefillProblem


@dataclass(frozen=True)
class StepResult:
    """What one step returned: run_prefill_new_tokens with/without LSE, and each chunk.

    Each result is the backend's raw return value, as the checks judge it: ``(output, lse)``
    or the output alone, for every new token of the step. ``error`` says which call raised
    (the results before it are kept; the checks use none of them once a step has an error).
    """

    new: Any = None
    plain: Any = None
    chunks: list[Any] = field(default_factory=list)
    error: str | None = None


class CallingConvention(Protocol):
    """How a host constructs a prefill backend and drives one MLA prefill step through it."""

    def construct(self, cls: type[MLAPrefillBackend], kwargs: dict[str, Any]) -> MLAPrefillBackend:
        """An instance built as the host's MLA layer builds it, with the layer's ``kwargs``."""
        ...

    def run_step(
        self,
        backend: MLAPrefillBackend,
        problem: PrefillProblem,
        with_lse: bool,
        plain: PrefillProblem | None,
    ) -> StepResult:
        """One step on ``problem``; never raises (a failing call is reported in ``error``).

        ``with_lse``: call the new tokens with ``return_softmax_lse=True``; ``plain``: also call
        them with ``return_softmax_lse=False``, on these inputs (a copy: in vLLM no k or v reaches
        two calls). Every context chunk of ``problem`` runs.
        """
        ...

    def new_tokens_call(self, with_lse: bool) -> str:
        """How the report names the new-token call (e.g. in 'X raised' and LSE messages)."""
        ...

    def chunk_call(self, index: int) -> str:
        """How the report names the call of context chunk ``index``."""
        ...


def pair(ret: Any) -> tuple[Any, Any]:
    """(output, lse) from a result that should be a 2-tuple; (ret, None) otherwise."""
    if isinstance(ret, (tuple, list)) and len(ret) == 2:
        return ret[0], ret[1]
    return ret, None


def drive_step(
    convention: CallingConvention,
    problem: PrefillProblem,
    with_lse: bool,
    plain: PrefillProblem | None,
    prepare: Callable[[], None],
    new_tokens: Callable[[PrefillProblem, bool], Any],
    chunk: Callable[[int, torch.Tensor, torch.Tensor], Any],
) -> StepResult:
    """One step in the order every host runs it, each call named as ``convention`` names it.

    ``prepare()`` prepares the step's metadata; ``new_tokens(problem, with_lse)`` and
    ``chunk(index, k, v)`` make the backend's calls as the host makes them. Never raises:
    the first call that raises ends the step, and the result says which it was.
    """
    p = problem
    new = plain_out = None
    chunks: list[Any] = []
    where = "prepare_metadata"
    try:
        prepare()
        if with_lse:
            where = convention.new_tokens_call(True)
            new = new_tokens(p, True)
        if plain:
            where = convention.new_tokens_call(False)
            plain_out = new_tokens(plain, False)
        for i, (kc, vc) in enumerate(zip(p.chunk_k, p.chunk_v, strict=True)):
            where = convention.chunk_call(i)
            chunks.append(chunk(i, kc, vc))
        where = "the step (synchronizing the device)"
        synchronize(p.q.device)
    except Exception as e:  # reported, never raised: the report says where
        return StepResult(new, plain_out, chunks, f"{where} raised {type(e).__name__}: {e}")
    return StepResult(new, plain_out, chunks)


def synchronize(device: torch.device) -> None:
    """Wait for the device, so that an asynchronous kernel error surfaces in the call that caused it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
