"""Backend classes by class path: every way a path can be wrong says which, and names the path."""

from __future__ import annotations

import pytest

from mla_prefill_ext import class_paths


def test_a_backend_class_loads_by_its_path():
    from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend

    path = "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
    assert class_paths.load_backend_class(path, "TORCH_SDPA") is TorchSDPAPrefillBackend
    assert class_paths.backend_class_problem(TorchSDPAPrefillBackend) is None


def test_a_nested_class_loads_through_its_outer_class():
    import custom_backends

    loaded = class_paths.load_backend_class("custom_backends.Outer.NestedSDPABackend", "MINE")
    assert loaded is custom_backends.Outer.NestedSDPABackend


def test_a_path_without_a_module_is_refused_by_its_form():
    with pytest.raises(ImportError, match=r"^MLA prefill backend MINE: class path 'Foo' is not of the form"):
        class_paths.load_backend_class("Foo", "MINE")


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("custom_backends.NoSuchBackend", "'custom_backends.NoSuchBackend' not found"),
        ("custom_backends.Outer.NoSuchInner", "'custom_backends.Outer.NoSuchInner' not found"),
        # The deepest module that imports is the owner: the rest is looked up as attributes.
        ("mla_prefill_ext.backends.no_such_module.Backend", "not found"),
        ("no_such_package_for_mla.module.Backend", "cannot import 'no_such_package_for_mla.module.Backend'"),
    ],
)
def test_a_path_to_nothing_says_what_is_missing(path, says):
    with pytest.raises(ImportError) as info:
        class_paths.load_backend_class(path, "MINE")
    assert str(info.value).startswith("MLA prefill backend MINE: ") and says in str(info.value)


def test_a_module_that_fails_to_import_is_not_reported_as_missing(site):
    """Its own missing dependency is the error, not the backend's path (no walking up to its package)."""
    (site / "fakepkg_backends").mkdir()
    (site / "fakepkg_backends" / "__init__.py").write_text("")
    (site / "fakepkg_backends" / "needs_a_library.py").write_text("import fakepkg_library_not_installed\n")
    with pytest.raises(ImportError) as info:
        class_paths.load_backend_class("fakepkg_backends.needs_a_library.Backend", "MINE")
    message = str(info.value)
    assert message.startswith(
        "MLA prefill backend MINE: cannot import 'fakepkg_backends.needs_a_library.Backend': "
    )
    assert "fakepkg_library_not_installed" in message


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("custom_backends.NotABackend", "is <class 'custom_backends.NotABackend'>, not a subclass of"),
        ("custom_backends.NOT_A_CLASS", "is 42, not a subclass of mla_prefill_ext.MLAPrefillBackend"),
    ],
)
def test_what_is_not_a_backend_class_is_a_type_error(path, says):
    with pytest.raises(TypeError, match=rf"^MLA prefill backend MINE: '{path}' ") as info:
        class_paths.load_backend_class(path, "MINE")
    assert says in str(info.value)


def test_an_abstract_backend_class_names_every_method_it_lacks(site):
    from mla_prefill_ext.backends.base import MLAPrefillBackend

    class HalfDone(MLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "HALF_DONE"

    assert class_paths.backend_class_problem(HalfDone) == (
        "cannot be instantiated: it does not implement run_prefill_context_chunk, run_prefill_new_tokens"
    )
    (site / "fakepkg_abstract.py").write_text(
        "from mla_prefill_ext.backends.base import MLAPrefillBackend\n\n\nclass Bare(MLAPrefillBackend):\n"
        "    pass\n"
    )
    with pytest.raises(TypeError) as info:
        class_paths.load_backend_class("fakepkg_abstract.Bare", "MINE")
    assert str(info.value) == (
        "MLA prefill backend MINE: 'fakepkg_abstract.Bare' cannot be instantiated: it does not implement "
        "get_name, run_prefill_context_chunk, run_prefill_new_tokens"
    )
