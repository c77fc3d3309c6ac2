"""Installed backend packages as importlib.metadata sees them, laid out as pip lays them out.

A ``*.dist-info`` folder with an ``entry_points.txt`` on ``sys.path``, next to the backend's module.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from mla_prefill_ext import discovery

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


def fake_backend(name: str, claim: str = "None") -> str:
    return BACKEND_MODULE.format(cls=f"{name.title().replace('_', '')}Backend", name=name, claim=claim)
