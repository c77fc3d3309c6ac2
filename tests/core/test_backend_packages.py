"""Backend packages: entry-point discovery, precedence, broken entries, claims, lookups by name.

The packages here are real installed distributions as importlib.metadata sees them: a
``*.dist-info`` folder with an ``entry_points.txt`` on ``sys.path`` (what pip writes),
next to the backend's module; the lookups by name use the example package, pip-installed.
Discovery itself (what is read, once, and registered) is tests/core/test_discovery.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from entry_point_packages import fake_backend, install
from pip_install import pip_install
from vllm.platforms.interface import DeviceCapability

from mla_prefill_ext import registry, selector
from mla_prefill_ext.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from mla_prefill_ext.selector import MLAPrefillSelectorConfig

R1_BF16 = MLAPrefillSelectorConfig.from_dims(__import__("torch").bfloat16, 128, 64, 128)


def test_the_first_missed_name_discovers_the_installed_packages_once(site):
    """No selection ran: a lookup, the enum and a listing find the package; later misses stay cheap."""
    install(
        site,
        "fakepkg-first-miss",
        {"FIRST_MISS": "fakepkg_first_miss:FirstMissBackend"},
        {"fakepkg_first_miss": fake_backend("FIRST_MISS")},
    )
    # Names no other test registers: members added to the enum stay for the process (a worker
    # runs other modules first), and a name known already would make the first miss no miss.
    assert not {"FIRST_MISS", "INSTALLED_LATER"} & set(MLAPrefillBackendEnum.__members__)
    assert registry._DISCOVERED is None
    assert registry.lookup("first_miss").name == "FIRST_MISS"
    assert MLAPrefillBackendEnum["FIRST_MISS"] is MLAPrefillBackendEnum.FIRST_MISS
    assert "FIRST_MISS" in {m.name for m, _ in registry.registered_backends()}
    assert "fakepkg_first_miss" not in sys.modules  # still metadata only
    # Discovery ran once: a package installed after it is not read again at each miss.
    late = {"fakepkg_installed_later": fake_backend("INSTALLED_LATER")}
    entries = {"INSTALLED_LATER": "fakepkg_installed_later:InstalledLaterBackend"}
    install(site / "later", "fakepkg-installed-later", entries, late)
    sys.path.insert(0, str(site / "later"))
    try:
        with pytest.raises(ValueError, match=r"Unknown MLA prefill backend: 'INSTALLED_LATER'.*FIRST_MISS"):
            registry.lookup("INSTALLED_LATER")
        with pytest.raises(AttributeError):
            MLAPrefillBackendEnum.INSTALLED_LATER  # noqa: B018
        registry.discover_installed(refresh=True)
        assert MLAPrefillBackendEnum["INSTALLED_LATER"].get_class().get_name() == "INSTALLED_LATER"
    finally:
        sys.path.remove(str(site / "later"))


def test_registration_by_call_wins_over_an_entry_point(site):
    install(
        site,
        "fakepkg-two",
        {"FAKE_TWO": "fakepkg_two:FakeTwoBackend"},
        {"fakepkg_two": fake_backend("FAKE_TWO")},
    )
    register_mla_prefill_backend("FAKE_TWO", "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend")
    registry.discover_installed(refresh=True)
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
    statuses = {s.name: s for s in registry.discover_installed(refresh=True)}
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


def test_claims_at_one_place_go_in_name_order_whenever_each_was_registered(site):
    """The tie rule: the same order in every process, whatever registered or discovered first.

    FAKE_TIE_ZED is registered by call before discovery finds the installed FAKE_TIE_ALPHA (a
    child process applies them the other way round: registrations from the environment, then
    discovery); both claim the place before TORCH_SDPA on a CPU.
    """
    claim = 'AutoSelectClaim(("cpu",))'
    install(
        site,
        "fakepkg-tie",
        {"FAKE_TIE_ALPHA": "fakepkg_tie_alpha:FakeTieAlphaBackend"},
        {"fakepkg_tie_alpha": fake_backend("FAKE_TIE_ALPHA", claim)},
    )
    (site / "fakepkg_tie_zed.py").write_text(textwrap.dedent(fake_backend("FAKE_TIE_ZED", claim)))
    register_mla_prefill_backend("FAKE_TIE_ZED", "fakepkg_tie_zed.FakeTieZedBackend")
    expected = ["FAKE_TIE_ALPHA", "FAKE_TIE_ZED", "TORCH_SDPA"]
    assert [m.name for m in selector.mla_prefill_backend_priorities(None)] == expected
    assert selector.select(None, R1_BF16).name == "FAKE_TIE_ALPHA"


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


# Every way of naming a backend finds an installed package, in a process where nothing ran before.

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PACKAGE = REPO / "examples" / "mla_prefill_example_backend"
SMALL_SUITE = "device='cpu', dtype='float32', dims=[(64, 32, 64)], num_heads=[2]"
NAME_CASES: dict[str, dict] = {
    "enum_item": {
        "code": "from mla_prefill_ext import MLAPrefillBackendEnum\n"
        "assert MLAPrefillBackendEnum['EXAMPLE'].get_class().get_name() == 'EXAMPLE'"
    },
    "enum_attribute": {
        "code": "from mla_prefill_ext import MLAPrefillBackendEnum\n"
        "assert MLAPrefillBackendEnum.EXAMPLE.source().endswith('package mla-prefill-example-backend')"
    },
    "lookup_after_activate": {
        "code": "import mla_prefill_ext\nmla_prefill_ext.activate()\n"
        "from mla_prefill_ext import registry\nassert registry.lookup('example').name == 'EXAMPLE'"
    },
    "selector_explicit_choice": {
        "code": "import torch\nfrom mla_prefill_ext import selector\n"
        "config = selector.MLAPrefillSelectorConfig.from_dims(torch.float32, 128, 64, 128)\n"
        "choice = selector.Choice('Example', 'MLA_PREFILL_BACKEND', True)\n"
        "assert selector.select(None, config, choice).name == 'EXAMPLE'"
    },
    "run_conformance": {
        "code": "from mla_prefill_ext.testing import run_conformance\n"
        f"report = run_conformance('EXAMPLE', {SMALL_SUITE})\n"
        "assert report.ok and report.backend == 'EXAMPLE', report.format()"
    },
    "assert_conformant": {
        "code": "from mla_prefill_ext.testing import assert_conformant\n"
        f"assert assert_conformant('example', {SMALL_SUITE}).backend == 'EXAMPLE'"
    },
    "cli_check_backend_conformance": {
        "cli": ["check", "--backend", "EXAMPLE", "--conformance", "--dtype", "float32"]
    },
    "cli_check_environment": {
        "env": {"MLA_PREFILL_BACKEND": "EXAMPLE"},
        "cli": ["check", "--repeat", "1", "--dtype", "float32", "--json"],
    },
    "cli_select_backend": {"cli": ["select", "--backend", "example", "--json"]},
    "cli_info_environment": {"env": {"MLA_PREFILL_BACKEND": "EXAMPLE"}, "cli": ["info", "--json"]},
}


@pytest.fixture(scope="module")
def example_package_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/mla_prefill_example_backend installed by pip (metadata, entry point, module)."""
    return pip_install(EXAMPLE_PACKAGE, tmp_path_factory.mktemp("example-package"))


@pytest.fixture(scope="module")
def name_case_results(example_package_site: Path) -> dict[str, dict]:
    """Each case of NAME_CASES run in a process of its own with the example package installed."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_PREFILL")}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(example_package_site), str(REPO), os.environ.get("PYTHONPATH")])
    )
    env["PYTHONDONTWRITEBYTECODE"] = ""  # info's bytecode note depends on the machine, not on names
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "fresh_processes.py")],
        input=json.dumps(list(NAME_CASES.values())),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(NAME_CASES, json.loads(proc.stdout), strict=True))


@pytest.mark.parametrize("case", list(NAME_CASES))
def test_an_installed_package_is_found_by_name_everywhere(
    case: str, name_case_results: dict[str, dict]
) -> None:
    result = name_case_results[case]
    assert result["rc"] == 0, f"{NAME_CASES[case]}:\n{result['stdout'][-2000:]}\n{result['stderr'][-3000:]}"
    out = result["stdout"]
    if case == "cli_check_backend_conformance":
        assert "backend under test: EXAMPLE (from --backend)" in out and "RESULT: PASS" in out
    elif case == "cli_check_environment":
        report = json.loads(out)
        assert report["backend"] == "EXAMPLE" and report["ok"] is True
    elif case == "cli_select_backend":
        report = json.loads(out)
        assert (report["selected"], report["source"]) == ("EXAMPLE", "--backend")
    elif case == "cli_info_environment":
        report = json.loads(out)
        assert report["choice"]["requested"] == "EXAMPLE" and report["choice"]["selected_here"] == "EXAMPLE"
        assert [f for f in report["findings"] if f["level"] == "problem"] == [] and report["verdict"] == "ok"
