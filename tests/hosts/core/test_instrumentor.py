"""The instrumentor base both hosts share (the patch's patch sets, the bridge): all or none,
symmetric, idempotent.

Exercised on a module of its own making (the real targets are covered by
tests/core/test_activation.py, tests/hosts/vllm_0_20/test_engine_config.py and
tests/hosts/vllm_0_23/test_bridge.py).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import wrapt

from mla_prefill_ext.hosts.core.instrumentor import Instrumentor


def make_module() -> types.ModuleType:
    module = types.ModuleType("instrumented_here")

    class Target:
        def first(self) -> str:
            return "first"

        def second(self) -> str:
            return "second"

    def third() -> str:
        return "third"

    module.Target = Target
    module.third = third
    return module


def shout(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> str:
    return wrapped(*args, **kwargs).upper()


class Shouting(Instrumentor):
    def __init__(self, paths: list[str], reason: str | None = None, completes: str | None = None) -> None:
        super().__init__()
        self.paths, self.reason, self.completes = paths, reason, completes
        self.events: list[str] = []

    def complete(self, module: types.ModuleType) -> str | None:
        self.events.append("complete")
        return self.completes

    def wrappers(self, module: types.ModuleType) -> list[tuple[str, Any]]:
        return [(path, shout) for path in self.paths]

    def check(self, module: types.ModuleType) -> str | None:
        return self.reason

    def on_instrumented(self, module: types.ModuleType) -> None:
        self.events.append("instrumented")

    def on_uninstrumented(self, module: types.ModuleType) -> None:
        self.events.append("uninstrumented")


PATHS = ["Target.first", "Target.second", "third"]


def originals(module: types.ModuleType) -> list[Any]:
    return [module.Target.__dict__["first"], module.Target.__dict__["second"], module.third]


def unchanged(module: types.ModuleType, before: list[Any]) -> bool:
    # By identity: a wrapt proxy compares equal to what it wraps.
    return all(now is then for now, then in zip(originals(module), before, strict=True))


def test_instrument_wraps_every_target_once_and_uninstrument_restores_them():
    module = make_module()
    before = originals(module)
    patch = Shouting(PATHS)
    assert patch.instrument(module) and patch.instrument(module)
    assert module.Target().first() == "FIRST" and module.third() == "THIRD"
    assert not isinstance(module.Target.__dict__["first"].__wrapped__, wrapt.FunctionWrapper)  # once
    assert [p for p, _ in patch.state().handles] == PATHS
    patch.uninstrument(module)
    patch.uninstrument(module)
    assert unchanged(module, before) and not patch.is_instrumented()
    assert patch.events == ["complete", "instrumented", "uninstrumented"]
    assert patch.instrument(module) and module.third() == "THIRD"  # and again after removal


def test_a_wrap_that_fails_undoes_the_part_that_landed():
    module = make_module()
    before = originals(module)
    patch = Shouting([*PATHS[:2], "Target.missing", "third"])
    assert not patch.instrument(module)
    assert unchanged(module, before)
    assert "wrapping failed" in patch.state().skipped_reason and "missing" in patch.state().skipped_reason
    assert patch.events == [] and patch.state().handles == []


def test_a_failed_completion_removes_every_wrapper_and_says_why():
    """What patching takes besides wrappers (the bridge's registration) lands with them or not at all."""
    module = make_module()
    before = originals(module)
    patch = Shouting(PATHS, completes="registration failed (ValueError: taken)")
    assert not patch.instrument(module)
    assert unchanged(module, before) and not patch.is_instrumented()
    assert patch.state().skipped_reason == "registration failed (ValueError: taken)"
    assert patch.events == ["complete"] and patch.state().handles == []


def test_a_failed_check_wraps_nothing_and_says_why():
    module = make_module()
    before = originals(module)
    patch = Shouting(PATHS, reason="not this version")
    assert not patch.instrument(module)
    assert unchanged(module, before) and patch.state().skipped_reason == "not this version"
    patch.uninstrument(module)
    assert patch.state().skipped_reason is None


def test_someone_elses_wrapper_on_top_stays(addon_log):
    module = make_module()
    patch = Shouting(["third"])
    patch.instrument(module)
    wrapt.wrap_function_wrapper(module, "third", lambda w, i, a, k: w(*a, **k) + "!")
    assert module.third() == "THIRD!"
    patch.uninstrument(module)
    assert module.third() == "third!"  # ours is gone from under it, theirs still runs
    assert not patch.is_instrumented()


def test_the_base_alone_names_no_target():
    with pytest.raises(NotImplementedError):
        Instrumentor().wrappers(make_module())
