"""What vLLM's MLA prefill API looks like here, found by inspecting it (signatures, attributes).

The bridge maps the add-on's backend API onto vLLM's own. It knows the shapes of
vLLM 0.23 to 0.33 and tells them apart by what vLLM has, not by its version number:

* context chunks by index (``run_prefill_context_chunk(chunk_idx, ...)``, 0.23-0.27)
  or as objects (``run_prefill_context_chunk(chunk, ...)`` with a sliced ``q``, 0.29+);
* DeepSeek-R1 dims as a flag (``requires_r1_mla_dimensions``, 0.23) or a list of
  ``MLADimensions`` (``supported_mla_dimensions``, 0.25+);
* new names registered as strings (``MLAPrefillBackendEnum.register``, 0.33+) or
  only through ``CUSTOM`` and the built-in members (0.23-0.31);
* automatic selection taking the device capability (0.23-0.31) or not (0.33, where
  the platform finds it).

Anything else is a problem named in one line; then nothing is bridged.

Not inspected here: that vLLM's selector serves the member ``attention_config.mla_prefill_backend``
names (``vllm.config.attention`` is half-initialised when the bridge lands); the tests check it
against vLLM's own selector.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any, NamedTuple

PREFILL_PACKAGE = "vllm.v1.attention.backends.mla.prefill"
BASE_MODULE = f"{PREFILL_PACKAGE}.base"
REGISTRY_MODULE = f"{PREFILL_PACKAGE}.registry"
SELECTOR_MODULE = f"{PREFILL_PACKAGE}.selector"

INIT_PARAMS = (
    "num_heads",
    "scale",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vllm_config",
)
CHUNK_BY_INDEX, CHUNK_OBJECT = "index", "object"
DIMS_R1_FLAG, DIMS_LIST = "r1_flag", "dimensions"


class Shape(NamedTuple):
    """vLLM's MLA prefill API in this process, as the bridge uses it."""

    base: type  # vLLM's MLAPrefillBackend
    enum: Any  # vLLM's MLAPrefillBackendEnum
    registry: ModuleType
    selector: ModuleType
    mla_dimensions: type | None  # MLADimensions (0.25+)
    chunk_api: str  # CHUNK_BY_INDEX or CHUNK_OBJECT
    dims_api: str  # DIMS_R1_FLAG or DIMS_LIST
    string_names: bool  # new names register as strings (0.33+)
    auto_takes_capability: bool  # _auto_select_mla_prefill_backend(device_capability, selector_config)
    has_clone: bool  # vLLM's metadata builder clones the layer's backend (0.25+)


def _params(func: Any) -> list[str] | None:
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def _import(name: str, problems: list[str]) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception as e:  # an ImportError, or vLLM failing inside its own import
        problems.append(f"{name} cannot be imported ({type(e).__name__}: {e})")
        return None


def _chunk_api(base: type, problems: list[str]) -> str:
    params = _params(getattr(base, "run_prefill_context_chunk", None))
    first = params[1] if params and len(params) > 1 else None
    if first == "chunk_idx":
        return CHUNK_BY_INDEX
    if first == "chunk":
        return CHUNK_OBJECT
    problems.append(
        f"{BASE_MODULE}.MLAPrefillBackend.run_prefill_context_chunk takes {params}: expected "
        "(self, chunk_idx, q, k, v) as in vLLM 0.23-0.27 or (self, chunk, q, k, v, ...) as in 0.29+"
    )
    return ""


def _dims_api(base: type, base_module: ModuleType, problems: list[str]) -> str:
    if hasattr(base, "supported_mla_dimensions") and hasattr(base_module, "MLADimensions"):
        return DIMS_LIST
    if hasattr(base, "requires_r1_mla_dimensions"):
        return DIMS_R1_FLAG
    problems.append(
        f"{BASE_MODULE}.MLAPrefillBackend has neither supported_mla_dimensions (vLLM 0.25+) nor "
        "requires_r1_mla_dimensions (0.23)"
    )
    return ""


def _check_base(base: Any, problems: list[str]) -> None:
    where = f"{BASE_MODULE}.MLAPrefillBackend"
    if not isinstance(base, type):
        problems.append(f"{where} is not a class")
        return
    abstract = set(getattr(base, "__abstractmethods__", ()))
    expected = {"get_name", "run_prefill_new_tokens", "run_prefill_context_chunk"}
    if abstract != expected:
        problems.append(f"{where} has abstract methods {sorted(abstract)}, expected {sorted(expected)}")
    params = _params(base.__init__)
    if params is None or tuple(params[1:]) != INIT_PARAMS:
        problems.append(f"{where}.__init__ takes {params}, expected (self, {', '.join(INIT_PARAMS)})")
    new = _params(getattr(base, "run_prefill_new_tokens", None)) or []
    if new[1:5] != ["q", "k", "v", "return_softmax_lse"]:
        problems.append(
            f"{where}.run_prefill_new_tokens takes {new}, expected (self, q, k, v, return_softmax_lse, ...)"
        )
    for name in (
        "validate_configuration",
        "prepare_metadata",
        "supports_compute_capability",
        "supports_dtype",
    ):
        if not callable(getattr(base, name, None)):
            problems.append(f"{where}.{name} is missing")


def _check_registry(registry: ModuleType, problems: list[str]) -> tuple[Any, bool]:
    enum = getattr(registry, "MLAPrefillBackendEnum", None)
    register = getattr(registry, "register_mla_prefill_backend", None)
    if enum is None or register is None:
        problems.append(
            f"{REGISTRY_MODULE} has no "
            + ("MLAPrefillBackendEnum" if enum is None else "register_mla_prefill_backend")
            + " (vLLM 0.23+ has both)"
        )
        return enum, False
    if _params(register)[:2] != ["backend", "class_path"]:
        problems.append(f"{REGISTRY_MODULE}.register_mla_prefill_backend takes {_params(register)}")
    if "CUSTOM" not in getattr(enum, "__members__", {}):
        problems.append(f"{REGISTRY_MODULE}.MLAPrefillBackendEnum has no CUSTOM member")
    for name in ("get_path", "get_class", "is_overridden", "clear_override"):
        if not callable(getattr(enum, name, None)):
            problems.append(f"{REGISTRY_MODULE}.MLAPrefillBackendEnum.{name} is missing")
    return enum, callable(getattr(enum, "register", None))


def _check_selector(selector: ModuleType, problems: list[str]) -> bool:
    get = _params(getattr(selector, "get_mla_prefill_backend", None))
    if get != ["vllm_config"]:
        problems.append(f"{SELECTOR_MODULE}.get_mla_prefill_backend takes {get}, expected (vllm_config)")
    auto = getattr(selector, "_auto_select_mla_prefill_backend", None)
    auto_params = _params(getattr(auto, "__wrapped__", auto))
    if auto_params not in (["device_capability", "selector_config"], ["selector_config"]):
        problems.append(
            f"{SELECTOR_MODULE}._auto_select_mla_prefill_backend takes {auto_params}, expected "
            "(device_capability, selector_config) as in vLLM 0.23-0.31 or (selector_config) as in 0.33"
        )
    config = getattr(selector, "MLAPrefillSelectorConfig", None)
    fields = getattr(config, "_fields", ())
    if "dtype" not in fields or not ({"mla_dimensions", "is_r1_compatible"} & set(fields)):
        problems.append(f"{SELECTOR_MODULE}.MLAPrefillSelectorConfig has fields {list(fields)}")
    return auto_params is not None and len(auto_params) == 2


def inspect_vllm() -> tuple[Shape | None, list[str]]:
    """vLLM's MLA prefill API here, or None and every problem found."""
    problems: list[str] = []
    base_module = _import(BASE_MODULE, problems)
    registry = _import(REGISTRY_MODULE, problems)
    selector = _import(SELECTOR_MODULE, problems)
    # Not vllm.config.attention: its import is what usually loads the prefill package, so it is
    # half-initialised when the bridge lands.
    if base_module is None or registry is None or selector is None:
        return None, problems
    base = getattr(base_module, "MLAPrefillBackend", None)
    _check_base(base, problems)
    if problems:
        return None, problems
    chunk_api = _chunk_api(base, problems)
    dims_api = _dims_api(base, base_module, problems)
    enum, string_names = _check_registry(registry, problems)
    auto_takes_capability = _check_selector(selector, problems)
    if problems:
        return None, problems
    return (
        Shape(
            base=base,
            enum=enum,
            registry=registry,
            selector=selector,
            mla_dimensions=getattr(base_module, "MLADimensions", None),
            chunk_api=chunk_api,
            dims_api=dims_api,
            string_names=string_names,
            auto_takes_capability=auto_takes_capability,
            has_clone=callable(getattr(base, "clone", None)),
        ),
        [],
    )


_FOUND: tuple[Shape | None, list[str]] | None = None


def current() -> tuple[Shape | None, list[str]]:
    """:func:`inspect_vllm`, once per process (vLLM's classes do not change under it)."""
    global _FOUND
    if _FOUND is None:
        _FOUND = inspect_vllm()
    return _FOUND
