"""The router's prediction per point (``routing.route_cost`` over the groups the step planner forms) and
the crossover: per point the fastest side, measured ``absorbed / shared`` next to the prediction, and
whether the router decided as measured. Used by shared_prefix_layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .shared_prefix_case import BLOCK_SIZE

SIDES = ("vllm", "shared", "absorbed")
SHORT_EXTEND_MAX = 512  # FLASH_ATTN_MLA's reorder_batch_threshold: up to this many new tokens, a decode


def predicted_cost(table: Any, context_lens: Sequence[int], new: int) -> dict[str, Any]:
    """The router's model for these requests, each adding ``new`` tokens (``routing.step_threshold``).

    Groups as the step planner forms them (``costs.GROUP_VALUE``); ``router_moves``: whether the
    router would move them to the prefill path (short extends only, at least two, a group formed,
    predicted prefill time below ``ROUTE_BELOW`` of absorbed).
    """
    import numpy as np

    from mla_prefill_ext.hosts.core.shared_prefix import costs, routing
    from mla_prefill_ext.shared_prefix import find_shared_prefixes

    ctx = np.asarray(context_lens, dtype=np.int64)
    q = np.full_like(ctx, new)
    groups = find_shared_prefixes(np.asarray(table), ctx, BLOCK_SIZE, q, costs.GROUP_VALUE)
    shared = np.zeros_like(ctx)
    tokens = []
    for g in groups:
        t = g.num_blocks * BLOCK_SIZE
        shared[list(g.members)] = t
        tokens.append(t)
    absorbed, prefill = routing.route_cost(q, ctx, shared, tokens)
    short = 1 < new <= SHORT_EXTEND_MAX and ctx.shape[0] >= 2 and bool((ctx > 0).all())
    moves = short and bool(groups) and prefill < routing.ROUTE_BELOW * absorbed
    prediction = dict(absorbed_us=absorbed, prefill_us=prefill, predicted_ratio=absorbed / prefill)
    return {**prediction, "groups": len(groups), "short_extends": short, "router_moves": moves}


def crossover(rows: Sequence[dict[str, Any]], route_below: float) -> dict[str, Any]:
    """Per point the fastest side and measured ``absorbed_ms / shared_ms`` against the predicted ratio,
    and whether the router decided it right.

    The router moves a point's requests when the predicted ratio exceeds ``1 / route_below``; that is
    right when the measured ratio does too (the margin stands for what one layer's context part leaves
    out: the new tokens' own attention pass and the step's planning). Points where it cannot move them
    (no group, not short extends) are not judged. ``consistent``: every judged point decided right.
    """
    points = []
    gain = 1 / route_below
    for row in rows:
        times = {s: row[f"{s}_ms"] for s in (*SIDES, "shared_absorbed") if f"{s}_ms" in row}
        point = dict(new=row["new"], fastest=min(times, key=times.get) if times else None)
        point.update(measured_ratio=row.get("absorbed_over_shared"), predicted_ratio=row["predicted_ratio"])
        point["router_moves"] = row["router_moves"]
        measured = point["measured_ratio"]
        if measured is not None:
            point["measured_over_predicted"] = measured / row["predicted_ratio"]
            if row["short_extends"] and row["groups"]:
                point["router_right"] = row["router_moves"] == (measured > gain)
        points.append(point)
    consistent = all(p.get("router_right", True) for p in points)
    return dict(points=points, route_below=route_below, gain_needed=gain, consistent=consistent)


def crossover_lines(summary: dict[str, Any]) -> list[str]:
    """The crossover as printed: one line per point, then the ROUTE_BELOW range."""

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{'N':>6} {'fastest':>9} {'absorbed/shared':>16} {'predicted':>10} {'meas/pred':>10} {'router':>7}"
    ]
    for p in summary["points"]:
        router = "moves" if p["router_moves"] else "stays"
        if "router_right" in p:
            router += "" if p["router_right"] else " (wrong)"
        lines.append(
            f"{p['new']:>6} {p['fastest'] or '-':>9} {num(p['measured_ratio'], '.2f'):>16} "
            f"{p['predicted_ratio']:>10.2f} {num(p.get('measured_over_predicted'), '.2f'):>10} {router:>7}"
        )
    lines.append(
        f"ROUTE_BELOW = {summary['route_below']}: moves when the predicted ratio is above "
        f"{summary['gain_needed']:.2f}; "
        + ("every point decided as measured" if summary["consistent"] else "some points decided wrong")
    )
    return lines
