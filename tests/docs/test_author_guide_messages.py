"""The author's guide says which interpreter its commands use and how to get an LSE from PyTorch.

Its new snippet (PyTorch's flash kernel and its LSE) runs with the rest of the guide's code in
tests/test_author_guide.py.
"""

from __future__ import annotations

from pathlib import Path

GUIDE = " ".join((Path(__file__).resolve().parents[2] / "docs" / "backend-authors.md").read_text().split())


def test_the_guide_names_the_interpreter_of_its_commands():
    assert "**Which interpreter.**" in GUIDE
    for tool in (".venv/bin/pip", ".venv/bin/python", ".venv/bin/mla-prefill-ext"):
        assert f"`{tool}`" in GUIDE


def test_the_guide_says_how_to_get_the_lse_where_the_public_sdpa_returns_none():
    assert "**An LSE from PyTorch.**" in GUIDE
    assert "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu" in GUIDE
    assert "torch.ops.aten._scaled_dot_product_flash_attention`" in GUIDE
    assert "torch.logsumexp" in GUIDE
