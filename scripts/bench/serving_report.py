"""The serving benchmark's figures: the client's result JSON, vLLM's request timers from /metrics, stock /
side over every pair of lifetimes; the table and the sweep's plot."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from .sides import markdown_table

# Ours -> `vllm bench serve`'s result key.
CLIENT = {"ttft_p50_ms": "median_ttft_ms", "ttft_p99_ms": "p99_ttft_ms", "ttft_mean_ms": "mean_ttft_ms"}
CLIENT |= {"tpot_mean_ms": "mean_tpot_ms", "requests_per_s": "request_throughput", "duration_s": "duration"}
CLIENT |= {"output_tokens_per_s": "output_throughput", "failed": "failed"}
# vLLM's request histograms, named alike in 0.20.2 and 0.34.0 (vllm/v1/metrics/loggers.py).
TIMERS = {t: f"vllm:request_{t}_time_seconds" for t in ("queue", "prefill", "decode", "inference")}
TIMERS |= {"ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds"}
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
SAMPLES = [f"{m}_{p}" for m in TIMERS.values() for p in ("sum", "count")] + [HITS, QUERIES]
RATIOS = ("ttft_mean_ms", "duration_s", "tpot_mean_ms")  # stock / side: above 1, the side is faster
COLUMNS = ["lifetimes", *list(CLIENT)[:7], *(f"stock/side {k}" for k in RATIOS), "engine_requests"]
COLUMNS += ["engine_ttft_ms", "front_end_ttft_ms", "handover_ms"]
COLUMNS += [*(f"engine_{t}_ms" for t in list(TIMERS)[:4]), "prefix_hits"]


def totals(text: str) -> dict[str, float]:
    """A /metrics text's timer sums and counts and prefix-cache counters, each summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(SAMPLES, 0.0)
    for sample in (s for family in text_string_to_metric_families(text) for s in family.samples):
        if sample.name in out:
            out[sample.name] += sample.value
    return out


def lifetime_figures(workload: dict[str, Any]) -> dict[str, Any]:
    """One lifetime's figures for a workload: the client's; the server's between the two scrapes (requests,
    each timer's mean, the prefix cache's hit rate); where TTFT goes: the front end's share (client's TTFT -
    vLLM's) and the hand-over's (vLLM's TTFT - queue - prefill: from vLLM's front end into the engine core's
    scheduler and the first token back, the engine core's intake and block hashing included; vLLM stamps TTFT
    on the front end's clock, queue and prefill on the engine core's)."""
    out = {ours: workload["client"][theirs] for ours, theirs in CLIENT.items()}
    d = {k: workload["metrics_after"][k] - v for k, v in workload["metrics_before"].items()}
    out["engine_requests"] = d[f"{TIMERS['e2e']}_count"]
    for short, m in TIMERS.items():
        out[f"engine_{short}_ms"] = 1000 * d[f"{m}_sum"] / d[f"{m}_count"] if d[f"{m}_count"] else None
    out["prefix_hits"] = d[HITS] / d[QUERIES] if d[QUERIES] else None
    out["front_end_ttft_ms"] = out["handover_ms"] = None
    if out["engine_ttft_ms"] is not None:
        out["front_end_ttft_ms"] = out["ttft_mean_ms"] - out["engine_ttft_ms"]
        if out["engine_queue_ms"] is not None and out["engine_prefill_ms"] is not None:
            out["handover_ms"] = out["engine_ttft_ms"] - out["engine_queue_ms"] - out["engine_prefill_ms"]
    return out


def summarize(lifetimes: list[dict[str, Any]], workloads: list[str]) -> list[dict[str, Any]]:
    """Per workload and side, each figure's median over the side's lifetimes that ran it with no error (a
    failed request is one); RATIOS' stock / side (median, min, max) over every pair of a stock lifetime
    and one of the side's (stock's row: stock's own pairs)."""
    rows = []
    for name in workloads:
        by_side: dict[str, list[dict[str, Any]]] = {}
        for life in lifetimes:
            if "error" not in (done := life["workloads"].get(name, {"error": "not run"})):
                by_side.setdefault(life["side"], []).append(lifetime_figures(done))
        for side, runs in by_side.items():
            row: dict[str, Any] = {"workload": name, "side": side, "lifetimes": len(runs)}
            for key in runs[0]:
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            stock = by_side.get("stock", [])
            against = itertools.permutations(stock, 2) if side == "stock" else itertools.product(stock, runs)
            pairs = list(against)
            for key in RATIOS:
                if q := [s[key] / x[key] for s, x in pairs if x[key]]:
                    row[f"stock/side {key}"] = dict(median=statistics.median(q), min=min(q), max=max(q))
            rows.append(row)
    return rows


def cell(value: Any) -> str:
    if isinstance(value, dict):  # a ratio over pairs of lifetimes
        return f"{value['median']:.3f} ({value['min']:.3f}..{value['max']:.3f})"
    return "-" if value is None else f"{value:.4g}"


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    cells = ([r["workload"], r["side"], *(cell(r.get(c)) for c in COLUMNS)] for r in rows)
    return markdown_table(["workload", "side", *COLUMNS], cells)


def plot_sweep(rows: list[dict[str, Any]], rates: dict[str, float], path: Path) -> bool:
    """Stock / side mean TTFT (median over pairs of lifetimes) against the request rate of the workloads in
    ``rates``, a line per side; False where there is nothing to plot, or no matplotlib."""
    key = "stock/side ttft_mean_ms"
    if not (points := [r for r in rows if r["workload"] in rates and r["side"] != "stock" and key in r]):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for side in sorted({r["side"] for r in points}):
        mine = sorted((r for r in points if r["side"] == side), key=lambda r: rates[r["workload"]])
        ax.plot([rates[r["workload"]] for r in mine], [r[key]["median"] for r in mine], "o-", label=side)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="request rate (req/s, Poisson)", ylabel="stock / side, mean TTFT")
    fig.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True
