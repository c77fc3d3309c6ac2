"""The MLA prefill backend registry: built-in members, overrides, new names.

Registrations are mirrored into the environment variable
``MLA_PREFILL_BACKEND_OVERRIDES`` (JSON ``{name: class_path}``). vLLM starts its
engine core and workers as child processes (fork or spawn); both inherit the
environment, and this module applies the mirrored registrations when it is
imported there, so a backend registered before ``LLM(...)`` is in force in every
process without further steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from enum import Enum, EnumMeta
from typing import TYPE_CHECKING, Any, TypeVar

from mla_prefill_ext import discovery, settings
from mla_prefill_ext._logging import log_once, logger
from mla_prefill_ext.class_paths import backend_class_problem, load_backend_class, validate_class_path
from mla_prefill_ext.settings import OVERRIDES_ENV

if TYPE_CHECKING:
    from mla_prefill_ext.backends.base import MLAPrefillBackend

_T = TypeVar("_T", bound=type)


class _MLAPrefillBackendEnumMeta(EnumMeta):
    """Finds installed backend packages by name, and lists the valid names when there is none.

    A name that is not a member yet may be an installed backend package's: the first such
    miss in a process discovers them (:func:`discover_installed`), so that every lookup by
    name sees them whether or not a selection ran before.
    """

    def __getitem__(cls, name: str) -> Any:
        member = cls._member_map_.get(name)
        if member is None:
            discover_installed()
            member = cls._member_map_.get(name)
        if member is None and isinstance(name, str):  # any case, as MLA_PREFILL_BACKEND takes names
            member = _find(name)
        if member is None:
            valid = ", ".join(cls._member_map_)
            raise ValueError(f"Unknown MLA prefill backend: '{name}'. Valid options are: {valid}")
        return member

    def __getattr__(cls, name: str) -> Any:
        # Only reached for a name that is not a class attribute (members are, once added).
        if name.startswith("_"):
            raise AttributeError(name)
        member = cls._member_map_.get(name)
        if member is None:
            discover_installed()
            member = cls._member_map_.get(name)
        if member is None:
            raise AttributeError(name)
        return member


class MLAPrefillBackendEnum(Enum, metaclass=_MLAPrefillBackendEnumMeta):
    """Every selectable MLA prefill backend, by name, with its class path."""

    FLASH_ATTN = "mla_prefill_ext.backends.flash_attn.FlashAttnPrefillBackend"
    FLASHINFER = "mla_prefill_ext.backends.flashinfer.FlashInferPrefillBackend"
    TRTLLM_RAGGED = "mla_prefill_ext.backends.trtllm_ragged.TrtllmRaggedPrefillBackend"
    TORCH_SDPA = "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
    # Placeholder for an out-of-tree backend. None (not "") so that it can never be
    # an alias of another member, and so that "not registered" is detectable.
    CUSTOM = None

    def get_path(self) -> str:
        """The class path in force for this member (an override wins)."""
        path = self._path_in_force()
        if not path:
            discover_installed()  # an installed package of this name may not be discovered yet
            path = self._path_in_force()
        if not path:
            example = f'{{"{self.name}": "your.module.YourBackend"}}'
            raise ValueError(
                f"MLA prefill backend {self.name} must be registered before use: call "
                f"register_mla_prefill_backend(MLAPrefillBackendEnum.{self.name}, "
                "'your.module.YourBackend') or decorate your MLAPrefillBackend subclass "
                f"with @register_mla_prefill_backend(MLAPrefillBackendEnum.{self.name}), "
                f"or set {OVERRIDES_ENV}='{example}' in the environment"
            )
        return path

    def _path_in_force(self) -> str | None:
        with _LOCK:
            # A registration by call wins over an installed entry point of the same name.
            return _OVERRIDES.get(self.name) or _ENTRY_POINTS.get(self.name, (self.value, None))[0]

    def get_class(self) -> type[MLAPrefillBackend]:
        """Import and return the backend class (lazily: importing is deferred to here)."""
        path = self.get_path()
        try:
            cls = load_backend_class(path, self.name)
        except (ImportError, TypeError) as e:
            fix = self.where_to_fix()
            if fix is None:
                raise
            raise type(e)(f"{str(e).rstrip('.')}. {fix}") from e
        with _LOCK:
            from_entry_point = self.name not in _OVERRIDES and self.name in _ENTRY_POINTS
        if from_entry_point and cls.get_name() != self.name:
            raise TypeError(
                f"MLA prefill backend {self.name}: the entry point of package "
                f"{_ENTRY_POINTS[self.name][1]} names '{path}', whose get_name() is "
                f"'{cls.get_name()}': the entry point's name must be the backend's name"
            )
        return cls

    def where_to_fix(self) -> str | None:
        """Where the class path in force was set and what to correct there (None: built-in)."""
        with _LOCK:
            if self.name in _FROM_ENVIRONMENT:
                return f"The class path comes from {OVERRIDES_ENV}: correct its entry {self.name!r} there"
            if self.name in _OVERRIDES:
                return (
                    "The class path was registered by call: correct the one given to "
                    f"register_mla_prefill_backend for {self.name}"
                )
            if self.name in _ENTRY_POINTS:
                dist = _ENTRY_POINTS[self.name][1] or "?"
                return (
                    f"The class path comes from the entry point {self.name!r} of the installed package "
                    f"{dist}: correct it in that package's entry points (group mla_prefill_ext.backends) "
                    f"and reinstall it, or uninstall {dist}"
                )
        return None

    def source(self) -> str:
        """Where the class path in force comes from (for diagnostics)."""
        with _LOCK:
            if self.name in _FROM_ENVIRONMENT:
                return f"registered in {OVERRIDES_ENV}"
            if self.name in _OVERRIDES:
                return "registered by call"
            if self.name in _ENTRY_POINTS:
                return f"entry point of package {_ENTRY_POINTS[self.name][1] or '?'}"
        return "built-in" if self.value else "not registered"

    def is_overridden(self) -> bool:
        with _LOCK:
            return self.name in _OVERRIDES

    def clear_override(self) -> None:
        """Forget a registration for this member (built-ins revert to their default)."""
        with _LOCK:
            _OVERRIDES.pop(self.name, None)
            _FROM_ENVIRONMENT.discard(self.name)
            _mirror_to_environment()
        _changed()

    @property
    def is_builtin(self) -> bool:
        return self.name in _BUILTIN_NAMES

    def __reduce_ex__(self, protocol: Any) -> Any:
        # By name: members added at run time share the value None with CUSTOM.
        return MLAPrefillBackendEnum.__getitem__, (self.name,)


_BUILTIN_NAMES = frozenset(MLAPrefillBackendEnum.__members__)
_LOCK = threading.RLock()
# name -> class path. Keyed by name, not member, so the environment round-trip
# and dynamically added members need no second lookup table.
_OVERRIDES: dict[str, str] = {}
# The names of _OVERRIDES that this process took from the environment (registered by a parent
# process, or set by the user), not by a call here: for diagnostics.
_FROM_ENVIRONMENT: set[str] = set()
# name -> (class path, distribution): installed backend packages (see mla_prefill_ext.discovery).
# Not mirrored to the environment: each process discovers its own installed packages.
_ENTRY_POINTS: dict[str, tuple[str, str | None]] = {}
_GENERATION = 0
# What discover_installed() found and registered in this process (None: not run yet).
_DISCOVERED: list[discovery.EntryPointStatus] | None = None


def _mirror_to_environment() -> None:
    settings.mirror_overrides(_OVERRIDES)  # children inherit it; see the module docstring


def _add_member(name: str) -> MLAPrefillBackendEnum:
    """Add a selectable name to the enum (upstream's string registration)."""
    if not name.isidentifier() or name.startswith("_"):
        raise ValueError(
            f"Invalid MLA prefill backend name '{name}': use an identifier such as "
            "'MY_PREFILL' (letters, digits, underscores; no leading underscore)"
        )
    enum_cls: Any = MLAPrefillBackendEnum
    # What hasattr() would find, without the metaclass's __getattr__ (which discovers), and
    # Enum's `name`/`value` too (their class access raises): the class's and metaclass's MROs.
    owners = (*type.mro(type(MLAPrefillBackendEnum)), *type.mro(MLAPrefillBackendEnum))
    if any(name in vars(k) for k in owners):
        raise ValueError(f"MLA prefill backend name '{name}' is reserved")
    member = object.__new__(MLAPrefillBackendEnum)
    member._name_ = name
    member._value_ = None  # like CUSTOM: the path lives in the overrides only
    member.__objclass__ = MLAPrefillBackendEnum
    enum_cls._member_map_[name] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(MLAPrefillBackendEnum, name, member)
    return member


def _find(name: str) -> MLAPrefillBackendEnum | None:
    """The member called ``name``, exact spelling first, then ignoring case (None: none, or several)."""
    members = MLAPrefillBackendEnum.__members__
    if name in members:
        return members[name]
    matches = [m for n, m in members.items() if n.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def lookup(name: str) -> MLAPrefillBackendEnum:
    """The member called ``name``: exact spelling first, then ignoring case.

    A name not known yet may be an installed backend package's: the first miss in a
    process discovers them. Raises ValueError naming the valid options when there is
    none (or several).
    """
    member = _find(name)
    if member is None:
        discover_installed()
        member = _find(name)
    if member is None:
        return MLAPrefillBackendEnum[name]  # raises with the list of valid names
    return member


def discover_installed(refresh: bool = False) -> list[discovery.EntryPointStatus]:
    """Register the installed backend packages (entry points), once per process; the outcome of each.

    Called where a name is missed or every name is listed, so that lookups, listings and
    selection all see the installed packages, whoever asks first; another thread waits for
    the one in progress. Reading their metadata costs a few milliseconds, once; a class is
    imported when it is used (automatic selection uses every out-of-tree class, for its
    claim). ``refresh``: scan again (a package installed since).
    """
    global _DISCOVERED
    with _LOCK:
        if _DISCOVERED is not None and not refresh:
            return _DISCOVERED
        statuses = []
        for found in discovery.scan():
            if found.problem is None and found.class_path is not None:
                found = found._replace(
                    problem=register_entry_point(found.name, found.class_path, found.distribution)
                )
            statuses.append(found)
        _DISCOVERED = statuses
        return statuses


def _resolve_member(backend: MLAPrefillBackendEnum | str) -> MLAPrefillBackendEnum:
    if isinstance(backend, MLAPrefillBackendEnum):
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            "register_mla_prefill_backend() takes an MLAPrefillBackendEnum member or a "
            f"backend name string, not {type(backend).__name__}"
        )
    with _LOCK:
        existing = MLAPrefillBackendEnum.__members__.get(backend)
        if existing is not None:
            return existing
        return _add_member(backend)


def _warn_if_main(name: str, class_path: str) -> None:
    if class_path.startswith(("__main__.", "__mp_main__.")):
        logger.warning(
            "MLA prefill backend %s is registered as '%s', a class defined in __main__. "
            "vLLM's spawned engine and worker processes can import it only when "
            "__main__ is a script file that defines the class at top level (not "
            "`python -c`, a notebook or a REPL). Move the class into an importable "
            "module and register it by that module's path to be safe.",
            name,
            class_path,
        )


def _validate_backend_class(member: MLAPrefillBackendEnum, cls: Any) -> None:
    """A decorated class must be a backend that can be instantiated: checked at decoration."""
    problem = backend_class_problem(cls)
    if problem is not None:
        where = f"class {cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
        raise TypeError(f"MLA prefill backend {member.name}: {where} {problem}")


def _set_override(member: MLAPrefillBackendEnum, class_path: str) -> None:
    _warn_if_main(member.name, class_path)
    with _LOCK:
        _OVERRIDES[member.name] = class_path
        _FROM_ENVIRONMENT.discard(member.name)
        _mirror_to_environment()
    _changed()
    logger.info("Registered MLA prefill backend %s -> %s", member.name, class_path)


def _changed() -> None:
    # The selector keys its cache on this counter: a selection made before a
    # registration never outlives it, and the registry knows nothing of selection.
    global _GENERATION
    with _LOCK:
        _GENERATION += 1


def generation() -> int:
    """A counter that moves on every registration change (for caches of selections)."""
    return _GENERATION


def register_mla_prefill_backend(
    backend: MLAPrefillBackendEnum | str,
    class_path: str | None = None,
) -> Callable[[_T], _T]:
    """Register (or override) the class behind an MLA prefill backend name.

    ``backend`` is a member of :class:`MLAPrefillBackendEnum` (``CUSTOM`` for an
    out-of-tree backend, or a built-in to replace it), or a string: an existing
    member's name, or a new name that becomes selectable like the built-ins.

    With ``class_path`` the registration happens now and a no-op decorator is
    returned; without it, a decorator is returned that registers the decorated
    class by ``f"{cls.__module__}.{cls.__qualname__}"`` and returns it unchanged.

    What can be checked at once is: a ``class_path`` without a module part
    (``"Foo"``) is a ValueError; a decorated class that is not an
    :class:`MLAPrefillBackend` subclass, or that leaves abstract methods
    unimplemented, is a TypeError naming the class (and the methods). A class path
    is imported (and checked the same way) only when it is first selected.
    Register before the engine starts: vLLM's child processes receive the
    registration through the environment.
    """
    member = _resolve_member(backend)

    if class_path is not None:
        validate_class_path(member.name, class_path)
        _set_override(member, class_path)
        return lambda cls: cls

    def decorator(cls: _T) -> _T:
        _validate_backend_class(member, cls)
        _set_override(member, f"{cls.__module__}.{cls.__qualname__}")
        return cls

    return decorator


def registered_backends() -> list[tuple[MLAPrefillBackendEnum, str | None]]:
    """Every member with the class path in force (None: CUSTOM-like, unregistered)."""
    discover_installed()
    with _LOCK:
        return [
            (m, _OVERRIDES.get(m.name) or _ENTRY_POINTS.get(m.name, (m.value, None))[0])
            for m in MLAPrefillBackendEnum
        ]


def register_entry_point(name: str, class_path: str, distribution: str | None) -> str | None:
    """Register an installed backend package's entry point; the reason it cannot be, or None."""
    if name in _BUILTIN_NAMES and name != "CUSTOM":
        return (
            f"an entry point cannot replace the built-in {name}; register an override by call "
            "(register_mla_prefill_backend) if that is meant"
        )
    try:
        with _LOCK:
            member = _resolve_member(name)
            validate_class_path(member.name, class_path)
            _ENTRY_POINTS[member.name] = (class_path, distribution)
    except (TypeError, ValueError) as e:
        return str(e)
    _changed()
    if member.name in _OVERRIDES:
        logger.info(
            "MLA prefill backend %s: the registration by call (%s) wins over the entry point of %s.",
            member.name,
            _OVERRIDES[member.name],
            distribution,
        )
    else:
        logger.debug("MLA prefill backend %s installed by %s -> %s", member.name, distribution, class_path)
    return None


def _apply_environment() -> None:
    """Apply registrations mirrored by a parent process (runs at import)."""
    raw = settings.overrides_in_environment()
    if not raw:
        return
    problem = settings.overrides_problem()
    if problem is not None:
        # The selector refuses to select while it stands. One line, naming every bad entry; the
        # command line marks it said, as its commands report the problem themselves.
        log_once(logging.ERROR, settings.OVERRIDES_PROBLEM_LOG_KEY, "%s.", problem)
    try:
        payload = settings.parse_overrides(raw)
    except ValueError:
        return
    with _LOCK:
        for name, path in payload.items():
            if not isinstance(path, str):
                continue  # named in the problem logged above
            try:
                member = _resolve_member(name)
            except ValueError as e:
                if name.isidentifier() and not name.startswith("_"):  # reserved: not in that problem
                    logger.error("Ignoring %s entry %r: %s", OVERRIDES_ENV, name, e)
                continue
            _OVERRIDES[member.name] = path
            _FROM_ENVIRONMENT.add(member.name)


_apply_environment()
