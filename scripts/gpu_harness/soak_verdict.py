"""Verdicts on a fault soak (scripts/gpu_fault_soak_suite.sh), from its OUT folders, on any machine.

    python -m scripts.gpu_harness.soak_verdict STOCK_OUT PATH_OUT [STOCK_OUT2]   # tokens, path vs stock
    python -m scripts.gpu_harness.soak_verdict --run OUT --side path|stock --max-prompt N  # the run's own

Tokens: the completed requests both soaks answered (by request id; each id's prompt is the same, seeded, and
checked by digest) against stock's with the parity harness's verdicts: with a second stock soak,
``lifetime_noise`` (no further from stock than stock's two soaks are from each other), else ``bf16_noise``
(the FA3-family bound). The run's own: one PASS/FAIL line per point of the soak it can judge from its files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.gpu_harness import verdict


def records(out: Path) -> dict[str, dict]:
    lines = (out / "completions.jsonl").read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, filter(None, lines))}


def tokens_verdict(stock: dict, path: dict, stock2: dict | None = None) -> verdict.Verdict:
    ids = sorted(set(stock) & set(path) & (set(stock2) if stock2 is not None else set(stock)))
    differ = [i for i in ids if stock[i]["prompt_sha"] != path[i]["prompt_sha"]]
    if differ or not ids:
        why = f"prompts differ for ids {differ[:5]}" if differ else "no request completed on both sides"
        return verdict.Verdict("soak", False, float("inf"), reason=why)
    s, p = [stock[i] for i in ids], [path[i] for i in ids]
    if stock2 is None:
        return verdict.bf16_noise(p, s, label="path vs stock", runner_up_only=False)
    calibrations = verdict.lifetime_calibrations([("stock", s), ("stock-2", [stock2[i] for i in ids])])
    return verdict.lifetime_noise(p, s, calibrations, label="path vs stock")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in a Prometheus text page whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
    return sum((s.value for s in samples if s.name == name and labels.items() <= s.labels.items()), 0.0)


def memory_problems(samples: list[dict], start: float, max_prompt: int) -> list[str]:
    """What a process's probe lines show growing: past a memo's cap during the soak, or not back to the
    idle sizes (before ``start``) at the end."""
    idle, end = ([s for s in samples if s["t"] < start][-1:] or samples[:1])[0], samples[-1]
    problems = []
    for s in samples:
        caps, checks = s.get("caps", {}), []
        for h in s.get("hashers", []):
            checks += [(h["donors"], caps["donors"], "donors")]
            checks += [(h["donor_tokens"], caps["copied"] * max_prompt, "donor tokens")]
        for h in s.get("hits", []):
            checks += [(h["memos"], caps["memos"], "memos")]
            checks += [(h["memo_blocks"], caps["memos"] * max_prompt, "memo blocks")]
        checks += [(s["path"]["step_shapes"], caps["step_shapes"], "step shapes")] if "path" in s else []
        problems += [f"{what} {n} > {cap} at {s['t']:.0f}" for n, cap, what in checks if n > cap]
    for key in ("twins", "mirror_addresses", "mirror_bytes"):
        was, now = (x.get("block_tables", {}).get(key, 0) for x in (idle, end))
        problems += [f"{key} {now} at the end, {was} idle"] if now > was else []
    for key in ("hashers", "hits"):  # a new engine's memos next to the old ones'
        was, now = len(idle.get(key, [])), len(end.get(key, []))
        problems += [f"{key}: {now} at the end, {was} idle"] if now > was else []
    return problems


def judge_run(out: Path, side: str, max_prompt: int) -> list[str]:
    client = json.loads((out / "client.json").read_text())
    phases = dict(line.split() for line in (out / "phases.txt").read_text().splitlines() if line.strip())
    start, end = float(phases["soak_start"]), float(phases["soak_end"])
    before, after = ((out / f"metrics-{w}.txt").read_text() for w in ("idle", "end"))

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    sent, done, aborted = client["sent"], client["completed"], client["aborted"]
    fives = {k: v for k, v in client["statuses"].items() if k.startswith("5")}
    http5, preempted = delta("http_requests_total", status="5xx"), delta("vllm:num_preemptions_total")
    ends = ("stop", "length", "abort", "error")
    reasons = {r: delta("vllm:request_success_total", finished_reason=r) for r in ends}
    answered = f"{done} completed + {aborted} aborted of {sent} sent ({end - start:.0f} s)"
    lines = [
        (
            done + aborted == sent and not client["errors"],
            f"answered: {answered}; errors {client['errors']}; vLLM's finish reasons {reasons}",
        ),
        (
            not fives and http5 == 0,
            f"no 5xx: client {fives or 'none'}, server's http_requests_total 5xx +{http5:g}",
        ),
        (preempted >= 50, f"preemptions: vllm:num_preemptions_total +{preempted:g} (at least 50)"),
        (aborted >= 0.2 * sent, f"aborted: {aborted} of {sent} ({aborted / max(sent, 1):.0%}, at least 20%)"),
    ]
    if side != "stock":
        probes = {
            p.name: [json.loads(x) for x in p.read_text().splitlines() if x] for p in out.glob("path-*.jsonl")
        }
        probes = {
            k: [s for s in v if "t" in s and "error" not in s and s["t"] <= end + 600]
            for k, v in probes.items()
        }
        shared = 0
        for samples in probes.values():
            steps = [(s["t"], s["path"]["steps_with_segments"]) for s in samples if "path" in s]
            idle = [n for t, n in steps if t < start]
            shared += steps[-1][1] - (idle[-1] if idle else 0) if steps else 0
        lines.append((shared > 0, f"path engaged: {shared} steps with shared segments during the soak"))
        problems = [
            f"{k}: {p}" for k, v in probes.items() if v for p in memory_problems(v, start, max_prompt)
        ]
        cuda = "; ".join(
            f"{k} {v[0].get('cuda_allocated')} -> {v[-1].get('cuda_allocated')}"
            for k, v in probes.items()
            if v
        )
        memory = (
            f"{problems[:5] or 'yes'} ({len(probes)} processes; CUDA allocated first -> last sample: {cuda})"
        )
        lines.append((bool(probes) and not problems, f"memory bounded, back to idle: {memory}"))
    return [f"{'PASS' if ok else 'FAIL'}: {text}" for ok, text in lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outs", nargs="*", type=Path, help="STOCK_OUT PATH_OUT [STOCK_OUT2]")
    parser.add_argument("--run", type=Path, help="judge this soak's own points")
    parser.add_argument("--side", default="path")
    parser.add_argument("--max-prompt", type=int, default=4096, help="tokens a request holds at most")
    args = parser.parse_args(argv)
    if args.run:
        lines = judge_run(args.run, args.side, args.max_prompt)
        print("\n".join(lines))
        return int(any(line.startswith("FAIL") for line in lines))
    if len(args.outs) not in (2, 3):
        parser.error("tokens: STOCK_OUT PATH_OUT [STOCK_OUT2]")
    stock, path, *more = map(records, args.outs)
    result = tokens_verdict(stock, path, more[0] if more else None)
    print(f"{'PASS' if result.passed else 'FAIL'}: tokens, {result.kind}: {result.reason}")
    return int(not result.passed)


if __name__ == "__main__":
    sys.exit(main())
