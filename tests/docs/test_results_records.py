"""docs/results, the recorded runs: small enough to keep in the repository, every file the docs cite there,
a README per run, and the GPU verdicts' recorded scenarios readable as they are stored (raw files gzipped)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.gpu_harness import scenarios

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
# Room for the GPU verdicts' recorded scenarios (about 240 kB a run, xz), which replay on any CPU.
MAX_BYTES = 2_500_000
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# "results/..." in a doc, also as "docs/results/..." or "$REPO/docs/results/...": always under docs/.
CITED = re.compile(r"(?<![\w.-])results/[\w./*${}@+-]*")
SHELL_VARIABLE = re.compile(r"\$\{?\w+\}?")


def cited_paths(text: str) -> list[str]:
    """The docs/results paths a doc's text names (shell variables in them as ``*``)."""
    return [SHELL_VARIABLE.sub("*", "docs/" + m.group(0).rstrip(".,;:")) for m in CITED.finditer(text)]


def test_citations_are_read_in_every_form_the_docs_use():
    text = (
        "[`results/a/`](results/a/), `docs/results/b/c.json`, MLA_GPU_RESULTS=docs/results/d:docs/results/e`,"
        " --json $REPO/docs/results/f/g-$i.json), [run](results/h/README.md). --results OUT/scenarios"
    )
    assert cited_paths(text) == [
        "docs/results/a/",
        "docs/results/a/",
        "docs/results/b/c.json",
        "docs/results/d",
        "docs/results/e",
        "docs/results/f/g-*.json",
        "docs/results/h/README.md",
    ]


def test_docs_results_stays_under_2_5_mb():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size)[-5:]
    assert total <= MAX_BYTES, (
        f"docs/results holds {total:,} bytes (limit {MAX_BYTES:,}); compress raw logs (gzip) or drop them. "
        f"Largest: {[(str(p.relative_to(RESULTS)), p.stat().st_size) for p in largest]}"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_path_a_doc_cites_exists(doc: Path):
    missing = [
        path
        for path in cited_paths(doc.read_text())
        if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())
    ]
    assert not missing, f"{doc.name} cites what docs/results does not hold: {missing}"


def test_every_run_has_a_readme():
    runs = [p for p in RESULTS.iterdir() if p.is_dir()]
    assert runs
    assert [p.name for p in runs if not (p / "README.md").is_file()] == []


# The runs whose verdicts docs/gpu-verification.md replays on a machine without a GPU.
REPLAYED = [
    "h200-2026-11-30/run1",
    "h200-2026-11-30/run2",
    "h200-2026-12-01-bridge-vllm0.25.1",
    "h200-2026-12-01-bridge-vllm0.25.1-run2",
    "h200-2026-12-01-bridge-vllm0.25.1-run3",
]


@pytest.mark.parametrize("run", REPLAYED)
def test_the_replayed_runs_scenarios_read_back_with_their_logs(run: str):
    folder = RESULTS / run
    assert f"docs/results/{run}" in (ROOT / "docs" / "gpu-verification.md").read_text()
    recorded = {name: data for name in scenarios.SCENARIOS if (data := scenarios.load(folder, name))}
    assert len(recorded) >= 5, sorted(recorded)
    for name, data in recorded.items():
        assert data["name"] == name
        assert scenarios.log_text(folder, name)
