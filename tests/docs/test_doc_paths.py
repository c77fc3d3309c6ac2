"""Every path into tests/ or the package that the README and docs/*.md name exists.

Files and folders move (tests mirror the package; the hosts are named by the vLLM they serve):
a doc that names the old place sends a reader nowhere. docs/results/ holds records of past runs,
which name the files of their day, and is left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# tests/... or mla_prefill_ext/... ending in .py or .sh (a ::test_id after it is left out), or a folder
# (trailing /).
NAMED = re.compile(r"(?<![\w./-])((?:tests|mla_prefill_ext)/[\w/*.-]*?(?:\.py\b|\.sh\b|/(?![\w*])))")


def named_paths(text: str) -> list[str]:
    return [m.group(1) for m in NAMED.finditer(text)]


def test_paths_are_read_in_every_form_the_docs_use():
    text = (
        "`tests/core/test_x.py::test_y`, (tests/gpu/test_*.py), tests/gpu/run.sh,"
        " `mla_prefill_ext/hosts/vllm_0_20/`, mla_prefill_ext/versions.py;"
        " docs/results/tests/a.py, my_tests/b.py, `mla_prefill_ext.testing`"
    )
    assert named_paths(text) == [
        "tests/core/test_x.py",
        "tests/gpu/test_*.py",
        "tests/gpu/run.sh",
        "mla_prefill_ext/hosts/vllm_0_20/",
        "mla_prefill_ext/versions.py",
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tests_or_package_path_a_doc_names_exists(doc: Path):
    missing = sorted(
        {
            path
            for path in named_paths(doc.read_text())
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())
        }
    )
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


# [text](file.md#anchor), [text](#anchor), [text](file.md): links into the repository's Markdown.
LINK = re.compile(r"\]\(((?!https?:|mailto:)[^)\s]*?\.md|)(?:#([\w-]+))?\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (outside code blocks)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_anchors_are_made_as_github_makes_them():
    markdown = (
        "# What the patch does\n```\n# not a heading\n```\n"
        "### 7b. The issue's whole load on a real `vllm serve`\n"
    )
    assert anchors(markdown) == {"what-the-patch-does", "7b-the-issues-whole-load-on-a-real-vllm-serve"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_to_a_doc_and_its_heading_resolves(doc: Path):
    broken = []
    for match in LINK.finditer(doc.read_text()):
        file, anchor = match.group(1), match.group(2)
        if not file and not anchor:
            continue
        target = (doc.parent / file).resolve() if file else doc
        if not target.is_file():
            broken.append(match.group(0))
        elif anchor and anchor not in anchors(target.read_text()):
            broken.append(match.group(0))
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"
