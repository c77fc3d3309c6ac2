"""Every pair of the shared-prefix parity scenarios found in result folders, as the GPU tests judge them.

    python -m scripts.gpu_harness.shared_pairs DIR [DIR ...]

Stock against stock within each group of lifetimes (vLLM's decode path for short extends; its prefill
path), each group's lifetime bound, every add-on or mutant run against every stock lifetime under it
(``verdict.lifetime_noise``), and vLLM's two paths against each other: one line per pair (largest
logprob difference, flips, refused flips, flips at the first token). Reads recorded results only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import sys
from pathlib import Path

from scripts.gpu_harness import engine_runner, scenarios, verdict

DECODE, PREFILL = "decode path (as shipped)", "prefill path (--decode-threshold 1)"
GROUPS = {DECODE: scenarios.SHARED_STOCK, PREFILL: scenarios.SHARED_STOCK_PREFILL}
CANDIDATES = ("shim-fa-shared", "shim-fa-shared-2", "mutant-shared-other-prefix", "mutant-shared-drop-lse")
CANDIDATES += ("mutant-shared-segment-scale",)


def _line(label: str, v: verdict.Verdict) -> str:
    refused, first = sum(not f.allowed for f in v.flips), sum(f.position == 0 for f in v.flips)
    head = f"{label}: {'pass' if v.passed else 'FAIL'} (bound {v.bound:.3g})"
    head += f", max |logprob diff| {v.max_diff:.4g}"
    return f"{head}, {len(v.flips)} flip(s), {refused} refused, {first} at the first token"


def pair_lines(folders: list[Path]) -> list[str]:
    runs = {}
    for folder in folders:
        for name in {*CANDIDATES, *itertools.chain(*GROUPS.values())}:
            data = scenarios.load(folder, name)
            if data is not None and data.get("ok"):
                runs[name] = engine_runner.records(data)
    lines = []
    for group, names in GROUPS.items():
        present = [n for n in names if n in runs]
        calibrations = verdict.lifetime_calibrations([(n, runs[n]) for n in present])
        lines.append(f"== {group}: {', '.join(present) or 'no run'}")
        lines += [_line(f"stock {v.label}", v) for v in calibrations]
        if not calibrations:
            continue
        lines.append(f"lifetime bound: {verdict.lifetime_bound(calibrations):.4g}")
        for c in (n for n in CANDIDATES if n in runs):
            for ref in present:
                lines.append(_line(f"{c} vs {ref}", verdict.lifetime_noise(runs[c], runs[ref], calibrations)))
    lines.append("== vLLM's two paths for the same requests (bf16_noise)")
    for a, b in itertools.product(GROUPS[PREFILL], GROUPS[DECODE]):
        if a in runs and b in runs:
            lines.append(_line(f"{a} vs {b}", verdict.bf16_noise(runs[a], runs[b])))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="result folders (later ones win for a name)")
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # each verdict prints itself in full
        lines = pair_lines(args.folders)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
