"""The MLA prefill backend registry: members, registration, overrides, environment hand-over."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import custom_backends
import pytest
from logs import warnings_in

from mla_prefill_ext import selector
from mla_prefill_ext.backends.base import MLAPrefillBackend
from mla_prefill_ext.backends.flash_attn import FlashAttnPrefillBackend
from mla_prefill_ext.backends.flashinfer import FlashInferPrefillBackend
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.backends.trtllm_ragged import TrtllmRaggedPrefillBackend
from mla_prefill_ext.registry import (
    OVERRIDES_ENV,
    MLAPrefillBackendEnum,
    load_backend_class,
    register_mla_prefill_backend,
    registered_backends,
)

E = MLAPrefillBackendEnum
pytestmark = pytest.mark.usefixtures("clean_selection")
BUILTIN_NAMES = ["FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TORCH_SDPA", "CUSTOM"]
SDPA_PATH = "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
WRAPPED_PATH = "custom_backends.WrappedSDPABackend"


def new_name(prefix: str = "TEST_PREFILL") -> str:
    # Added members stay in the enum for the session: every test takes a fresh name.
    return f"{prefix}_{uuid.uuid4().hex[:10].upper()}"


def overrides_in_env() -> dict[str, str]:
    raw = os.environ.get(OVERRIDES_ENV)
    return {} if raw is None else json.loads(raw)


# Members


def test_builtin_members_and_values() -> None:
    assert list(E.__members__)[:5] == BUILTIN_NAMES
    assert E.FLASH_ATTN.value == "mla_prefill_ext.backends.flash_attn.FlashAttnPrefillBackend"
    assert E.FLASHINFER.value == "mla_prefill_ext.backends.flashinfer.FlashInferPrefillBackend"
    assert E.TRTLLM_RAGGED.value == "mla_prefill_ext.backends.trtllm_ragged.TrtllmRaggedPrefillBackend"
    assert E.TORCH_SDPA.value == SDPA_PATH
    assert E.CUSTOM.value is None
    for name in BUILTIN_NAMES:
        assert E[name].is_builtin
        assert not E[name].is_overridden()


def test_custom_is_its_own_member_not_an_alias() -> None:
    # An alias would share the canonical member's object and report that member's name.
    for name in BUILTIN_NAMES:
        assert E.__members__[name].name == name
    assert E(None) is E.CUSTOM
    assert all(E[n] is not E.CUSTOM for n in BUILTIN_NAMES if n != "CUSTOM")
    assert len({E[n].value for n in BUILTIN_NAMES}) == len(BUILTIN_NAMES)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        E["NOPE"]
    message = str(info.value)
    assert "NOPE" in message
    for name in BUILTIN_NAMES:
        assert name in message


def test_unregistered_custom_explains_how_to_register() -> None:
    with pytest.raises(ValueError, match="register_mla_prefill_backend") as info:
        E.CUSTOM.get_path()
    assert "CUSTOM" in str(info.value)
    # The environment variable is a way too (a CLI run or a process started by hand).
    assert f"""or set {OVERRIDES_ENV}='{{"CUSTOM": "your.module.YourBackend"}}'""" in str(info.value)
    with pytest.raises(ValueError, match="register_mla_prefill_backend"):
        E.CUSTOM.get_class()


@pytest.mark.parametrize(
    ("member", "cls"),
    [
        (E.FLASH_ATTN, FlashAttnPrefillBackend),
        (E.FLASHINFER, FlashInferPrefillBackend),
        (E.TRTLLM_RAGGED, TrtllmRaggedPrefillBackend),
        (E.TORCH_SDPA, TorchSDPAPrefillBackend),
    ],
)
def test_builtin_get_class(member: MLAPrefillBackendEnum, cls: type) -> None:
    assert member.get_class() is cls
    assert member.get_class().get_name() == member.name
    assert member.get_path() == member.value


def run_fresh(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter (no registrations inherited); its stdout lines."""
    env = {k: v for k, v in os.environ.items() if k not in (OVERRIDES_ENV, selector.BACKEND_ENV)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).parents[1] / "helpers",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.splitlines()


def test_backend_modules_are_imported_lazily() -> None:
    # A fresh interpreter: this one has imported every backend module already.
    out = run_fresh(
        """
        import sys
        from mla_prefill_ext.registry import MLAPrefillBackendEnum
        mod = "mla_prefill_ext.backends.trtllm_ragged"
        before = mod in sys.modules
        cls = MLAPrefillBackendEnum.TRTLLM_RAGGED.get_class()
        print(before, mod in sys.modules, cls.__name__)
        """
    )
    assert out[-1] == "False True TrtllmRaggedPrefillBackend"


# Registration


def test_register_with_class_path() -> None:
    decorator = register_mla_prefill_backend(E.CUSTOM, WRAPPED_PATH)
    assert decorator(TorchSDPAPrefillBackend) is TorchSDPAPrefillBackend  # a no-op decorator
    assert E.CUSTOM.is_overridden()
    assert E.CUSTOM.get_path() == WRAPPED_PATH
    assert E.CUSTOM.get_class() is custom_backends.WrappedSDPABackend
    assert (E.CUSTOM, WRAPPED_PATH) in registered_backends()


def test_register_as_decorator_returns_class_and_uses_qualname() -> None:
    cls = custom_backends.WrappedSDPABackend
    assert register_mla_prefill_backend(E.CUSTOM)(cls) is cls
    assert E.CUSTOM.get_path() == "custom_backends.WrappedSDPABackend"

    nested = custom_backends.Outer.NestedSDPABackend
    assert register_mla_prefill_backend(E.CUSTOM)(nested) is nested
    assert E.CUSTOM.get_path() == "custom_backends.Outer.NestedSDPABackend"
    assert E.CUSTOM.get_class() is nested


def test_decorator_syntax_on_a_class() -> None:
    @register_mla_prefill_backend(E.CUSTOM)
    class LocalBackend(TorchSDPAPrefillBackend):
        pass

    assert issubclass(LocalBackend, TorchSDPAPrefillBackend)
    assert E.CUSTOM.get_path() == f"{__name__}.{LocalBackend.__qualname__}"


def test_override_builtin_then_clear_restores_default() -> None:
    register_mla_prefill_backend(E.TORCH_SDPA, WRAPPED_PATH)
    assert E.TORCH_SDPA.is_overridden()
    assert E.TORCH_SDPA.get_class() is custom_backends.WrappedSDPABackend
    assert not E.FLASH_ATTN.is_overridden()

    E.TORCH_SDPA.clear_override()
    assert not E.TORCH_SDPA.is_overridden()
    assert E.TORCH_SDPA.get_path() == SDPA_PATH
    assert E.TORCH_SDPA.get_class() is TorchSDPAPrefillBackend


def test_clear_override_of_custom_makes_it_unregistered_again() -> None:
    register_mla_prefill_backend(E.CUSTOM, WRAPPED_PATH)
    E.CUSTOM.clear_override()
    assert not E.CUSTOM.is_overridden()
    with pytest.raises(ValueError, match="register_mla_prefill_backend"):
        E.CUSTOM.get_path()


def test_new_string_name_becomes_a_member() -> None:
    name = new_name()
    register_mla_prefill_backend(name, WRAPPED_PATH)
    member = E[name]
    assert member.name == name
    assert member in list(E)
    assert name in E.__members__
    assert getattr(E, name) is member
    assert not member.is_builtin
    assert member.is_overridden()
    assert member.get_class() is custom_backends.WrappedSDPABackend
    # Registering the same name again updates the path of the same member.
    register_mla_prefill_backend(name, SDPA_PATH)
    assert E[name] is member
    assert member.get_class() is TorchSDPAPrefillBackend


def test_string_naming_an_existing_member_overrides_it() -> None:
    members_before = list(E.__members__)
    register_mla_prefill_backend("TORCH_SDPA", WRAPPED_PATH)
    assert list(E.__members__) == members_before
    assert E.TORCH_SDPA.is_overridden()
    assert E.TORCH_SDPA.get_class() is custom_backends.WrappedSDPABackend


@pytest.mark.parametrize("name", ["", "1ABC", "MY-PREFILL", "MY PREFILL", "my.prefill", "_PRIVATE"])
def test_invalid_identifier_is_rejected(name: str) -> None:
    members_before = list(E.__members__)
    with pytest.raises(ValueError, match="Invalid MLA prefill backend name"):
        register_mla_prefill_backend(name, WRAPPED_PATH)
    assert list(E.__members__) == members_before
    assert overrides_in_env() == {}


@pytest.mark.parametrize("name", ["get_path", "get_class", "clear_override", "mro"])
def test_enum_attribute_names_are_reserved(name: str) -> None:
    with pytest.raises(ValueError, match="reserved"):
        register_mla_prefill_backend(name, WRAPPED_PATH)
    assert name not in E.__members__
    assert callable(getattr(E, name))  # still the Enum's own attribute


@pytest.mark.parametrize("name", ["name", "value"])
def test_enum_property_names_are_reserved(name: str) -> None:
    # In a fresh interpreter: accepting such a name would shadow Enum.name / Enum.value
    # for every member of this process.
    out = run_fresh(
        f"""
        from mla_prefill_ext.registry import MLAPrefillBackendEnum as E, register_mla_prefill_backend
        try:
            register_mla_prefill_backend({name!r}, "custom_backends.WrappedSDPABackend")
            print("accepted")
        except ValueError as e:
            print("rejected", "reserved" in str(e))
        except Exception as e:
            print("failed", type(e).__name__)
        print(repr(E.CUSTOM.name), repr(E.TORCH_SDPA.value))
        """
    )
    assert out[-2:] == ["rejected True", f"'CUSTOM' {SDPA_PATH!r}"]


def test_backend_must_be_a_member_or_a_string() -> None:
    with pytest.raises(TypeError, match="int"):
        register_mla_prefill_backend(42, WRAPPED_PATH)  # type: ignore[arg-type]


def test_empty_class_path_is_rejected() -> None:
    with pytest.raises(TypeError, match="class_path"):
        register_mla_prefill_backend(E.CUSTOM, "")
    assert not E.CUSTOM.is_overridden()


def test_new_member_survives_pickling() -> None:
    # Registered names are plain members; a pickled one (e.g. in a config handed to a
    # child) must come back as itself, not as another member.
    name = new_name()
    register_mla_prefill_backend(name, WRAPPED_PATH)
    assert pickle.loads(pickle.dumps(E[name])) is E[name]


# Bad paths fail when the class is loaded, naming the path


@pytest.mark.parametrize(
    "path",
    [
        "no_such_module_for_mla_tests.Backend",
        "mla_prefill_ext.backends.no_such_backend.Backend",
        "mla_prefill_ext.backends.torch_sdpa.NoSuchBackend",
        "custom_backends.Outer.NoSuchInner",
    ],
)
def test_bad_path_fails_at_get_class_with_import_error(path: str) -> None:
    register_mla_prefill_backend(E.CUSTOM, path)  # registration itself is lazy
    assert E.CUSTOM.get_path() == path
    with pytest.raises(ImportError) as info:
        E.CUSTOM.get_class()
    assert path in str(info.value)
    assert "CUSTOM" in str(info.value)


def test_import_error_inside_backend_module_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backend module that exists but cannot import its kernel library: the error must
    # say what is missing, not that the class is "not found".
    pkg = f"mla_test_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "kernel_backend.py").write_text(
        "import mla_missing_kernel_library_xyz\n\nclass Backend:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = f"{pkg}.kernel_backend.Backend"
    register_mla_prefill_backend(E.CUSTOM, path)
    with pytest.raises(ImportError) as info:
        E.CUSTOM.get_class()
    assert path in str(info.value)
    assert "mla_missing_kernel_library_xyz" in str(info.value)


def test_path_without_a_module_from_the_environment_fails_at_get_class() -> None:
    # Registration refuses such a path; one handed over in the environment is only
    # applied, so loading it must still fail with a message naming it.
    with pytest.raises(ImportError) as info:
        load_backend_class("NoDotsAtAll", "CUSTOM")
    assert "'NoDotsAtAll' is not of the form 'package.module.ClassName'" in str(info.value)


@pytest.mark.parametrize(
    "path", ["custom_backends.NotABackend", "custom_backends.NOT_A_CLASS", "collections.OrderedDict"]
)
def test_non_backend_class_fails_with_type_error(path: str) -> None:
    register_mla_prefill_backend(E.CUSTOM, path)
    with pytest.raises(TypeError) as info:
        E.CUSTOM.get_class()
    assert path in str(info.value)
    assert "MLAPrefillBackend" in str(info.value)


# What registration checks at once


@pytest.mark.parametrize("path", ["Foo", ".Foo", "pkg.", "pkg..Foo", "pkg.my-module.Foo", "pkg.Foo Bar"])
def test_class_path_without_module_part_is_rejected_at_registration(path: str) -> None:
    with pytest.raises(ValueError) as info:
        register_mla_prefill_backend(E.CUSTOM, path)
    assert f"'{path}'" in str(info.value)
    assert "CUSTOM" in str(info.value)
    assert "package.module.ClassName" in str(info.value)
    assert not E.CUSTOM.is_overridden()
    assert overrides_in_env() == {}


def test_string_name_with_a_bad_path_adds_nothing_to_the_environment() -> None:
    name = new_name()
    with pytest.raises(ValueError, match="'Foo'"):
        register_mla_prefill_backend(name, "Foo")
    assert overrides_in_env() == {}


@pytest.mark.parametrize("obj", [custom_backends.NotABackend, dict, custom_backends.NOT_A_CLASS, len])
def test_decorating_something_that_is_not_a_backend_class_fails_at_once(obj: object) -> None:
    with pytest.raises(TypeError) as info:
        register_mla_prefill_backend(E.CUSTOM)(obj)  # type: ignore[arg-type]
    assert repr(obj) in str(info.value)
    assert "MLAPrefillBackend" in str(info.value)
    assert "CUSTOM" in str(info.value)
    assert not E.CUSTOM.is_overridden()
    assert overrides_in_env() == {}


def test_readme_decorator_example_without_its_methods_fails_at_decoration() -> None:
    # The README's example, as a user would paste it before filling in the methods.
    with pytest.raises(TypeError) as info:

        @register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM)
        class MyPrefill(MLAPrefillBackend): ...

    message = str(info.value)
    assert "MyPrefill" in message
    assert "cannot be instantiated" in message
    assert "get_name, run_prefill_context_chunk, run_prefill_new_tokens" in message
    assert not E.CUSTOM.is_overridden()
    assert overrides_in_env() == {}


def test_decorated_class_missing_one_method_names_only_that_one() -> None:
    class Partial(MLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "PARTIAL"

        def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    with pytest.raises(
        TypeError, match=r"Partial cannot be instantiated: it does not implement run_prefill_context_chunk$"
    ):
        register_mla_prefill_backend("PARTIAL_" + new_name())(Partial)


def test_abstract_class_registered_by_path_fails_when_loaded() -> None:
    # Paths stay lazy: the same check runs when the class is first loaded.
    path = "mla_prefill_ext.backends.base.MLAPrefillBackend"
    register_mla_prefill_backend(E.CUSTOM, path)
    with pytest.raises(TypeError) as info:
        E.CUSTOM.get_class()
    assert f"'{path}' cannot be instantiated" in str(info.value)
    assert "run_prefill_new_tokens" in str(info.value)


# Mirroring into the environment


def test_registration_is_mirrored_into_environment() -> None:
    name = new_name()
    register_mla_prefill_backend(E.CUSTOM, WRAPPED_PATH)
    register_mla_prefill_backend(name, SDPA_PATH)
    assert overrides_in_env() == {"CUSTOM": WRAPPED_PATH, name: SDPA_PATH}

    E.CUSTOM.clear_override()
    assert overrides_in_env() == {name: SDPA_PATH}
    E[name].clear_override()
    assert OVERRIDES_ENV not in os.environ


def test_registering_a_main_class_warns(addon_log: list[logging.LogRecord]) -> None:
    main_cls = type("MainBackend", (TorchSDPAPrefillBackend,), {"__module__": "__main__"})
    register_mla_prefill_backend(E.CUSTOM)(main_cls)
    messages = warnings_in(addon_log)
    assert len(messages) == 1
    assert "CUSTOM" in messages[0]
    assert "__main__.MainBackend" in messages[0]
    assert "importable module" in messages[0]

    register_mla_prefill_backend(E.CUSTOM, "__mp_main__.MainBackend")
    assert len(warnings_in(addon_log)) == 2


def test_registering_an_importable_class_does_not_warn(addon_log: list[logging.LogRecord]) -> None:
    register_mla_prefill_backend(E.CUSTOM)(custom_backends.WrappedSDPABackend)
    assert warnings_in(addon_log) == []


def test_concurrent_registration_of_new_names() -> None:
    names = [new_name("THREADED") for _ in range(16)]
    barrier = threading.Barrier(len(names))
    errors: list[BaseException] = []

    def register(name: str) -> None:
        try:
            barrier.wait()
            register_mla_prefill_backend(name, WRAPPED_PATH)
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=register, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for name in names:
        assert E[name].get_path() == WRAPPED_PATH
        assert list(E.__members__).count(name) == 1
    env = overrides_in_env()
    assert all(env[name] == WRAPPED_PATH for name in names)
    assert len(env) == len(names)


# A spawned child process sees the parent's registrations


def _spawned_child_view(name: str) -> tuple[bool, str, str, str]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply_async(custom_backends.child_view, (name,)).get(timeout=300)


def test_spawned_child_sees_custom_registration() -> None:
    register_mla_prefill_backend(E.CUSTOM)(custom_backends.WrappedSDPABackend)
    assert _spawned_child_view("CUSTOM") == (
        True,
        "custom_backends.WrappedSDPABackend",
        "WrappedSDPABackend",
        "WRAPPED_SDPA",
    )


def test_spawned_child_sees_new_string_name() -> None:
    name = new_name("SPAWNED")
    register_mla_prefill_backend(name, "custom_backends.Outer.NestedSDPABackend")
    assert _spawned_child_view(name) == (
        True,
        "custom_backends.Outer.NestedSDPABackend",
        "NestedSDPABackend",
        "NESTED_SDPA",
    )
