"""Collects one case's results: each property's status once recorded, and the messages for the report."""

from __future__ import annotations

from collections.abc import Iterable

from mla_prefill_ext.testing.formatting import fmt
from mla_prefill_ext.testing.properties import FAIL, PASS, PROPERTIES, SKIP
from mla_prefill_ext.testing.report import CheckResult


class CaseRecorder:
    """The results of one case, in the order they were recorded, and the status of each property."""

    def __init__(self, case_label: str) -> None:
        self.case_label = case_label
        self.results: list[CheckResult] = []
        self.status: dict[str, str] = {}

    def add(
        self,
        prop: str,
        status: str,
        message: str = "",
        measured: float | None = None,
        tolerance: float | None = None,
    ) -> None:
        assert prop in PROPERTIES, prop
        self.status[prop] = status
        self.results.append(CheckResult(prop, self.case_label, status, message, measured, tolerance))

    def measured(self, prop: str, what: str, err: float, tol: float, extra: str = "") -> bool:
        """Pass if ``err <= tol``; the message gives both (and ``extra``). True if it passed."""
        ok = err <= tol
        msg = f"{what} = {fmt(err)} (tolerance {fmt(tol)})" + (f"; {extra}" if extra else "")
        self.add(prop, PASS if ok else FAIL, msg, err, tol)
        return ok

    def blocked(self, prop: str, by: Iterable[str]) -> bool:
        """Record ``prop`` as not evaluated when a property it needs failed; True if so."""
        failed = [b for b in by if self.status.get(b) == FAIL]
        if failed:
            self.add(prop, SKIP, f"not evaluated: {', '.join(failed)} failed")
        return bool(failed)

    def skip_rest(self, reason: str) -> None:
        """Every property not recorded yet, as skipped for ``reason``."""
        for prop in PROPERTIES:
            if prop not in self.status:
                self.add(prop, SKIP, reason)

    def fail_unrecorded(self, props: Iterable[str], message: str) -> None:
        """Each of ``props`` not recorded yet, as failed with ``message``."""
        for prop in props:
            if prop not in self.status:
                self.add(prop, FAIL, message)

    def passed(self, prop: str) -> bool:
        return self.status.get(prop) == PASS

    def failed(self, prop: str) -> bool:
        return self.status.get(prop) == FAIL
