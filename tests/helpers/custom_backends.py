"""Out-of-tree MLA prefill backends for the registry tests.

An importable module (not the test file) so that a spawned child process can load
these classes by class path, as vLLM's engine and worker processes would. The
registry is deliberately not imported at module level: :func:`child_view` imports
it inside the child, where it must pick the parent's registrations up from the
environment.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mla_prefill_ext.backends.base import KernelWarmup
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


class WrappedSDPABackend(TorchSDPAPrefillBackend):
    """A real, runnable backend: TORCH_SDPA under another name."""

    @staticmethod
    def get_name() -> str:
        return "WRAPPED_SDPA"


class WarmingSDPABackend(TorchSDPAPrefillBackend):
    """TORCH_SDPA declaring a warm-up of every variant; records each call as (instance, what, argument).

    The instance itself, not its id(): the list keeps it alive, so a later instance cannot reuse its
    address and pass for it."""

    kernel_warmup = KernelWarmup(note="a test backend that warms every variant")
    calls: ClassVar[list[tuple[Any, str, Any]]] = []

    @staticmethod
    def get_name() -> str:
        return "WARMING_SDPA"

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        self.calls.append((self, "prepare_metadata", type(prefill_metadata).__name__))
        super().prepare_metadata(prefill_metadata)

    def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        self.calls.append((self, "new_tokens", return_softmax_lse))
        return super().run_prefill_new_tokens(q, k, v, return_softmax_lse)

    def run_prefill_context_chunk(self, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        self.calls.append((self, "context_chunk", chunk_idx))
        return super().run_prefill_context_chunk(chunk_idx, q, k, v)


class RaisingSDPABackend(TorchSDPAPrefillBackend):
    """TORCH_SDPA that raises on its Nth call (``fail_at``), counted over its three step methods and
    all its instances (the layer's, the builder's clones, the bridge's chunk views, the shared-prefix
    segment instance). Each call is recorded as ``(method, what it served, outcome)``: ``what`` is the
    type of the step metadata it was given or runs on, and the chunk index; ``raised`` holds what it
    raised. Calls before the Nth run TORCH_SDPA's own code."""

    fail_at: ClassVar[int | None] = None
    calls: ClassVar[list[list[str]]] = []
    raised: ClassVar[list[BaseException]] = []

    @staticmethod
    def get_name() -> str:
        return "RAISING_SDPA"

    @classmethod
    def arm(cls, fail_at: int | None) -> None:
        cls.fail_at, cls.calls, cls.raised = fail_at, [], []

    def _enter(self, method: str, what: str) -> list[str]:
        call = [method, what, "running"]
        self.calls.append(call)
        if len(self.calls) == self.fail_at:
            call[2] = "raised"
            self.raised.append(
                RuntimeError(f"RAISING_SDPA: call {len(self.calls)} ({method}) fails, as asked")
            )
            raise self.raised[-1]
        return call

    def prepare_metadata(self, prefill_metadata: Any) -> None:
        call = self._enter("prepare_metadata", type(prefill_metadata).__name__)
        super().prepare_metadata(prefill_metadata)
        call[2] = "returned"

    def run_prefill_new_tokens(self, q: Any, k: Any, v: Any, return_softmax_lse: bool) -> Any:
        call = self._enter("run_prefill_new_tokens", type(self._prefill_metadata).__name__)
        result = super().run_prefill_new_tokens(q, k, v, return_softmax_lse)
        call[2] = "returned"
        return result

    def run_prefill_context_chunk(self, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        call = self._enter(
            "run_prefill_context_chunk", f"{type(self._prefill_metadata).__name__} {chunk_idx}"
        )
        result = super().run_prefill_context_chunk(chunk_idx, q, k, v)
        call[2] = "returned"
        return result


class FailingWarmupBackend(TorchSDPAPrefillBackend):
    """Declares a warm-up of its context-chunk kernel, which cannot be built on this host."""

    kernel_warmup = KernelWarmup(new_tokens=False, new_tokens_lse=False)

    @staticmethod
    def get_name() -> str:
        return "FAILING_WARMUP"

    def run_prefill_context_chunk(self, chunk_idx: int, q: Any, k: Any, v: Any) -> Any:
        raise RuntimeError("building the context-chunk kernel failed: no compiler on this host")


class DtypeRecordingBackend(TorchSDPAPrefillBackend):
    """Stands in for FLASHINFER (a backend vLLM quantizes prefill queries for, given an FP8 KV cache):
    records the (query dtype, model dtype) each warm-up is handed, and runs nothing."""

    supports_fp8_query = True
    warmups: ClassVar[list[tuple[Any, Any]]] = []

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    def warm_up(self, device: Any, q_data_type: Any, output_dtype: Any) -> None:
        self.warmups.append((q_data_type, output_dtype))


class Outer:
    class NestedSDPABackend(TorchSDPAPrefillBackend):
        """Registered by qualname 'Outer.NestedSDPABackend'."""

        @staticmethod
        def get_name() -> str:
            return "NESTED_SDPA"


class NotABackend:
    """A class, but not an MLAPrefillBackend."""


NOT_A_CLASS = 42


def child_view(name: str) -> tuple[bool, str, str, str]:
    """Run in a spawned child: what the registry there makes of backend ``name``.

    Returns (name is a member, its class path, the class's __name__, its get_name()).
    """
    from mla_prefill_ext.registry import MLAPrefillBackendEnum

    is_member = name in MLAPrefillBackendEnum.__members__
    member = MLAPrefillBackendEnum[name]
    cls = member.get_class()
    return is_member, member.get_path(), cls.__name__, cls.get_name()
