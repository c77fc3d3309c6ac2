"""The bridge's inspection of vLLM's MLA prefill API (bridge/shape.py), on the installed vLLM 0.23+.

vLLM's real base class, registry and selector; a changed API is vLLM's real class with one
thing changed (a subclass), as a later vLLM would have it.
"""

from __future__ import annotations

import abc
import importlib
import types

import pytest

from mla_prefill_ext import versions
from mla_prefill_ext.hosts.vllm_0_23 import shape

pytestmark = pytest.mark.vllm_bridge

# What the bridge must find on the vLLM versions of the test matrix:
# (chunk_api, dims_api, string_names, auto_takes_capability, has_clone).
EXPECTED = {
    "0.25.1": (shape.CHUNK_BY_INDEX, shape.DIMS_LIST, False, True, True),
    "0.33.0": (shape.CHUNK_OBJECT, shape.DIMS_LIST, True, False, True),
    "0.34.0": (shape.CHUNK_OBJECT, shape.DIMS_LIST, True, False, True),
}


def vllm_base() -> type:
    return importlib.import_module(shape.BASE_MODULE).MLAPrefillBackend


def test_the_installed_vllm_has_the_shape_of_its_version():
    found, problems = shape.inspect_vllm()
    assert problems == [] and found is not None
    version = versions.installed_vllm_version()
    if version not in EXPECTED:
        pytest.skip(f"no expected shape written down for vLLM {version}")
    assert (
        found.chunk_api,
        found.dims_api,
        found.string_names,
        found.auto_takes_capability,
        found.has_clone,
    ) == EXPECTED[version]
    assert found.base is vllm_base()
    assert found.registry is importlib.import_module(shape.REGISTRY_MODULE)
    assert found.selector is importlib.import_module(shape.SELECTOR_MODULE)
    assert found.enum is found.registry.MLAPrefillBackendEnum
    assert found.mla_dimensions is importlib.import_module(shape.BASE_MODULE).MLADimensions


def test_the_shape_is_inspected_once_per_process(monkeypatch):
    monkeypatch.setattr(shape, "_FOUND", None)
    first = shape.current()
    assert shape.current() is first
    assert first[0] is not None and first[0].base is vllm_base()


def test_the_chunk_api_is_told_by_the_first_parameter():
    base = vllm_base()

    class ByIndex(base):
        def run_prefill_context_chunk(self, chunk_idx, q, k, v):  # type: ignore[no-untyped-def]
            ...

    class ByObject(base):
        def run_prefill_context_chunk(self, chunk, q, k, v, output=None):  # type: ignore[no-untyped-def]
            ...

    problems: list[str] = []
    assert shape._chunk_api(ByIndex, problems) == shape.CHUNK_BY_INDEX
    assert shape._chunk_api(ByObject, problems) == shape.CHUNK_OBJECT
    assert problems == []


def test_the_dimensions_api_is_told_by_what_the_base_class_has():
    base = vllm_base()
    module = importlib.import_module(shape.BASE_MODULE)
    problems: list[str] = []
    if hasattr(base, "supported_mla_dimensions"):
        assert shape._dims_api(base, module, problems) == shape.DIMS_LIST
    # Without MLADimensions in the module, the list cannot be read: the 0.23 flag or a problem.
    without_dimensions = types.ModuleType("without_dimensions")
    flagged = type("Flagged", (base,), {"requires_r1_mla_dimensions": True})
    assert shape._dims_api(flagged, without_dimensions, problems) == shape.DIMS_R1_FLAG
    assert problems == []
    bare = type("Bare", (), {})
    assert shape._dims_api(bare, without_dimensions, problems) == ""
    assert len(problems) == 1 and "neither supported_mla_dimensions" in problems[0]


def test_vllms_base_class_passes_and_each_change_is_named():
    base = vllm_base()
    problems: list[str] = []
    shape._check_base(base, problems)
    assert problems == []

    class OtherInit(base):
        def __init__(self, num_heads, scale, vllm_config):  # type: ignore[no-untyped-def]
            ...

    class NoLse(base):
        @abc.abstractmethod  # still abstract: only its parameters change
        def run_prefill_new_tokens(self, q, k, v):  # type: ignore[no-untyped-def]
            ...

    shape._check_base(OtherInit, problems)
    shape._check_base(NoLse, problems)
    shape._check_base(42, problems)
    assert len(problems) == 3, problems
    assert "MLAPrefillBackend.__init__ takes ['self', 'num_heads', 'scale', 'vllm_config']" in problems[0]
    assert "run_prefill_new_tokens takes ['self', 'q', 'k', 'v'], expected" in problems[1]
    assert problems[2].endswith("MLAPrefillBackend is not a class")


def test_vllms_registry_and_selector_pass_and_their_changes_are_named():
    found, _ = shape.inspect_vllm()
    assert found is not None
    problems: list[str] = []
    enum, string_names = shape._check_registry(found.registry, problems)
    assert (enum, string_names) == (found.enum, found.string_names)
    assert shape._check_selector(found.selector, problems) is found.auto_takes_capability
    assert problems == []

    empty = types.ModuleType("registry_without_enum")
    assert shape._check_registry(empty, problems) == (None, False)
    assert problems[-1].endswith("has no MLAPrefillBackendEnum (vLLM 0.23+ has both)")
    selector = types.ModuleType("selector_with_another_signature")
    selector.get_mla_prefill_backend = lambda vllm_config, device: None
    shape._check_selector(selector, problems)
    assert any("get_mla_prefill_backend takes ['vllm_config', 'device']" in p for p in problems)
    assert any("_auto_select_mla_prefill_backend takes None" in p for p in problems)


def test_a_module_that_does_not_import_is_the_one_problem_named(monkeypatch):
    monkeypatch.setattr(shape, "SELECTOR_MODULE", f"{shape.PREFILL_PACKAGE}.no_such_selector")
    found, problems = shape.inspect_vllm()
    assert found is None
    assert problems == [
        f"{shape.PREFILL_PACKAGE}.no_such_selector cannot be imported (ModuleNotFoundError: "
        f"No module named '{shape.PREFILL_PACKAGE}.no_such_selector')"
    ]
