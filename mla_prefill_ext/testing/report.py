"""What a conformance run found: one result per property and case, as text or as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mla_prefill_ext.testing.cases import ConformanceCase
from mla_prefill_ext.testing.formatting import dtype_name, json_number
from mla_prefill_ext.testing.properties import FAIL, PASS, PROPERTIES, SKIP
from mla_prefill_ext.testing.tolerances import TOLERANCES


@dataclass
class CheckResult:
    """One property checked on one case."""

    property: str
    case: str
    status: str  # "pass" | "fail" | "skip"
    message: str = ""
    measured: float | None = None
    tolerance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "property": self.property,
            "case": self.case,
            "status": self.status,
            "message": self.message,
            "measured": json_number(self.measured),
            "tolerance": json_number(self.tolerance),
        }


@dataclass
class ConformanceReport:
    """What :func:`run_conformance` found: one :class:`CheckResult` per property and case."""

    backend: str
    backend_class: str
    device: str
    capability: str | None
    merge: str
    cases: list[ConformanceCase]
    skipped_cases: dict[str, str]  # case label -> why the backend cannot serve it
    results: list[CheckResult] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def ran(self) -> bool:
        """Whether at least one case ran (was not refused by validate_configuration)."""
        return len(self.skipped_cases) < len(self.cases)

    @property
    def ok(self) -> bool:
        """At least one case ran and no property failed."""
        return self.ran and not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def failed_properties(self) -> list[str]:
        failed = {r.property for r in self.failures}
        return [p for p in PROPERTIES if p in failed]

    def results_for(self, prop: str) -> list[CheckResult]:
        return [r for r in self.results if r.property == prop]

    def status_of(self, prop: str) -> str:
        """``fail`` if any case failed it, else ``pass`` if any case passed it, else ``skip``."""
        statuses = {r.status for r in self.results_for(prop)}
        return FAIL if FAIL in statuses else PASS if PASS in statuses else SKIP

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "class": self.backend_class,
            "device": self.device,
            "capability": self.capability,
            "merge": self.merge,
            "tolerances": {
                dtype_name(c.dtype): vars(TOLERANCES[c.dtype]) for c in self.cases if c.dtype in TOLERANCES
            },
            "cases": [{**c.to_dict(), "skipped": self.skipped_cases.get(c.label)} for c in self.cases],
            "properties": {p: {"status": self.status_of(p), "description": d} for p, d in PROPERTIES.items()},
            "failed_properties": self.failed_properties,
            "results": [r.to_dict() for r in self.results],
            "duration_s": self.duration_s,
        }

    def format(self, verbose: bool = False) -> str:
        """A human summary: each property's status, and every failure with its measured error."""
        lines = [*self._header_lines(), "properties:"]
        for prop in PROPERTIES:
            lines += self._property_lines(prop, verbose)
        if not self.ran:
            lines.append("RESULT: FAIL (nothing was checked: the backend cannot serve any case here)")
        elif self.failures:
            lines.append(f"RESULT: FAIL ({', '.join(self.failed_properties)})")
        else:
            lines.append("RESULT: PASS")
        lines.append(f"({self.duration_s:.2f} s)")
        return "\n".join(lines)

    def _header_lines(self) -> list[str]:
        """The backend, the device, the merge used, and each case run or skipped."""
        lines = [
            f"MLA prefill conformance: {self.backend} ({self.backend_class})",
            f"device: {self.device}"
            + (f", compute capability {self.capability}" if self.capability else "")
            + f"; merge: {self.merge}",
        ]
        run = [c for c in self.cases if c.label not in self.skipped_cases]
        lines.append(f"cases: {len(run)} run, {len(self.skipped_cases)} skipped (backend cannot serve them)")
        for c in run:
            tol = TOLERANCES[c.dtype]
            lines.append(
                f"  run   {c.label} (scale {c.scale:.6g}; tolerance: output {tol.output_rel:.3g} "
                f"x max |ref|, LSE {tol.lse_abs:g})"
            )
        for label, reason in self.skipped_cases.items():
            lines.append(f"  SKIP  {label}: {reason}")
        return lines

    def _property_lines(self, prop: str, verbose: bool) -> list[str]:
        """One property's status line, then its failures (its skips; every result when verbose)."""
        rs = self.results_for(prop)
        if not rs:
            return []
        width = max(len(p) for p in PROPERTIES)
        status = self.status_of(prop)
        if status == FAIL:
            shown = [r for r in rs if r.status == FAIL]
        elif status == SKIP or verbose:
            shown = [r for r in rs if r.status == status or verbose]
        else:
            shown = []
        n = sum(r.status == status for r in rs)
        lines = [f"  {status.upper():4}  {prop:{width}}  ({n} of {len(rs)} cases)"]
        seen: set[str] = set()
        for r in shown:
            text = f"{r.case}: {r.message}" if r.status == FAIL or verbose else r.message
            if text in seen:
                continue
            seen.add(text)
            lines.append(f"        {prop}: {text}")
        return lines

    def __str__(self) -> str:
        return self.format()
