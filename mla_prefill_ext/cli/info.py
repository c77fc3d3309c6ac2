"""``info``, the doctor: checks the installation and fills one report with every finding."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from mla_prefill_ext.cli import registrations, runtime
from mla_prefill_ext.cli.common import (
    AUTOMATIC,
    EXIT_OK,
    EXIT_PROBLEM,
    CannotCheck,
    Finding,
    Host,
    Report,
    cap_json,
    chosen_automatically,
    header,
    install_hint,
    probe_host,
    supported_range,
)


@dataclass
class ChoiceReport:
    """The user's backend choice, where it came from, and whether it can serve here."""

    info: dict[str, Any]  # as JSON gives it
    findings: list[Finding]

    def text_lines(self) -> list[str]:
        from mla_prefill_ext.settings import BACKEND_ENV

        info = self.info
        if chosen_automatically(info["source"]):
            lines = [f"backend choice: automatic ({BACKEND_ENV} is unset or 'auto')"]
        else:
            lines = [f"backend choice: {info['requested']} (from {info['source']})"]
        if info.get("vllm_decides") and info.get("disabled"):  # the add-on is off: nothing of it decides
            lines.append(
                "  the add-on is off: vLLM's attention_config.mla_prefill_backend, or else vLLM's own "
                "automatic selection, decides as in stock vLLM (no claims, no TORCH_SDPA fallback); "
                "`select` shows what the add-on would do if it were on"
            )
            return lines
        if info.get("vllm_decides"):  # vLLM 0.23+ with no add-on choice: the bridge reports vLLM's pick
            lines.append(
                "  vLLM's attention_config.mla_prefill_backend, or else vLLM's own automatic selection "
                "(with the add-on's claims and TORCH_SDPA fallback), decides; `select` shows the "
                "add-on's view"
            )
            return lines
        lines.append(
            "  an engine's additional_config['mla_prefill_backend'] (or vLLM's legacy prefill flags) "
            "would come first; `select` shows any configuration"
        )
        cap = info["capability"]
        device = "no GPU" if cap is None else f"compute capability {cap}"
        here = f"here ({device}), for a bfloat16 model with DeepSeek-R1 MLA dims"
        if info["selected_here"] is None:
            lines.append(f"  {here}: it cannot serve (see the findings)")
        else:
            joined = " (it joined automatic selection by its claim)" if info["selected_by_claim"] else ""
            lines.append(f"  {here}: {info['selected_here']} would serve{joined}")
        return lines


def choice_report(disabled: bool, bridged: bool = False) -> ChoiceReport:
    """The user's choice, where it came from, and whether it can serve on this machine.

    ``bridged`` (vLLM 0.23+): with no choice, vLLM's own automatic selection decides (the
    bridge's report shows its pick), not the add-on's.
    """
    import torch

    from mla_prefill_ext.backends.base import R1_MLA_DIMS
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, lookup
    from mla_prefill_ext.selector import (
        MLAPrefillSelectorConfig,
        current_device_capability,
        requested_choice,
        select,
    )
    from mla_prefill_ext.settings import overrides_problem

    cap = current_device_capability()
    config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *R1_MLA_DIMS)
    choice = requested_choice(None)
    findings: list[Finding] = []
    info: dict[str, Any] = {
        "requested": "AUTO" if choice is None else choice.name,
        "source": AUTOMATIC if choice is None else choice.source,
        "capability": cap_json(cap),
        "selected_here": None,
        "selected_by_claim": False,
        "error": None,
    }
    if bridged and choice is None:
        info["vllm_decides"], info["disabled"] = True, disabled
        return ChoiceReport(info, findings)
    try:
        if choice is not None:
            try:
                lookup(choice.name)
            except ValueError:
                names = ", ".join(MLAPrefillBackendEnum.__members__)
                raise ValueError(
                    f"{choice.source} is set to {choice.name!r}, which is not a backend name; "
                    f"the names are {names} (any case), or auto"
                ) from None
        selection = select(cap, config, choice)
    except (TypeError, ValueError) as e:  # TypeError: a backend's malformed auto_select_claim
        info["error"] = str(e)
        message = str(e) if isinstance(e, ValueError) else f"Automatic selection fails: {e}"
        if message != overrides_problem():  # that refusal is the registrations' finding, said once
            findings.append(Finding("problem", message if message.endswith(".") else f"{message}."))
    else:
        info["selected_here"] = selection.name
        info["selected_by_claim"] = (
            chosen_automatically(selection.source) and MLAPrefillBackendEnum[selection.name].value is None
        )
    if disabled and choice is not None:
        findings.append(
            Finding("problem", f"{choice.source} has no effect: the add-on is disabled, so vLLM runs stock.")
        )
    return ChoiceReport(info, findings)


def _need_label(need: dict[str, Any]) -> str:
    if need["problem"] is None:
        return "ok     "
    return "-      " if need["unused"] else "PROBLEM"


@dataclass
class InfoReport(Report):
    """Everything ``info`` found, rendered once as text or as JSON."""

    host: Host
    version_reason: str | None  # why this vLLM is not supported (None: it is)
    disabled: bool
    active: bool
    patched: bool
    skipped_reason: str | None
    mla_module: str
    targets: list[Any]  # the patch host's target statuses (hosts.core.report.HostReport)
    platform: dict[str, Any]
    choice: ChoiceReport
    backends: list[dict[str, Any]]
    entry_points: list[dict[str, Any]]
    competing_claims: list[dict[str, Any]]  # backends whose claims put them at one place here
    environment: dict[str, str | None]
    findings: list[Finding] = field(default_factory=list)
    mode: str = "patch"  # mla_prefill_ext.versions: patch, bridge or none
    bridge: dict[str, Any] | None = None  # vLLM 0.23+: what the bridge found (bridge.report)
    bridge_lines: list[str] = field(default_factory=list)
    shared_prefix: dict[str, Any] = field(default_factory=dict)  # hosts.shared_prefix_report

    @property
    def bridged(self) -> bool:
        return self.mode == "bridge"

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "problem"]

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        return EXIT_PROBLEM if self.problems else EXIT_OK

    def verdict(self) -> str:
        from mla_prefill_ext.settings import BACKEND_ENV

        problems = self.problems
        if problems:
            return f"{len(problems)} problem{'s' if len(problems) > 1 else ''} found (see the findings)."
        if self.disabled:
            return "ok: the add-on is disabled, as set; vLLM runs its stock MLA prefill."
        sp = self.shared_prefix
        path = "" if not sp or sp["on"] else "; the shared-prefix path is off (see its line)"
        if self.bridged:
            return f"ok: the add-on is active and bridged into vLLM's own MLA prefill selection{path}."
        if self.platform["served"] is False:
            return (
                "ok: the add-on is active and vLLM's MLA layer is patched; on this platform vLLM's own "
                f"MLA prefill stays unless a backend is chosen explicitly ({BACKEND_ENV}){path}."
            )
        return f"ok: the add-on is active and vLLM's MLA layer is patched{path}."

    def to_json(self) -> dict[str, Any]:
        import platform

        import mla_prefill_ext

        return {
            "package_version": mla_prefill_ext.__version__,
            "python_version": platform.python_version(),
            "vllm_version": self.host.vllm_version,
            "vllm_supported": self.version_reason is None,
            "mode": self.mode,
            "bridge": self.bridge,
            "supported_range": supported_range(),
            "torch_version": self.host.torch_version,
            "disabled_by_env": self.disabled,
            "active": self.active,
            "patched": self.patched,
            "skipped_reason": self.skipped_reason,
            "platform": self.platform,
            "targets": [
                {"target": t.path, "role": "wraps" if t.wrapped else "reads", "problem": t.problem}
                for t in self.targets
            ],
            "choice": self.choice.info,
            "backends": self.backends,
            "backend_packages": self.entry_points,
            "competing_claims": self.competing_claims,
            "shared_prefix": self.shared_prefix,
            "environment": self.environment,
            "findings": [f._asdict() for f in self.findings],
            "verdict": "problem" if self.problems else "ok",
            "exit_code": self.exit_code,
        }

    def _addon_line(self) -> str:
        from mla_prefill_ext.settings import DISABLE_ENV

        if self.disabled:
            state = f"disabled by {DISABLE_ENV}; vLLM runs its stock MLA prefill"
        elif self.patched and self.bridged:
            state = "active; its backends are bridged into vLLM's own MLA prefill registry and selector"
        elif self.patched:
            state = "active; vLLM's MLA layer is patched"
        elif self.active:
            state = "active, but vLLM's MLA layer is not patched (see the findings)"
        else:
            state = "not active (see the findings)"
        return f"add-on: {state}"

    def _shared_prefix_lines(self) -> list[str]:
        sp = self.shared_prefix
        if not sp:
            return []
        lines = [f"shared-prefix path: {'on' if sp['on'] else 'off'}: {sp['reason']}"]
        if sp.get("needs"):
            lines.append("  what it reads of this vLLM (part, runner: module.attribute: what is checked):")
            lines += [
                f"    {_need_label(n)}  {n['part']}, {n['runner']}: "
                f"{n['module']}.{n['attribute']}: {n['what']}"
                + (f": {n['problem']}" if n["problem"] else "")
                + (f" ({n['unused']})" if n["unused"] else "")
                for n in sp["needs"]
            ]
        return lines

    def text_lines(self) -> list[str]:
        vllm_state = "supported" if self.version_reason is None else "NOT supported"
        return [
            header(),
            f"vLLM {self.host.vllm_version}: {vllm_state}, mode: {self.mode} "
            f"(supported: {supported_range()})",
            f"PyTorch {self.host.torch_version}",
            self._addon_line(),
            runtime.platform_line(self.platform, self.patched and not self.disabled, self.disabled),
            *self.bridge_lines,
            *self._shared_prefix_lines(),
            *(
                []
                if self.bridged
                else [f"patch targets in {self.mla_module} (the add-on wraps or reads each):"]
            ),
            *(
                f"  {'ok     ' if t.ok else 'PROBLEM'}  {'wraps' if t.wrapped else 'reads'}  {t.path}"
                + (f": {t.problem}" if t.problem else "")
                for t in self.targets
            ),
            *self.choice.text_lines(),
            "backends:",
            *(registrations.backend_line(b) for b in self.backends),
            *(registrations.entry_point_line(e) for e in self.entry_points if e["problem"]),
            "environment:",
            *(f"  {k}={v if v is not None else '(unset)'}" for k, v in self.environment.items()),
            "findings:" if self.findings else "findings: none",
            *(f"  {'PROBLEM' if f.level == 'problem' else 'note   '}  {f.message}" for f in self.findings),
            f"verdict: {self.verdict()}",
        ]


def cmd_info(args: argparse.Namespace) -> Report:
    host = probe_host()
    if host.problems:
        return CannotCheck("info", host)

    import mla_prefill_ext
    from mla_prefill_ext import activation, hosts, versions
    from mla_prefill_ext.mla_layers import MLA_MODULE
    from mla_prefill_ext.selector import current_device_capability
    from mla_prefill_ext.settings import BACKEND_ENV, DISABLE_ENV, OVERRIDES_ENV, SHARED_PREFIX_ENV

    findings: list[Finding] = []
    mode = versions.decide(host.vllm_version)
    bridged = mode.mode == versions.BRIDGE
    version_reason = None if bridged else versions.unsupported_reason(versions.PATCH, host.vllm_version)
    if mode.mode == versions.NONE:
        version_reason = mode.reason
    if mode.warning is not None:
        findings.append(Finding("note", mode.warning))
    if version_reason is not None:
        findings.append(
            Finding(
                "problem",
                f"{version_reason}: the add-on patches nothing here and vLLM runs its stock MLA "
                f"prefill; {install_hint()}.",
            )
        )
    disabled = activation.is_disabled()
    if disabled:
        findings.append(
            Finding(
                "note",
                f"{DISABLE_ENV} is set: the add-on is off in every process and vLLM runs "
                "its stock MLA prefill.",
            )
        )

    # What vLLM's plugin loader does in each of its processes, then the patch lands
    # (post-import hook) when the MLA module is imported. A refusal is a finding.
    refusals: list[str] = []
    try:
        mla_prefill_ext.activate()
    except RuntimeError as e:
        refusals.append(str(e))
    mla_module = None
    try:
        mla_module = importlib.import_module(MLA_MODULE)
    except RuntimeError as e:
        refusals.append(str(e))
        mla_module = sys.modules.get(MLA_MODULE)
    except Exception as e:
        findings.append(Finding("problem", f"vLLM's MLA module {MLA_MODULE} cannot be imported ({e})."))
    findings += [Finding("problem", r if r.endswith(".") else f"{r}.") for r in dict.fromkeys(refusals)]

    # What the host in force (the patch on 0.20, the bridge on 0.23+) reports about itself.
    st = hosts.host_report(mode.mode, mla_module)
    targets, patched = st.targets, st.instrumented
    host_lines = st.lines
    if not disabled:
        findings += [Finding("problem", p) for p in st.problems]
    elif bridged and not patched:  # off, as set: not a finding to look for
        host_lines = [
            f"bridge: not in place ({DISABLE_ENV} is set): vLLM's own MLA prefill registry and "
            "selection run untouched"
        ]
    if not disabled and not patched and version_reason is None and not refusals and mla_module is not None:
        findings.append(
            Finding(
                "problem",
                f"vLLM's MLA layer is not patched ({st.skipped_reason or 'the add-on is not active'}).",
            )
        )

    platform_info, platform_findings = runtime.platform_report()
    findings += platform_findings
    choice = choice_report(disabled, bridged)
    findings += choice.findings
    findings += registrations.overrides_findings(os.environ.get(OVERRIDES_ENV))
    entry_points, entry_point_findings = registrations.entry_point_rows()
    findings += entry_point_findings
    backends, backend_findings = registrations.backend_rows()
    findings += backend_findings
    competing = registrations.competing_claims(current_device_capability())
    sources = {b["name"]: b["kind"] for b in backends}
    findings += [
        Finding("note", registrations.competing_claims_text(group, sources, "on this device"))
        for group in competing
    ]
    findings += runtime.bytecode_findings()
    shared_prefix = hosts.shared_prefix_report(disabled)
    if shared_prefix["problem"] and not any(shared_prefix["reason"] in r for r in refusals):
        findings.append(Finding("problem", f"{shared_prefix['reason']}."))

    return InfoReport(
        host=host,
        version_reason=version_reason,
        disabled=disabled,
        active=activation.is_active(),
        patched=patched,
        skipped_reason=st.skipped_reason,
        mla_module=MLA_MODULE,
        targets=targets,
        platform=platform_info,
        choice=choice,
        backends=backends,
        entry_points=entry_points,
        competing_claims=competing,
        environment={
            name: os.environ.get(name)
            for name in (BACKEND_ENV, OVERRIDES_ENV, DISABLE_ENV, SHARED_PREFIX_ENV)
        },
        findings=findings,
        mode=mode.mode,
        bridge=st.info,
        bridge_lines=host_lines,
        shared_prefix=shared_prefix,
    )
