"""What ``info`` reports of the registry: every backend, the installed packages, their claims."""

from __future__ import annotations

import json
from typing import Any

from mla_prefill_ext.cli.common import Finding, claim_text


def overrides_findings(raw: str | None) -> list[Finding]:
    """What is wrong with the registrations handed over in the environment (once: the choice's
    report leaves out the same refusal, ``info.choice_report``)."""
    from mla_prefill_ext.registry import MLAPrefillBackendEnum
    from mla_prefill_ext.settings import OVERRIDES_ENV, overrides_problem

    if not raw:
        return []
    problem = overrides_problem()  # not JSON, not an object, a key that is no name, a path no string
    if problem is not None:
        return [Finding("problem", f"{problem}.")]
    return [
        Finding(
            "problem",
            f"{OVERRIDES_ENV} entry {name!r} is ignored: it is not a usable backend name "
            "(use an identifier such as MY_PREFILL, not a reserved name).",
        )
        for name in json.loads(raw)
        if name not in MLAPrefillBackendEnum.__members__
    ]


def entry_point_rows() -> tuple[list[dict[str, Any]], list[Finding]]:
    """Installed backend packages (entry points): registered, or why not."""
    from mla_prefill_ext.discovery import ENTRY_POINT_GROUP
    from mla_prefill_ext.registry import discover_installed

    rows, findings = [], []
    for ep in discover_installed():
        rows.append(ep._asdict())
        if ep.problem:
            package = f" of package {ep.distribution}" if ep.distribution else ""
            findings.append(
                Finding(
                    "problem",
                    f"The {ENTRY_POINT_GROUP} entry point {ep.name} = '{ep.value}'{package} is not "
                    f"used: {ep.problem.rstrip('.')}.",
                )
            )
    return rows, findings


def entry_point_line(row: dict[str, Any]) -> str:
    """The ``backends:`` line of an installed package's entry point that is not used."""
    return (
        f"  PROBLEM  entry point {row['name']} = '{row['value']}' (package {row['distribution'] or '?'}): "
        "not used (see the findings)"
    )


def _claim_row(member: Any, cls: type, cap: Any) -> tuple[dict[str, Any] | None, Finding | None]:
    """A backend's claim on automatic selection, and whether it applies on this device."""
    from mla_prefill_ext.backends.base import AutoSelectClaim

    raw = getattr(cls, "auto_select_claim", None)
    try:
        claim = AutoSelectClaim.of(raw)
    except (TypeError, ValueError) as e:
        message = (
            f"MLA prefill backend {member.name} has an invalid auto_select_claim ({e}), so automatic "
            "selection fails; give an AutoSelectClaim or a dict with 'capabilities' and 'before'."
        )
        row = {"capabilities": None, "before": None, "applies_here": False, "ignored": None, "error": str(e)}
        return row, Finding("problem", message)
    if claim is None:
        return None, None
    row: dict[str, Any] = {
        "capabilities": list(claim.capabilities),
        "before": claim.before,
        "applies_here": False,
        "ignored": None,
        "error": None,
    }
    if member.value is not None:
        row["ignored"] = "built-in backends keep their own place in automatic selection"
    else:
        row["applies_here"] = claim.matches(cap)
    return row, None


def backend_rows() -> tuple[list[dict[str, Any]], list[Finding]]:
    """Every backend name with its class path, where it comes from, whether that class loads,
    and its claim on automatic selection (with whether it applies on this device)."""
    from mla_prefill_ext.registry import registered_backends
    from mla_prefill_ext.selector import current_device_capability

    cap = current_device_capability()
    rows, findings = [], []
    for member, path in registered_backends():
        source = member.source()  # built-in, registered by call, entry point of package X, not registered
        if path is None:
            kind = "placeholder for your own backend" if member.name == "CUSTOM" else source
        elif member.value is not None and member.is_overridden():
            kind = f"built-in, overridden: {source}"
        else:
            kind = source
        error = claim = None
        if path is not None:
            try:
                cls = member.get_class()
            except Exception as e:  # ImportError/TypeError/ValueError, or whatever the module raises
                error = str(e).rstrip(".")
                if not error.startswith(f"MLA prefill backend {member.name}"):
                    error = f"MLA prefill backend {member.name} cannot be loaded: {error}"
                findings.append(Finding("problem", f"{error}."))
            else:
                claim, claim_finding = _claim_row(member, cls, cap)
                if claim_finding is not None:
                    findings.append(claim_finding)
        rows.append(
            {
                "name": member.name,
                "kind": kind,
                "overridden": member.is_overridden(),
                "class_path": path,
                "loads": None if path is None else error is None,
                "error": error,
                "claim": claim,
            }
        )
    return rows, findings


def backend_line(b: dict[str, Any]) -> str:
    """One backend's line under ``backends:``."""
    kind = b["kind"]
    if b["class_path"] is None:
        return f"  -        {b['name']} ({kind}): not registered"
    if not b["loads"]:
        return f"  PROBLEM  {b['name']} ({kind}): {b['class_path']} (see the findings)"
    claim = b["claim"]
    if claim is None:
        return f"  ok       {b['name']} ({kind}): {b['class_path']}"
    if claim["error"] is not None:
        return f"  PROBLEM  {b['name']} ({kind}): {b['class_path']}; invalid claim (see the findings)"
    if claim["ignored"]:
        where = f"ignored: {claim['ignored']}"
    elif claim["applies_here"]:
        where = "applies on this device"
    else:
        where = "does not apply on this device"
    return f"  ok       {b['name']} ({kind}): {b['class_path']}; {claim_text(claim)} ({where})"


TIE_RULE = "claims at one place are tried in the alphabetical order of the backends' names"


def competing_claims(cap: Any) -> list[dict[str, Any]]:
    """Out-of-tree backends whose claims put them at the same place in automatic selection on
    this device: ``{"before": place, "order": [first, second, ...]}`` for each such place."""
    from mla_prefill_ext.selector import claims, mla_prefill_backend_priorities

    try:
        claimed = {m.name for m, _ in claims(cap)}
        order = [m.name for m in mla_prefill_backend_priorities(cap)]
    except (TypeError, ValueError):  # a malformed claim: backend_rows reports it
        return []
    # Claims at one place end up side by side, in front of the backend they named.
    groups, run = [], []
    for name in order:
        if name in claimed:
            run.append(name)
            continue
        if len(run) > 1:
            groups.append({"before": name, "order": run})
        run = []
    return groups


def competing_claims_text(group: dict[str, Any], sources: dict[str, str], where: str) -> str:
    """``A (entry point of package a) and B (...) claim the same place ...``, as a sentence."""
    first, *rest = group["order"]
    named = [f"{n} ({sources[n]})" if n in sources else n for n in group["order"]]
    serve = "serves" if len(rest) == 1 else "serve"
    return (
        f"{', '.join(named[:-1])} and {named[-1]} claim the same place in automatic selection "
        f"{where}, before {group['before']}; {TIE_RULE}: {first} comes first and serves every "
        f"model it accepts, {' and '.join(rest)} {serve} only models {first} refuses."
    )
