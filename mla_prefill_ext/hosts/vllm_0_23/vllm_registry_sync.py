"""The add-on's backend names in vLLM's own registry (vLLM 0.23+), kept in step with the add-on's.

vLLM's registry lives in one process; the add-on's is rebuilt in every process
(built-ins, registrations mirrored through the environment, installed packages),
and :func:`sync` copies it into vLLM's there, whenever it changed:

* ``CUSTOM`` registered with the add-on -> vLLM's ``CUSTOM`` points at its adapter
  (unless the user registered vLLM's ``CUSTOM`` through vLLM's own API: then a
  WARNING says which one each knob reaches).
* Other names, vLLM 0.33+: a new member of vLLM's enum, registered by string with
  the adapter's class path, once (vLLM raises on a repeated registration). Its
  pickling is by name, registering it again where it is unpickled (a spawned engine
  core unpickles its configuration before plugins load there).
* Other names, vLLM 0.23-0.31: vLLM registers only its own members and ``CUSTOM``;
  these names are reached through the add-on's choice (``MLA_PREFILL_BACKEND``, ...).
* A name of one of vLLM's own backends (``FLASH_ATTN``, ``CPU``, ...) is never
  overridden: vLLM's backend stays what ``attention_config`` selects. The add-on's
  built-ins of the same name are reached through the add-on's choice; a registered or
  installed backend with such a name gets a WARNING.
* A name that is not upper-case cannot be reached through ``attention_config``
  (vLLM upper-cases the value): not registered, with a WARNING saying what to do.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from mla_prefill_ext._logging import log_once
from mla_prefill_ext.hosts.vllm_0_23.shape import Shape
from mla_prefill_ext.versions import installed_vllm_version

ADAPTERS_MODULE = "mla_prefill_ext.hosts.vllm_0_23.adapter_classes"


def adapter_path(name: str) -> str:
    """The class path vLLM's registry holds for the add-on backend ``name``."""
    return f"{ADAPTERS_MODULE}.{name}"


_LOCK = threading.RLock()
_OURS: set[str] = set()  # names this process added to vLLM's enum
_custom_set = False  # vLLM's CUSTOM points at the add-on's CUSTOM adapter because of us
_synced_generation: int | None = None


def _warn_once(key: tuple[str, str], message: str, *args: Any) -> None:
    log_once(logging.WARNING, ("vllm registry", *key), message, *args)


def is_ours(member: Any) -> bool:
    """Whether a member of vLLM's enum resolves to one of the add-on's adapters."""
    try:
        return member.get_path().startswith(ADAPTERS_MODULE + ".")
    except ValueError:  # an unregistered CUSTOM
        return False


def native_names(shape: Shape) -> list[str]:
    """vLLM's own backend names here (CUSTOM and the add-on's string members excluded)."""
    with _LOCK:
        return [n for n in shape.enum.__members__ if n != "CUSTOM" and n not in _OURS]


def _restore_member(name: str) -> Any:
    """Unpickle a string-registered member: register it in this process first if needed."""
    from mla_prefill_ext.hosts.vllm_0_23 import shape as shape_module

    found, problems = shape_module.current()
    if found is None:
        raise ValueError(f"mla-prefill-ext cannot bridge this vLLM: {'; '.join(problems)}")
    member = found.enum.__members__.get(name)
    return member if member is not None else _register_string(found, name)


def _reduce_by_name(name: str) -> Any:
    def reduce(protocol: Any = None) -> Any:
        return _restore_member, (name,)

    return reduce


def _register_string(shape: Shape, name: str) -> Any:
    with _LOCK:
        shape.registry.register_mla_prefill_backend(name, adapter_path(name))
        member = shape.enum.__members__[name]
        # Enum members pickle by value, which a fresh process does not know yet.
        member.__reduce_ex__ = _reduce_by_name(name)
        _OURS.add(name)
        return member


def _sync_custom(shape: Shape, addon_custom: bool) -> None:
    global _custom_set
    custom = shape.enum.CUSTOM
    target = adapter_path("CUSTOM")
    foreign = custom.is_overridden() and not is_ours(custom)
    if addon_custom and not foreign:
        if not _custom_set or not custom.is_overridden():
            shape.registry.register_mla_prefill_backend(custom, target)
            _custom_set = True
    elif addon_custom:
        _warn_once(
            ("CUSTOM", "foreign"),
            "vLLM %s's CUSTOM MLA prefill backend is registered through vLLM's own API (%s): "
            "attention_config.mla_prefill_backend=CUSTOM selects that one, MLA_PREFILL_BACKEND=CUSTOM "
            "the one registered with mla-prefill-ext. Register only one of them to avoid the confusion.",
            installed_vllm_version(),
            custom.get_path(),
        )
    elif _custom_set and is_ours(custom):
        custom.clear_override()  # the add-on's CUSTOM was unregistered
        _custom_set = False


def _sync_name(shape: Shape, name: str, builtin: bool, native: list[str]) -> None:
    version = installed_vllm_version()
    if name in native:
        if not builtin:
            _warn_once(
                (name, "native"),
                "MLA prefill backend %s (mla-prefill-ext) has the name of vLLM %s's own backend %s: "
                "attention_config.mla_prefill_backend=%s selects vLLM's; select the add-on's with "
                "MLA_PREFILL_BACKEND=%s, or register it under another name.",
                name,
                version,
                name,
                name,
                name,
            )
        return
    if not shape.string_names:
        return  # before 0.33: reached through the add-on's choice only
    if name != name.upper():
        _warn_once(
            (name, "case"),
            "MLA prefill backend '%s' (mla-prefill-ext) is not registered in vLLM %s's registry: vLLM "
            "upper-cases attention_config.mla_prefill_backend, so it could never be selected there. Select "
            "it with MLA_PREFILL_BACKEND=%s, or register it as '%s'.",
            name,
            version,
            name,
            name.upper(),
        )
        return
    member = shape.enum.__members__.get(name)
    if member is None:
        _register_string(shape, name)
    elif name not in _OURS and not is_ours(member):
        _warn_once(
            (name, "foreign"),
            "MLA prefill backend %s is registered in vLLM %s's registry through vLLM's own API (%s): "
            "attention_config.mla_prefill_backend=%s selects that one, MLA_PREFILL_BACKEND=%s the one "
            "registered with mla-prefill-ext.",
            name,
            version,
            member.get_path() if member.value or member.is_overridden() else "?",
            name,
            name,
        )


def sync(shape: Shape, force: bool = False) -> None:
    """Copy the add-on's registrations into vLLM's registry (a no-op when nothing changed)."""
    global _synced_generation
    from mla_prefill_ext import registry

    if shape.string_names or _synced_generation is not None:
        # Installed packages are names too. Before vLLM 0.33 none of them can enter vLLM's registry,
        # so a process that never selects (an API server) skips reading package metadata at start.
        registry.discover_installed()
    with _LOCK:
        generation = registry.generation()
        if generation == _synced_generation and not force:
            return
        native = native_names(shape)
        addon_custom = False
        for member, path in registry.registered_backends():
            if member.name == "CUSTOM":
                addon_custom = bool(path)
            elif path:
                _sync_name(shape, member.name, member.is_builtin, native)
        _sync_custom(shape, addon_custom)
        _synced_generation = generation


def unregister(shape: Shape) -> None:
    """Take back what can be taken back: vLLM's CUSTOM, when it points at the add-on's.

    Names added to vLLM's enum stay (vLLM has no way to remove one); their adapters
    keep working without the add-on's wrappers.
    """
    global _custom_set, _synced_generation
    with _LOCK:
        if _custom_set and is_ours(shape.enum.CUSTOM):
            shape.enum.CUSTOM.clear_override()
        _custom_set = False
        _synced_generation = None
