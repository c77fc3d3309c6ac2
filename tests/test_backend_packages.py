"""Backend packages: calls win over entry points, broken entries, automatic-selection claims.

The packages here are real installed distributions as importlib.metadata sees them: a
``*.dist-info`` folder with an ``entry_points.txt`` on ``sys.path`` (what pip writes),
next to the backend's module. tests/test_conformance.py pip-installs the example package.
Discovery itself (what is read, once, and registered) is tests/test_discovery.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.platforms.interface import DeviceCapability

from mla_prefill_ext import discovery, selector
from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from mla_prefill_ext.selector import MLAPrefillSelectorConfig

R1_BF16 = MLAPrefillSelectorConfig.from_dims(__import__("torch").bfloat16, 128, 64, 128)

BACKEND_MODULE = """
from mla_prefill_ext.backends.base import AutoSelectClaim
from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


class {cls}(TorchSDPAPrefillBackend):
    auto_select_claim = {claim}

    @staticmethod
    def get_name():
        return "{name}"
"""


def install(root: Path, dist: str, entries: dict[str, str], modules: dict[str, str] | None = None) -> None:
    """Lay out an installed distribution the way pip does: metadata plus modules."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[{discovery.ENTRY_POINT_GROUP}]\n{lines}\n")
    for name, text in (modules or {}).items():
        (root / f"{name}.py").write_text(textwrap.dedent(text))


@pytest.fixture
def site(tmp_path: Path, clean_selection: pytest.MonkeyPatch) -> Iterator[Path]:
    clean_selection.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("fakepkg_")]:
        del sys.modules[name]


def fake_backend(name: str, claim: str = "None") -> str:
    return BACKEND_MODULE.format(cls=f"{name.title().replace('_', '')}Backend", name=name, claim=claim)


def test_registration_by_call_wins_over_an_entry_point(site):
    install(
        site,
        "fakepkg-two",
        {"FAKE_TWO": "fakepkg_two:FakeTwoBackend"},
        {"fakepkg_two": fake_backend("FAKE_TWO")},
    )
    register_mla_prefill_backend("FAKE_TWO", "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend")
    discovery.discover(refresh=True)
    member = MLAPrefillBackendEnum["FAKE_TWO"]
    assert member.get_path() == "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend"
    assert member.source() == "registered by call"
    member.clear_override()
    assert member.get_path() == "fakepkg_two.FakeTwoBackend"  # the package again


def test_broken_entry_points_are_reported_and_never_break_selection(site, addon_log):
    install(
        site,
        "fakepkg-broken",
        {"FAKE_GONE": "fakepkg_missing_module:Nope", "FAKE_BAD": "not a value"},
    )
    install(
        site,
        "fakepkg-misnamed",
        {"FAKE_MISNAMED": "fakepkg_mis:FakeOtherBackend"},
        {"fakepkg_mis": fake_backend("FAKE_OTHER", 'AutoSelectClaim(("cpu",))')},
    )
    statuses = {s.name: s for s in discovery.discover(refresh=True)}
    assert "not of the form" in statuses["FAKE_BAD"].problem
    assert statuses["FAKE_GONE"].problem is None  # only importing can tell
    # Automatic selection is untouched by them (the misnamed one is left out with a warning).
    assert selector.select(None, R1_BF16).name == "TORCH_SDPA"
    assert any("FAKE_MISNAMED is left out of automatic selection" in r.getMessage() for r in addon_log)
    # Selected by name, each fails with a message naming what is wrong.
    with pytest.raises(ValueError, match="fakepkg_missing_module"):
        selector.select(None, R1_BF16, selector.Choice("FAKE_GONE", "MLA_PREFILL_BACKEND", True))
    with pytest.raises(ValueError, match="entry point's name must be the backend's name"):
        selector.select(None, R1_BF16, selector.Choice("FAKE_MISNAMED", "MLA_PREFILL_BACKEND", True))


@pytest.mark.parametrize(
    ("claim", "capability", "expected"),
    [
        ('AutoSelectClaim(("9.x",))', (9, 0), ["FAKE_CLAIM", "FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]),
        (
            'AutoSelectClaim(("9.0",), before="FLASHINFER")',
            (9, 0),
            ["FLASH_ATTN", "FAKE_CLAIM", "FLASHINFER", "TORCH_SDPA"],
        ),
        ('AutoSelectClaim(("9.x",))', (8, 0), ["FLASH_ATTN", "TORCH_SDPA"]),  # claim does not hold here
        (
            '{"capabilities": ["cpu"]}',
            None,
            ["FAKE_CLAIM", "TORCH_SDPA"],
        ),  # FLASH_ATTN absent: before the fallback
        ("None", (9, 0), ["FLASH_ATTN", "FLASHINFER", "TORCH_SDPA"]),  # no claim: built-in order
    ],
)
def test_claims_join_automatic_selection(site, claim, capability, expected):
    install(
        site,
        "fakepkg-claim",
        {"FAKE_CLAIM": "fakepkg_claim:FakeClaimBackend"},
        {"fakepkg_claim": fake_backend("FAKE_CLAIM", claim)},
    )
    cap = None if capability is None else DeviceCapability(*capability)
    assert [m.name for m in selector.mla_prefill_backend_priorities(cap)] == expected


def test_explicit_choice_beats_a_claim_and_a_claim_beats_the_builtins(site, addon_log):
    import logging

    install(
        site,
        "fakepkg-claim",
        {"FAKE_CLAIM": "fakepkg_claim:FakeClaimBackend"},
        {"fakepkg_claim": fake_backend("FAKE_CLAIM", 'AutoSelectClaim(("cpu",))')},
    )
    logger = logging.getLogger("vllm.mla_prefill_ext")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        auto = selector._select_cached(None, R1_BF16, None)
    finally:
        logger.setLevel(level)
    assert auto.name == "FAKE_CLAIM" and auto.source == "automatic"
    assert any("FAKE_CLAIM joined automatic selection by its claim" in r.getMessage() for r in addon_log)
    explicit = selector.select(None, R1_BF16, selector.Choice("TORCH_SDPA", "MLA_PREFILL_BACKEND", True))
    assert explicit.name == "TORCH_SDPA"


def test_a_builtin_claim_attribute_is_ignored(site, clean_selection):
    """Only out-of-tree backends (registered by call or installed) may claim a place."""
    install(
        site, "fakepkg-claim", {}, {"fakepkg_claim": fake_backend("FLASH_ATTN", 'AutoSelectClaim(("cpu",))')}
    )
    register_mla_prefill_backend(MLAPrefillBackendEnum.FLASH_ATTN, "fakepkg_claim.FlashAttnBackend")
    assert [m.name for m in selector.mla_prefill_backend_priorities(None)] == ["TORCH_SDPA"]


def test_a_spawned_process_selects_the_installed_package_by_its_claim(site):
    """A new process (as vLLM's engine core and workers are) discovers the package on its own."""
    install(
        site,
        "fakepkg-claim",
        {"FAKE_CLAIM": "fakepkg_claim:FakeClaimBackend"},
        {"fakepkg_claim": fake_backend("FAKE_CLAIM", 'AutoSelectClaim(("cpu",))')},
    )
    code = textwrap.dedent(
        """
        import json, sys
        import mla_prefill_ext
        mla_prefill_ext.activate()
        import torch
        from mla_prefill_ext import selector
        s = selector.select(None, selector.MLAPrefillSelectorConfig.from_dims(torch.bfloat16, 128, 64, 128))
        print(json.dumps({"name": s.name, "module": s.backend.__module__}))
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MLA_PREFILL")}
    env["PYTHONPATH"] = str(site)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "name": "FAKE_CLAIM",
        "module": "fakepkg_claim",
    }


def test_a_malformed_claim_leaves_the_backend_out_of_automatic_selection(site, addon_log):
    install(
        site,
        "fakepkg-claim",
        {"FAKE_CLAIM": "fakepkg_claim:FakeClaimBackend"},
        {"fakepkg_claim": fake_backend("FAKE_CLAIM", '"cpu"')},
    )
    assert selector.select(None, R1_BF16).name == "TORCH_SDPA"
    assert any("FAKE_CLAIM is left out of automatic selection" in r.getMessage() for r in addon_log)
    # Still selectable by name: the claim only concerns automatic selection.
    explicit = selector.select(None, R1_BF16, selector.Choice("FAKE_CLAIM", "MLA_PREFILL_BACKEND", True))
    assert explicit.name == "FAKE_CLAIM"
