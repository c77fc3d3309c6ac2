"""Discovery: installed packages' entry points registered once per process, from metadata only.

The packages are real installed distributions laid out as pip lays them out (see
tests/helpers/entry_point_packages.py's ``install``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from entry_point_packages import fake_backend, install

from mla_prefill_ext import discovery, registry
from mla_prefill_ext.registry import MLAPrefillBackendEnum


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ("pkg.mod:Backend", "pkg.mod.Backend"),
        (" pkg.mod : Outer.Inner ", "pkg.mod.Outer.Inner"),
        ("pkg.mod", None),  # no class
        (":Backend", None),
        ("pkg.mod:Back end", None),
    ],
)
def test_an_entry_points_value_becomes_a_class_path(value, path):
    assert discovery._class_path(value) == path


def test_discovered_once_until_refreshed(site: Path):
    first = registry.discover_installed(refresh=True)
    install(site, "fakepkg-late", {"FAKE_LATE": "fakepkg_late:Late"})
    assert registry.discover_installed() is first  # the process's one discovery
    assert "FAKE_LATE" in {s.name for s in registry.discover_installed(refresh=True)}


def test_only_distributions_that_name_the_group_are_read(site: Path):
    install(site, "fakepkg-one", {"FAKE_ONE": "fakepkg_one:FakeOneBackend"})
    other = site / "fakepkg_other-1.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg-other\nVersion: 1.0\n")
    (other / "entry_points.txt").write_text("[console_scripts]\nfake = fakepkg_other:main\n")
    found = {(ep.name, ep.dist.name) for ep in discovery._installed_entry_points()}
    assert ("FAKE_ONE", "fakepkg-one") in found
    assert not any(dist == "fakepkg-other" for _, dist in found)


def test_an_installed_package_is_registered_lazily(site):
    install(
        site,
        "fakepkg-one",
        {"FAKE_ONE": "fakepkg_one:FakeOneBackend"},
        {"fakepkg_one": fake_backend("FAKE_ONE")},
    )
    (status,) = [s for s in registry.discover_installed(refresh=True) if s.name == "FAKE_ONE"]
    assert status.problem is None and status.distribution == "fakepkg-one"
    assert "fakepkg_one" not in sys.modules  # metadata only, until selected or inspected
    member = MLAPrefillBackendEnum["FAKE_ONE"]
    assert member.source() == "entry point of package fakepkg-one"
    assert member.get_class().get_name() == "FAKE_ONE"
    assert "fakepkg_one" in sys.modules


def test_an_entry_point_cannot_replace_a_builtin(site):
    install(site, "fakepkg-evil", {"FLASH_ATTN": "fakepkg_evil:Evil"})
    (status,) = [s for s in registry.discover_installed(refresh=True) if s.distribution == "fakepkg-evil"]
    assert "cannot replace the built-in FLASH_ATTN" in status.problem
    assert MLAPrefillBackendEnum.FLASH_ATTN.get_path().startswith("mla_prefill_ext.backends.")


def test_entry_points_are_not_mirrored_to_child_environments(site):

    install(
        site,
        "fakepkg-one",
        {"FAKE_ONE": "fakepkg_one:FakeOneBackend"},
        {"fakepkg_one": fake_backend("FAKE_ONE")},
    )
    registry.discover_installed(refresh=True)
    assert "FAKE_ONE" not in os.environ.get(registry.OVERRIDES_ENV, "")


def test_two_packages_claiming_one_name_register_neither(site):
    install(site, "fakepkg-a", {"FAKE_DUP": "fakepkg_a:A"})
    install(site, "fakepkg-b", {"FAKE_DUP": "fakepkg_b:B"})
    statuses = [s for s in registry.discover_installed(refresh=True) if s.name == "FAKE_DUP"]
    assert len(statuses) == 2 and all("declared by several packages" in s.problem for s in statuses)
    assert "FAKE_DUP" not in MLAPrefillBackendEnum.__members__ or not registry._ENTRY_POINTS.get("FAKE_DUP")


def test_the_first_copy_of_a_package_on_sys_path_wins(site, tmp_path_factory, clean_selection):
    later = tmp_path_factory.mktemp("later-site")
    install(site, "fakepkg-one", {"FAKE_ONE": "fakepkg_one:FakeOneBackend"})
    install(later, "fakepkg-one", {"FAKE_ONE": "fakepkg_one_old:Old"})
    clean_selection.syspath_prepend(str(site))  # site before later
    sys.path.append(str(later))
    try:
        (status,) = [s for s in registry.discover_installed(refresh=True) if s.name == "FAKE_ONE"]
    finally:
        sys.path.remove(str(later))
    assert status.problem is None and status.class_path == "fakepkg_one.FakeOneBackend"
