"""Backend classes by class path: import one and check it can serve as an MLA prefill backend."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mla_prefill_ext.backends.base import MLAPrefillBackend

__all__ = ["backend_class_problem", "load_backend_class", "validate_class_path"]


def load_backend_class(class_path: str, name: str) -> type[MLAPrefillBackend]:
    """Import ``class_path`` and check it is an MLAPrefillBackend; errors name the path."""

    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        raise ImportError(
            f"MLA prefill backend {name}: class path '{class_path}' is not of the form "
            "'package.module.ClassName'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if not (
            isinstance(e, ModuleNotFoundError) and missing and (module_name + ".").startswith(missing + ".")
        ):
            # The module exists but fails to import (e.g. a library it needs is missing).
            raise ImportError(f"MLA prefill backend {name}: cannot import '{class_path}': {e}") from e
        # The path may name a nested class ('mod.Outer.Inner'): walk up.
        obj = None
        parts = class_path.split(".")
        for cut in range(len(parts) - 2, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            attr = ".".join(parts[cut:])
            break
        if obj is None:
            raise ImportError(f"MLA prefill backend {name}: cannot import '{class_path}': {e}") from e
    except Exception as e:  # the module raised while importing: as broken as a missing library
        raise ImportError(
            f"MLA prefill backend {name}: cannot import '{class_path}': {type(e).__name__}: {e}"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ImportError(f"MLA prefill backend {name}: '{class_path}' not found ({e})") from e
    problem = backend_class_problem(obj)
    if problem is not None:
        raise TypeError(f"MLA prefill backend {name}: '{class_path}' {problem}")
    return obj


def backend_class_problem(obj: Any) -> str | None:
    """Why ``obj`` cannot serve as a backend class (None: it can be instantiated)."""
    from mla_prefill_ext.backends.base import MLAPrefillBackend

    if not (isinstance(obj, type) and issubclass(obj, MLAPrefillBackend)):
        return f"is {obj!r}, not a subclass of mla_prefill_ext.MLAPrefillBackend"
    missing = _abstract_methods(obj)
    if missing:
        return f"cannot be instantiated: it does not implement {', '.join(missing)}"
    return None


def _abstract_methods(cls: type) -> list[str]:
    """The abstract methods a backend class leaves unimplemented (empty: it can be built)."""
    return sorted(getattr(cls, "__abstractmethods__", ()))


def validate_class_path(name: str, class_path: Any) -> None:
    """A registered path names a module and a class in it; the import itself stays lazy."""
    if not isinstance(class_path, str) or not class_path:
        raise TypeError(
            f"MLA prefill backend {name}: class_path must be a non-empty string "
            f"'package.module.ClassName', got {class_path!r}"
        )
    module_name, _, _ = class_path.rpartition(".")
    if not module_name or not all(part.isidentifier() for part in class_path.split(".")):
        raise ValueError(
            f"MLA prefill backend {name}: class path '{class_path}' is not of the form "
            "'package.module.ClassName' (the module that defines the class, a dot, then the "
            "class name)"
        )
