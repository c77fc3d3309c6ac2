"""A backend that raises during a step: its own exception goes on, with one note naming the call.

Where the add-on calls a backend's method on the step path (the step's preparation, the new
tokens, a context chunk, a shared-prefix pass), an exception is never caught to fall back or
retry: it propagates unchanged into vLLM's worker, which stops the engine with its traceback,
as it does for a failing kernel of its own. The one thing added is a note (PEP 678, printed
under the exception's message in every traceback) that names the backend and what it was
doing; the try around a call costs nothing on Python 3.11 while nothing raises.
"""

from __future__ import annotations

from typing import Any

_MARK = "mla-prefill-ext: MLA prefill backend "


def _tensor(name: str, t: Any) -> str:
    shape = getattr(t, "shape", None)
    if shape is None:
        return f"{name} {type(t).__name__}"
    return (
        f"{name} [{', '.join(str(d) for d in shape)}] {str(getattr(t, 'dtype', '?')).removeprefix('torch.')}"
    )


def _backend(backend: Any) -> str:
    cls = type(backend)
    try:
        name = cls.get_name()
    except Exception:  # only the note's wording: the backend's own exception still goes on
        name = cls.__name__
    return f"{name} ({cls.__module__}.{cls.__qualname__})"


def note_backend_error(error: BaseException, backend: Any, call: str, **tensors: Any) -> None:
    """Add the note naming ``backend`` and ``call`` (e.g. ``"run_prefill_context_chunk, context
    chunk 2"``) to ``error``, with the shapes and dtypes of ``tensors``; the caller re-raises.

    Called at exactly one place per call path, the one that calls the backend's method: no site
    wraps another, so an exception carries one note (a second would show a doubled site).
    """
    shapes = ", ".join(_tensor(name, t) for name, t in tensors.items())
    error.add_note(
        f"{_MARK}{_backend(backend)} raised in {call}{f' ({shapes})' if shapes else ''}. No other "
        "backend takes over: the engine stops, as for a failing vLLM kernel "
        "(MLA_PREFILL_EXT_DISABLE=1 runs vLLM's own MLA prefill)."
    )


def is_backend_error(error: BaseException) -> bool:
    """Whether ``error`` came out of a backend's method on the step path (it carries the note)."""
    return any(isinstance(n, str) and n.startswith(_MARK) for n in getattr(error, "__notes__", ()))
