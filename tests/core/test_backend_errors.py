"""The note a backend's exception carries out of the step path: what it says, once, and nothing else changed.

Through vLLM's real layers, on each host: tests/hosts/core/test_backend_raising_mid_step.py and the
shared-prefix path's test_a_backend_raising_on_the_path_stops_the_step_with_its_own_exception.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from custom_backends import RaisingSDPABackend

from mla_prefill_ext.backend_errors import is_backend_error, note_backend_error


def backend() -> RaisingSDPABackend:
    """An instance, never run: the note reads only its class."""
    return object.__new__(RaisingSDPABackend)


def call_site(b: object, call: str, error: BaseException, **tensors: object) -> None:
    """What every call site on the step path does."""
    try:
        raise error
    except Exception as e:
        note_backend_error(e, b, call, **tensors)
        raise


def test_the_note_names_the_backend_the_call_and_its_tensors():
    q = torch.zeros(7, 4, 192, dtype=torch.bfloat16)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as info:
        call_site(
            backend(), "run_prefill_context_chunk, context chunk 2", error, q=q, k=q[:5], v=q[:5, :, :128]
        )
    assert info.value is error and str(error) == "CUDA error: an illegal memory access was encountered"
    assert is_backend_error(error)
    assert error.__notes__ == [
        "mla-prefill-ext: MLA prefill backend RAISING_SDPA (custom_backends.RaisingSDPABackend) raised in "
        "run_prefill_context_chunk, context chunk 2 (q [7, 4, 192] bfloat16, k [5, 4, 192] bfloat16, "
        "v [5, 4, 128] bfloat16). No other backend takes over: the engine stops, as for a failing vLLM "
        "kernel (MLA_PREFILL_EXT_DISABLE=1 runs vLLM's own MLA prefill)."
    ]
    # Printed with the traceback vLLM's worker logs, under the exception's own line.
    printed = "".join(traceback.format_exception(error))
    assert printed.index("RuntimeError: CUDA error") < printed.index("mla-prefill-ext: MLA prefill backend")


def test_the_exceptions_own_notes_stay_and_other_exceptions_are_not_the_backends():
    error = RuntimeError("out of memory")
    error.add_note("the backend's own note")
    assert not is_backend_error(error) and not is_backend_error(RuntimeError("x"))
    with pytest.raises(RuntimeError):
        call_site(backend(), "run_prefill_new_tokens", error)
    assert error.__notes__[0] == "the backend's own note" and is_backend_error(error)


def test_a_backend_whose_name_fails_still_raises_its_own_exception():
    class Nameless(RaisingSDPABackend):
        @staticmethod
        def get_name() -> str:
            raise NotImplementedError

    error = RuntimeError("kernel failed")
    with pytest.raises(RuntimeError) as info:
        call_site(object.__new__(Nameless), "run_prefill_new_tokens", error)
    assert info.value is error
    assert "backend Nameless (" in error.__notes__[0]
    assert ".Nameless) raised in run_prefill_new_tokens." in error.__notes__[0]
