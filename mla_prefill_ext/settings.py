"""The user's settings, their one parser, and how they reach every vLLM process.

Three environment variables carry everything a process needs to know:
``MLA_PREFILL_BACKEND`` (the choice), ``MLA_PREFILL_BACKEND_OVERRIDES`` (the
registrations, mirrored by the registry) and ``MLA_PREFILL_EXT_DISABLE``. vLLM's
forked or spawned engine core and workers inherit them. Ray actors do not: vLLM
copies to them only the variables in its own list (``vllm/ray/ray_env.py``), so
:func:`ask_vllm_to_copy_to_ray` adds ours to that list
(``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``), which vLLM applies in every Ray worker, on
every node, before it loads plugins there.

``additional_config["mla_prefill_backend"]`` travels inside vLLM's engine
configuration by itself. Beside it, the process that creates the engine
configuration stamps its settings (:func:`snapshot`) under
``additional_config["mla_prefill_ext"]``, so that a process whose own settings
differ (a node started by hand) refuses at start (:func:`mismatch`).

This module is the only one that names these variables and the configuration keys,
parses them and writes them; the registry, the selector, the patch and the CLI ask it.
No vLLM or torch import here: activation and the CLI read this module first.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

BACKEND_ENV = "MLA_PREFILL_BACKEND"
OVERRIDES_ENV = "MLA_PREFILL_BACKEND_OVERRIDES"
DISABLE_ENV = "MLA_PREFILL_EXT_DISABLE"
ENV_VARS = (BACKEND_ENV, OVERRIDES_ENV, DISABLE_ENV)
SHARED_PREFIX_ENV = "MLA_PREFILL_SHARED_PREFIX"
SHARED_PREFIX_KEY = "mla_prefill_shared_prefix"
SHARED_DECODE_ENV = "MLA_PREFILL_SHARED_DECODE"
GATHER_ENV = "MLA_PREFILL_SHARED_PREFIX_GATHER_MS"
GATHER_DEFAULT_MS = 100.0  # on the H200: a 16-request burst over a 32k prefix reached the queue in 27-68 ms

ADDITIONAL_CONFIG_KEY = "mla_prefill_backend"
STAMP_KEY = "mla_prefill_ext"
AUTO = "AUTO"

RAY_COPY_LIST_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Choice(NamedTuple):
    """A backend name the user asked for and where the request came from."""

    name: str
    source: str
    explicit: bool  # False for legacy flags: those fall back instead of failing


def parse_choice(value: Any, source: str) -> Choice | None:
    """The one parser of a backend choice; None means automatic selection.

    Unset, ``None``, an empty or blank string and ``auto`` (any case) are automatic;
    any other string is an explicit choice (validated by the selector). Anything
    else is a TypeError naming the source.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{source} must be a backend name string (or 'auto'), not {type(value).__name__} {value!r}"
        )
    name = value.strip()
    if not name or name.upper() == AUTO:
        return None
    return Choice(name, source, True)


def user_setting(additional_config: Any = None) -> tuple[bool, Choice | None]:
    """(whether the user set a choice, the explicit choice or None for automatic).

    ``additional_config`` first, then the environment. A value of None or a blank
    string counts as not set; ``auto`` is set and means automatic selection, so it
    also silences vLLM 0.20's legacy flags.
    """
    value = additional_config.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, dict) else None
    if value is not None and not (isinstance(value, str) and not value.strip()):
        return True, parse_choice(value, f"additional_config['{ADDITIONAL_CONFIG_KEY}']")
    value = os.environ.get(BACKEND_ENV)
    if value is not None and value.strip():
        return True, parse_choice(value, BACKEND_ENV)
    return False, None


def explicit_choice(additional_config: Any = None) -> Choice | None:
    """The user's explicit backend choice in force, or None (automatic, or nothing set)."""
    return user_setting(additional_config)[1]


def shared_prefix_setting(additional_config: Any = None) -> tuple[bool, str]:
    """Whether the shared-prefix path may run, and where that was said (on unless turned off).

    ``additional_config["mla_prefill_shared_prefix"]`` first (a bool or one of the words below),
    then :data:`SHARED_PREFIX_ENV` (``0``/``false``/``no``/``off`` turn it off). A value that is
    neither raises, naming where it came from.
    """
    return _switch(additional_config, SHARED_PREFIX_KEY, SHARED_PREFIX_ENV, True)


def shared_decode_setting() -> tuple[bool, str]:
    """Whether the shared-prefix path also serves decode rows, and where that was said: off unless
    :data:`SHARED_DECODE_ENV` turns it on (read at import, in every vLLM process, as
    :func:`shared_prefix_setting` reads its switch), until its token parity is shown on a GPU."""
    return _switch(None, "", SHARED_DECODE_ENV, False)


def _switch(additional_config: Any, key: str, env: str, default: bool) -> tuple[bool, str]:
    value = additional_config.get(key) if isinstance(additional_config, dict) else None
    if value is not None:
        source = f"additional_config['{key}']"
    else:
        value, source = os.environ.get(env), env
    if value is None or (isinstance(value, str) and not value.strip()):
        return default, "the default"
    if isinstance(value, bool):
        return value, source
    word = str(value).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE, source
    raise ValueError(f"{source}={value!r} is not a switch: use 1/true/on or 0/false/off")


def gather_window_ms() -> tuple[float, str]:
    """How long an idle engine core may keep taking requests over a shared prefix before its first
    step, in ms, and where that was said (:data:`GATHER_ENV`; unset: :data:`GATHER_DEFAULT_MS`; ``0``: it
    does not gather).
    A value that is not a number from 0 to 1000 raises, naming the variable."""
    raw = os.environ.get(GATHER_ENV)
    if raw is None or not raw.strip():
        return GATHER_DEFAULT_MS, "the default"
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0.0 <= ms <= 1000.0:
        raise ValueError(f"{GATHER_ENV}={raw!r} is not a window in ms: use a number from 0 (off) to 1000")
    return ms, GATHER_ENV


def is_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def environment() -> dict[str, str | None]:
    """The raw value of each of the add-on's variables in this process (None: unset)."""
    return {name: os.environ.get(name) for name in ENV_VARS}


def parse_overrides(raw: str) -> dict[Any, Any]:
    """The registrations a parent process mirrored into :data:`OVERRIDES_ENV`, as given.

    Raises ValueError when ``raw`` is not a JSON object; its entries are checked by the
    registry, which knows what a usable name is.
    """
    payload = json.loads(raw)
    if not isinstance(payload, dict):
        raise ValueError(f"a JSON {type(payload).__name__}")
    return payload


OVERRIDES_EXAMPLE = '{"MY_PREFILL": "my_pkg.prefill.MyPrefillBackend"}'
"""The right form of :data:`OVERRIDES_ENV`, as every message about it shows it."""

OVERRIDES_PROBLEM_LOG_KEY = "unusable MLA_PREFILL_BACKEND_OVERRIDES"
"""The ``_logging.log_once`` key of the registry's line about :func:`overrides_problem`: the
command line marks it said, since each of its commands reports the problem itself."""


def overrides_problem() -> str | None:
    """Why this process's :data:`OVERRIDES_ENV` cannot be applied (None: unset, empty or usable).

    An invalid value is refused, not ignored: an override that silently fails to apply would
    run another backend than the one registered.
    """
    raw = overrides_in_environment()
    if not raw:
        return None
    try:
        payload = parse_overrides(raw)
    except ValueError as e:
        why = f"it is not a JSON object of {{name: class_path}} ({e})"
    else:
        names = [k for k in payload if not (k.isidentifier() and not k.startswith("_"))]
        paths = [k for k, v in payload.items() if not isinstance(v, str) or not v]
        if not names and not paths:
            return None
        why = "; ".join(
            [f"{k!r} is not a backend name (an identifier such as MY_PREFILL)" for k in names]
            + [f"the class path of {k!r} is not a non-empty string" for k in paths]
        )
    return (
        f"{OVERRIDES_ENV}={raw!r} cannot be used: {why}; no MLA prefill backend can be selected (an "
        f"engine stops at start) until it is fixed. Write it as {OVERRIDES_ENV}='{OVERRIDES_EXAMPLE}'"
    )


def overridden_environment_choice(additional_config: Any) -> str | None:
    """The raw :data:`BACKEND_ENV` that ``additional_config``'s own choice overrides (None: none).

    Only when the two differ (``auto`` in ``additional_config`` cancels a name in the environment).
    """
    value = additional_config.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, dict) else None
    env = os.environ.get(BACKEND_ENV)
    if not isinstance(value, str) or not value.strip() or env is None or not env.strip():
        return None
    return None if value.strip().upper() == env.strip().upper() else env


def overrides_in_environment() -> str | None:
    """The raw :data:`OVERRIDES_ENV` of this process (None or empty: no registration)."""
    return os.environ.get(OVERRIDES_ENV)


def mirror_overrides(overrides: dict[str, str]) -> None:
    """Hand the registrations to child processes (fork or spawn inherit ``os.environ``)."""
    if overrides:
        os.environ[OVERRIDES_ENV] = json.dumps(overrides, sort_keys=True)
    else:
        os.environ.pop(OVERRIDES_ENV, None)


def snapshot() -> dict[str, Any]:
    """This process's settings, normalised, as the engine configuration carries them."""
    choice = parse_choice(os.environ.get(BACKEND_ENV), BACKEND_ENV)
    try:
        overrides = json.loads(os.environ.get(OVERRIDES_ENV) or "{}")
    except ValueError:
        overrides = os.environ.get(OVERRIDES_ENV)
    return {
        BACKEND_ENV: choice.name.upper() if choice else AUTO,
        OVERRIDES_ENV: overrides,
        DISABLE_ENV: is_disabled(),
    }


DEFAULT_SNAPSHOT = {BACKEND_ENV: AUTO, OVERRIDES_ENV: {}, DISABLE_ENV: False}
"""What :func:`snapshot` gives when the user set nothing."""


def _as_env_value(name: str, value: Any) -> str:
    if name == OVERRIDES_ENV:
        return json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value)
    if name == DISABLE_ENV:
        return "1" if value else "0"
    return str(value)


def stamped(additional_config: Any) -> dict[str, Any] | None:
    """``additional_config`` with this process's settings stamped in; None: leave it as it is.

    Nothing set: nothing that could fail to arrive, and no stamp, so the configuration (and
    vLLM's compile-cache key, which hashes ``additional_config``) stays what stock vLLM makes.
    A new dict: the user's own ``additional_config`` object stays as given.
    """
    mine = snapshot()
    if mine == DEFAULT_SNAPSHOT or not isinstance(additional_config, dict):
        return None
    return {**additional_config, STAMP_KEY: mine}


def engine_mismatch(additional_config: Any) -> str | None:
    """Why this process's settings differ from those stamped into an engine's configuration."""
    stamp = additional_config.get(STAMP_KEY) if isinstance(additional_config, dict) else None
    return mismatch(stamp)


def mismatch(stamp: Any) -> str | None:
    """Why this process's settings differ from the engine's stamped ones (None: they agree)."""
    if not isinstance(stamp, dict):
        return None
    mine = snapshot()
    wrong = [name for name in ENV_VARS if name in stamp and stamp[name] != mine[name]]
    if not wrong:
        return None
    import socket

    fixes = " ".join(f"{n}='{_as_env_value(n, stamp[n])}'" for n in wrong)
    seen = ", ".join(f"{n}={mine[n]!r}" for n in wrong)
    return (
        f"this process (host {socket.gethostname()}, pid {os.getpid()}) has {seen}, but the engine "
        f"was configured with {', '.join(f'{n}={stamp[n]!r}' for n in wrong)} where it was created. "
        f"Set {fixes} in the environment of this node's vLLM processes (for a Ray cluster: of "
        "`ray start` on this node, or let vLLM copy them, see docs/deployment.md, 'Multi-node and Ray')"
    )


def ask_vllm_to_copy_to_ray() -> None:
    """Add our variables to vLLM's list of those it copies to Ray actors (idempotent)."""
    listed = [v.strip() for v in os.environ.get(RAY_COPY_LIST_ENV, "").split(",") if v.strip()]
    missing = [v for v in (*ENV_VARS, SHARED_PREFIX_ENV, SHARED_DECODE_ENV) if v not in listed]
    if missing:
        os.environ[RAY_COPY_LIST_ENV] = ",".join([*listed, *missing])
