"""``select``: which backend would serve a configuration, the automatic order, and each candidate."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from mla_prefill_ext.cli.common import (
    AUTOMATIC,
    EXIT_OK,
    EXIT_PROBLEM,
    CannotCheck,
    Report,
    backend_choice,
    cap_json,
    cap_str,
    capability,
    chosen_automatically,
    claim_text,
    disabled_lines,
    dtype,
    note_unsupported,
    probe_host,
)
from mla_prefill_ext.cli.registrations import competing_claims, competing_claims_text
from mla_prefill_ext.settings import is_disabled


@dataclass
class SelectReport(Report):
    """The selection for one configuration, with the order and the candidates it went through."""

    capability: Any  # vLLM's DeviceCapability, None: no GPU
    dtype: str
    r1_dims: bool
    automatic_order: list[str] | None  # None: it cannot be made (automatic_order_error says why)
    automatic_order_error: str | None
    builtin_order: list[str]
    claims: dict[str, dict[str, Any]]  # by name: the out-of-tree backends that joined by a claim
    requested: str
    source: str
    selected: str | None
    error: str | None
    candidates: list[dict[str, Any]]
    competing_claims: list[dict[str, Any]]  # backends whose claims put them at one place
    disabled: bool  # MLA_PREFILL_EXT_DISABLE is set: vLLM would not use the selection

    @property
    def selected_by_claim(self) -> bool:
        return (
            self.selected is not None and chosen_automatically(self.source) and self.selected in self.claims
        )

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return EXIT_OK if self.selected else EXIT_PROBLEM

    def to_json(self) -> dict[str, Any]:
        return {
            "capability": cap_json(self.capability),
            "dtype": self.dtype,
            "r1_dims": self.r1_dims,
            "automatic_order": self.automatic_order,
            "automatic_order_error": self.automatic_order_error,
            "builtin_order": self.builtin_order,
            "claims": list(self.claims.values()),
            "requested": self.requested,
            "source": self.source,
            "selected": self.selected,
            "selected_by_claim": self.selected_by_claim,
            "error": self.error,
            "candidates": self.candidates,
            "competing_claims": self.competing_claims,
            "disabled_by_env": self.disabled,
        }

    def text_lines(self) -> list[str]:
        if self.automatic_order is None:
            shown_order = f"cannot be made: {self.automatic_order_error}"
        else:
            shown_order = " > ".join(
                f"{n} ({claim_text(self.claims[n])})" if n in self.claims else n for n in self.automatic_order
            )
        if self.selected:
            joined = " (it joined automatic selection by its claim)" if self.selected_by_claim else ""
            selected = [f"selected: {self.selected}{joined}"]
        else:
            selected = ["selected: none", f"error: {self.error}"]
        cap = self.capability
        where = "without a GPU" if cap is None else f"on compute capability {cap.major}.{cap.minor}"
        sources = {name: claim["source"] for name, claim in self.claims.items()}
        consequence = "this is what the add-on would select if it were on"
        width = max([14, *(len(c["name"]) for c in self.candidates)])  # one column, long names too
        return [
            *disabled_lines(self.disabled, consequence),
            f"capability {cap_str(cap)}, dtype {self.dtype}, DeepSeek-R1 MLA dims: "
            f"{'yes' if self.r1_dims else 'no'}",
            f"automatic order: {shown_order}",
            *(f"note: {competing_claims_text(g, sources, where)}" for g in self.competing_claims),
            f"requested: {self.requested} ({self.source})",
            *selected,
            "candidates:",
            *(
                f"  {c['name']:<{width}} {'valid' if c['valid'] else 'invalid: ' + '; '.join(c['reasons'])}"
                for c in self.candidates
            ),
        ]


def cmd_select(args: argparse.Namespace) -> Report:
    host = probe_host()
    if host.problems:
        return CannotCheck("select", host)
    note_unsupported(host)
    from mla_prefill_ext.registry import registered_backends
    from mla_prefill_ext.selector import (
        MLAPrefillSelectorConfig,
        builtin_priorities,
        check_backend,
        claims,
        mla_prefill_backend_priorities,
        select,
    )

    choice = backend_choice(args)
    cap = capability(args.capability)
    config = MLAPrefillSelectorConfig.from_dims(dtype(args.dtype), *args.dims[:3])
    # The automatic order, with the out-of-tree backends that joined it by a claim on this
    # device (this also discovers the installed backend packages).
    try:
        order = [m.name for m in mla_prefill_backend_priorities(cap)]
        claimed = {
            m.name: {
                "name": m.name,
                "source": m.source(),
                "capabilities": list(c.capabilities),
                "before": c.before,
            }
            for m, c in claims(cap)
        }
    except (TypeError, ValueError) as e:  # a backend's auto_select_claim is malformed
        order, claimed, order_error = None, {}, str(e)
    else:
        order_error = None
    candidates = []
    for member, path in registered_backends():
        if path is None:
            continue  # CUSTOM-like, nothing registered
        _, reasons = check_backend(member, cap, config)
        candidates.append({"name": member.name, "valid": not reasons, "reasons": reasons})
    error = None
    try:
        selection = select(cap, config, choice)
        chosen, source = selection.name, selection.source
    except (TypeError, ValueError) as e:
        chosen, source, error = None, (choice.source if choice else AUTOMATIC), str(e)
    return SelectReport(
        capability=cap,
        dtype=str(config.dtype).removeprefix("torch."),
        r1_dims=config.is_r1_compatible,
        automatic_order=order,
        automatic_order_error=order_error,
        builtin_order=[m.name for m in builtin_priorities(cap)],
        claims=claimed,
        requested=choice.name if choice else "AUTO",
        source=source,
        selected=chosen,
        error=error,
        candidates=candidates,
        competing_claims=competing_claims(cap),
        disabled=is_disabled(),
    )
