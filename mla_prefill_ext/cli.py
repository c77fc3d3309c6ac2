"""Diagnostics: ``mla-prefill-ext info | select | check`` (also ``python -m mla_prefill_ext``).

``info`` checks the installation (and says whether the add-on serves MLA prefill on
this platform, and which backends claim a place in automatic selection), ``select``
shows which backend would serve and the automatic order it used, ``check`` runs one
prefill against a float64 reference, or with ``--conformance`` the conformance suite.

Every command answers with a report, never with a traceback: a missing vLLM or
PyTorch, a vLLM version the add-on does not support, a bad setting or a backend
that fails are findings. Exit codes a script can use: 0 all is well, 1 a problem
was found, 2 the check could not run (vLLM or PyTorch missing, or a bad flag,
which also prints the usage line).

This module imports neither vLLM nor PyTorch at import time or while it parses
the command line: each command checks that they import before it uses them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, NamedTuple

EXIT_OK, EXIT_PROBLEM, EXIT_CANNOT_CHECK = 0, 1, 2
EXIT_FAIL = EXIT_PROBLEM  # older name

PROG = "mla-prefill-ext"
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_CHECK_REPEAT = 5
DEFAULT_CHECK_DTYPE = "bfloat16"  # check's dtype; check --conformance runs every dtype in DTYPES


# Command-line values, checked while parsing (argparse prints the usage line and exits 2)


def _capability_arg(text: str) -> tuple[int, int] | str:
    """``MAJOR.MINOR`` of a CUDA compute capability, or ``cpu``."""
    value = text.strip().lower()
    if value in ("cpu", "none"):
        return "cpu"
    match = re.fullmatch(r"(\d+)\.(\d)", value)
    if match is None or not 1 <= int(match.group(1)) <= 20:
        raise argparse.ArgumentTypeError(
            "expected a CUDA compute capability MAJOR.MINOR with MAJOR from 1 to 20 "
            f"(e.g. 8.0, 9.0, 10.0, 12.0) or 'cpu', got {text!r}"
        )
    return int(match.group(1)), int(match.group(2))


def _dims_arg(text: str) -> tuple[int, int, int] | str:
    """``r1`` or ``NOPE,ROPE,V`` head dims, each a positive integer."""
    if text.strip().lower() == "r1":
        return "r1"
    try:
        dims = tuple(int(p) for p in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected 'r1' or three positive head dims NOPE,ROPE,V (e.g. 128,64,128), got {text!r}"
        )
    return dims  # type: ignore[return-value]


def _whole_number(low: int, high: int | None, what: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _whole_number(1, None, "a whole number of at least 1")
_seed_arg = _whole_number(0, 2**63 - 1, "a whole number from 0 to 2**63 - 1")


# vLLM and PyTorch: present and importable?


def _supported_range() -> str:
    from mla_prefill_ext.patches.version import SUPPORTED_VLLM

    return f"vllm{SUPPORTED_VLLM}"


def _install_hint() -> str:
    spec = _supported_range()
    return f"install a supported vLLM, which brings PyTorch: pip install '{spec}'"


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (None: it imports)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install (e.g. OSError from a shared library)
        return f"{type(e).__name__}: {e}"
    return None


class Host(NamedTuple):
    """What the add-on runs on: versions, and why vLLM or PyTorch cannot be used."""

    vllm_version: str | None
    torch_version: str | None
    problems: list[str]  # non-empty: nothing can be checked


def _probe_host(import_vllm: bool = True) -> Host:
    """Versions of vLLM and PyTorch, and whether they import (vLLM only when asked: ~5 s)."""
    from mla_prefill_ext.patches.version import installed_vllm_version

    vllm_version = installed_vllm_version()
    torch_version = _dist_version("torch")
    problems = []
    torch_error = _import_error("torch")
    if torch_error is None:
        import torch

        torch_version = torch.__version__
    elif torch_version is None:
        problems.append(f"PyTorch is not installed ({torch_error}).")
    else:
        problems.append(f"PyTorch {torch_version} is installed but cannot be imported ({torch_error}).")
    if vllm_version is None:
        problems.append(f"vLLM is not installed: this add-on needs {_supported_range()}.")
    elif import_vllm and torch_error is None:
        vllm_error = _import_error("vllm")
        if vllm_error is not None:
            problems.append(f"vLLM {vllm_version} is installed but cannot be imported ({vllm_error}).")
    return Host(vllm_version, torch_version, problems)


def _cannot_check(args: argparse.Namespace, host: Host) -> int:
    """Report that the command cannot run here, and why; exit code 2."""
    verdict = f"cannot check: {_install_hint()}, then run `{PROG} info` again."
    payload = {
        "ok": False,
        "vllm_version": host.vllm_version,
        "torch_version": host.torch_version,
        "supported_range": _supported_range(),
        "findings": [{"level": "problem", "message": p} for p in host.problems],
        "verdict": "cannot check",
        "exit_code": EXIT_CANNOT_CHECK,
    }
    lines = [f"{PROG} {args.command} cannot run here:", *(f"  {p}" for p in host.problems)]
    lines.append(f"verdict: {verdict}")
    _emit(args, payload, lines)
    return EXIT_CANNOT_CHECK


def _note_unsupported(host: Host) -> None:
    """select and check still run on an unsupported vLLM (vLLM's own code is not used): say so."""
    from mla_prefill_ext.patches.version import unsupported_reason

    reason = unsupported_reason(host.vllm_version)
    if reason is not None:
        print(f"note: {reason}; the add-on would not patch it. `{PROG} info` says more.", file=sys.stderr)


def _emit(args: argparse.Namespace, payload: dict[str, Any], lines: list[str]) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        print("\n".join(lines))


def _cap_str(cap: Any) -> str:
    return "none (no GPU)" if cap is None else f"{cap.major}.{cap.minor}"


def _capability(value: tuple[int, int] | str | None) -> Any:
    """The DeviceCapability for a parsed ``--capability`` (None: no GPU)."""
    from vllm.platforms.interface import DeviceCapability

    from mla_prefill_ext.selector import current_device_capability

    if value is None:
        return current_device_capability()
    if value == "cpu":
        return None
    return DeviceCapability(*value)


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _dims(value: tuple[int, int, int] | str) -> tuple[int, int, int]:
    from mla_prefill_ext.backends.base import R1_MLA_DIMS

    return R1_MLA_DIMS if value == "r1" else value  # type: ignore[return-value]


def _backend_choice(args: argparse.Namespace) -> Any:
    """The choice in force: ``--backend`` (an unknown name is a usage error), else the environment."""
    from mla_prefill_ext.registry import lookup
    from mla_prefill_ext.selector import Choice, requested_choice

    if not args.backend:
        return requested_choice(None)
    try:
        lookup(args.backend)
    except ValueError as e:
        args.parser.error(f"argument --backend: {e}.")
    return Choice(args.backend, "--backend", True)


# info: the doctor


class Finding(NamedTuple):
    level: str  # "problem" or "note"
    message: str


def _overrides_findings(raw: str | None) -> list[Finding]:
    """What is wrong with the registrations handed over in the environment."""
    from mla_prefill_ext.registry import OVERRIDES_ENV, MLAPrefillBackendEnum

    if not raw:
        return []
    example = '\'{"CUSTOM": "my_package.my_module.MyBackend"}\''
    try:
        payload = json.loads(raw)
    except ValueError as e:
        return [
            Finding(
                "problem",
                f"{OVERRIDES_ENV} is not valid JSON ({e}), so none of its registrations is in force. "
                f"It takes a JSON object of backend names and class paths, e.g. {example}.",
            )
        ]
    if not isinstance(payload, dict):
        return [
            Finding(
                "problem",
                f"{OVERRIDES_ENV} is a JSON {type(payload).__name__}, not an object of backend names "
                f"and class paths (e.g. {example}), so it is ignored.",
            )
        ]
    findings = []
    for name, path in payload.items():
        if not isinstance(path, str):
            findings.append(
                Finding(
                    "problem",
                    f"{OVERRIDES_ENV} entry {name!r} is ignored: its class path must be a string, "
                    f"not {path!r}.",
                )
            )
        elif name not in MLAPrefillBackendEnum.__members__:
            findings.append(
                Finding(
                    "problem",
                    f"{OVERRIDES_ENV} entry {name!r} is ignored: it is not a usable backend name "
                    "(use an identifier such as MY_PREFILL, not a reserved name).",
                )
            )
    return findings


def _entry_point_rows() -> tuple[list[dict[str, Any]], list[Finding]]:
    """Installed backend packages (entry points): registered, or why not."""
    from mla_prefill_ext.discovery import ENTRY_POINT_GROUP, discover

    rows, findings = [], []
    for ep in discover():
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


def _claim_text(claim: dict[str, Any]) -> str:
    """``claim: 9.x, cpu; before FLASH_ATTN`` (as select and info show it)."""
    return f"claim: {', '.join(claim['capabilities'])}; before {claim['before']}"


def _backend_rows() -> tuple[list[dict[str, Any]], list[Finding]]:
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


def _choice_report(disabled: bool) -> tuple[dict[str, Any], list[str], list[Finding]]:
    """The user's choice, where it came from, and whether it can serve on this machine."""
    import torch

    from mla_prefill_ext.backends.base import R1_MLA_DIMS
    from mla_prefill_ext.registry import MLAPrefillBackendEnum, lookup
    from mla_prefill_ext.selector import (
        BACKEND_ENV,
        MLAPrefillSelectorConfig,
        current_device_capability,
        requested_choice,
        select,
    )

    cap = current_device_capability()
    config = MLAPrefillSelectorConfig.from_dims(torch.bfloat16, *R1_MLA_DIMS)
    device = "no GPU" if cap is None else f"compute capability {cap.major}.{cap.minor}"
    here = f"here ({device}), for a bfloat16 model with DeepSeek-R1 MLA dims"
    choice = requested_choice(None)
    findings: list[Finding] = []
    info: dict[str, Any] = {
        "requested": "AUTO" if choice is None else choice.name,
        "source": "automatic" if choice is None else choice.source,
        "capability": None if cap is None else f"{cap.major}.{cap.minor}",
        "selected_here": None,
        "selected_by_claim": False,
        "error": None,
    }
    lines = []
    if choice is None:
        lines.append(f"backend choice: automatic ({BACKEND_ENV} is unset or 'auto')")
    else:
        lines.append(f"backend choice: {choice.name} (from {choice.source})")
    lines.append(
        "  an engine's additional_config['mla_prefill_backend'] (or vLLM's legacy prefill flags) "
        "would come first; `select` shows any configuration"
    )
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
        findings.append(Finding("problem", message if message.endswith(".") else f"{message}."))
        lines.append(f"  {here}: it cannot serve (see the findings)")
    else:
        info["selected_here"] = selection.name
        by_claim = selection.source == "automatic" and MLAPrefillBackendEnum[selection.name].value is None
        info["selected_by_claim"] = by_claim
        joined = " (it joined automatic selection by its claim)" if by_claim else ""
        lines.append(f"  {here}: {selection.name} would serve{joined}")
    if disabled and choice is not None:
        findings.append(
            Finding("problem", f"{choice.source} has no effect: the add-on is disabled, so vLLM runs stock.")
        )
    return info, lines, findings


# vLLM's platform predicates, in order, and the name info shows for each.
_PLATFORMS = (
    ("is_cuda", "CUDA"),
    ("is_rocm", "ROCm"),
    ("is_xpu", "XPU"),
    ("is_tpu", "TPU"),
    ("is_cpu", "CPU"),
    ("is_unspecified", "none"),
)


def _bytecode_findings(
    packages: dict[str, str] | None = None, can_write: bool | None = None
) -> list[Finding]:
    """A note when the add-on's or wrapt's modules must be compiled from source in every process.

    That happens where packages were installed without bytecode (``pip install --no-compile``)
    and Python may not write it (``PYTHONDONTWRITEBYTECODE``, common in container images).
    Measured on an H200 host: the add-on costs 11 ms of a vLLM process's start-up with
    bytecode, 18 ms with its own modules compiled from source each time, and 39 ms with
    wrapt's too (docs/benchmarks.md).
    """
    from importlib.util import cache_from_source
    from pathlib import Path

    if packages is None:
        import wrapt

        packages = {"mla_prefill_ext": os.path.dirname(__file__), "wrapt": os.path.dirname(wrapt.__file__)}
    if can_write is None:
        can_write = not sys.dont_write_bytecode
    if can_write:
        return []  # the first process that imports a module writes its bytecode
    missing = [
        name
        for name, folder in packages.items()
        if any(not Path(cache_from_source(str(f))).exists() for f in Path(folder).rglob("*.py"))
    ]
    if not missing:
        return []
    folders = " ".join(packages[name] for name in missing)
    return [
        Finding(
            "note",
            f"{' and '.join(missing)} have modules without bytecode and this Python may not write it "
            "(PYTHONDONTWRITEBYTECODE): every vLLM process compiles them from source, which adds "
            f"milliseconds to each start-up. Compile them once: {sys.executable} -m compileall -q {folders}",
        )
    ]


def _platform_report() -> tuple[dict[str, Any], list[Finding]]:
    """vLLM's platform in this process, and whether the add-on takes over MLA prefill there."""
    from mla_prefill_ext.patches.scope import platform_reason

    try:
        from vllm.platforms import current_platform

        name = type(current_platform).__name__
        for predicate, label in _PLATFORMS:
            test = getattr(current_platform, predicate, None)
            if callable(test) and test():
                name = label
                break
        reason = platform_reason()
    except Exception as e:  # vLLM cannot tell its platform: nothing it starts would run
        error = _describe_exception(e)
        info = {"name": None, "vllm_platform": None, "served": None, "reason": None, "error": error}
        return info, [Finding("problem", f"vLLM cannot determine its platform here ({error}).")]
    info = {
        "name": name,
        "vllm_platform": type(current_platform).__name__,
        "served": reason is None,
        "reason": reason,
        "error": None,
    }
    return info, []


def _platform_line(info: dict[str, Any], addon_serves: bool, disabled: bool) -> str:
    """The ``platform:`` line of ``info`` (``addon_serves``: active and vLLM's layer patched)."""
    from mla_prefill_ext.settings import BACKEND_ENV

    if info["error"] is not None:
        return "platform: unknown (see the findings)"
    name = info["name"]
    if name == "none":
        name = "none (vLLM detected no GPU platform)"
    if not info["served"]:
        return (
            f"platform: {name}: vLLM's own MLA prefill stays ({info['reason']}); an explicit "
            f"{BACKEND_ENV} is honoured if a backend can serve it"
        )
    if addon_serves:
        return f"platform: {name}: the add-on serves MLA prefill here"
    why = "it is disabled" if disabled else "it is not active: see the add-on line"
    return f"platform: {name}: the add-on would serve MLA prefill here ({why})"


def cmd_info(args: argparse.Namespace) -> int:
    import mla_prefill_ext

    host = _probe_host()
    header = f"{PROG} {mla_prefill_ext.__version__} (Python {platform.python_version()})"
    base = {
        "package_version": mla_prefill_ext.__version__,
        "python_version": platform.python_version(),
    }
    if host.problems:
        from mla_prefill_ext.patches.version import unsupported_reason

        vllm = "not installed" if host.vllm_version is None else host.vllm_version
        supported = host.vllm_version is not None and unsupported_reason(host.vllm_version) is None
        base["vllm_supported"] = supported
        payload = {**base, "vllm_version": host.vllm_version}
        lines = [
            header,
            f"vLLM: {vllm} (the add-on supports {_supported_range()})",
            f"PyTorch: {host.torch_version or 'not installed'}",
            "findings:",
            *(f"  PROBLEM  {p}" for p in host.problems),
            f"verdict: cannot check: {_install_hint()}, then run `{PROG} info` again.",
        ]
        payload.update(
            {
                "torch_version": host.torch_version,
                "supported_range": _supported_range(),
                "findings": [{"level": "problem", "message": p} for p in host.problems],
                "verdict": "cannot check",
                "exit_code": EXIT_CANNOT_CHECK,
            }
        )
        _emit(args, payload, lines)
        return EXIT_CANNOT_CHECK

    from mla_prefill_ext import activation, patches
    from mla_prefill_ext.patches.targets import inspect_targets
    from mla_prefill_ext.patches.version import unsupported_reason
    from mla_prefill_ext.registry import OVERRIDES_ENV
    from mla_prefill_ext.selector import BACKEND_ENV

    findings: list[Finding] = []
    version_reason = unsupported_reason(host.vllm_version)
    if version_reason is not None:
        findings.append(
            Finding(
                "problem",
                f"{version_reason}: the add-on patches nothing here and vLLM runs its stock MLA "
                f"prefill; {_install_hint()}.",
            )
        )
    disabled = activation.is_disabled()
    if disabled:
        findings.append(
            Finding(
                "note",
                f"{activation.DISABLE_ENV} is set: the add-on is off in every process and vLLM runs "
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
        mla_module = importlib.import_module(patches.MLA_MODULE)
    except RuntimeError as e:
        refusals.append(str(e))
        mla_module = sys.modules.get(patches.MLA_MODULE)
    except Exception as e:
        findings.append(
            Finding("problem", f"vLLM's MLA module {patches.MLA_MODULE} cannot be imported ({e}).")
        )
    findings += [Finding("problem", r if r.endswith(".") else f"{r}.") for r in dict.fromkeys(refusals)]

    st = patches.state()
    targets = st.targets or (inspect_targets(mla_module) if mla_module is not None else [])
    active = activation.is_active()
    patched = st.instrumented
    if not disabled and not patched and version_reason is None and not refusals and mla_module is not None:
        findings.append(
            Finding(
                "problem",
                f"vLLM's MLA layer is not patched ({st.skipped_reason or 'the add-on is not active'}).",
            )
        )
    if disabled:
        addon = f"disabled by {activation.DISABLE_ENV}; vLLM runs its stock MLA prefill"
    elif patched:
        addon = "active; vLLM's MLA layer is patched"
    elif active:
        addon = "active, but vLLM's MLA layer is not patched (see the findings)"
    else:
        addon = "not active (see the findings)"

    platform_info, platform_findings = _platform_report()
    findings += platform_findings
    choice, choice_lines, choice_findings = _choice_report(disabled)
    findings += choice_findings
    findings += _overrides_findings(os.environ.get(OVERRIDES_ENV))
    entry_points, entry_point_findings = _entry_point_rows()
    findings += entry_point_findings
    backends, backend_findings = _backend_rows()
    findings += backend_findings
    findings += _bytecode_findings()

    problems = [f for f in findings if f.level == "problem"]
    if problems:
        verdict = f"{len(problems)} problem{'s' if len(problems) > 1 else ''} found (see the findings)."
        code = EXIT_PROBLEM
    elif disabled:
        verdict = "ok: the add-on is disabled, as set; vLLM runs its stock MLA prefill."
        code = EXIT_OK
    elif platform_info["served"] is False:
        verdict = (
            "ok: the add-on is active and vLLM's MLA layer is patched; on this platform vLLM's own "
            f"MLA prefill stays unless a backend is chosen explicitly ({BACKEND_ENV})."
        )
        code = EXIT_OK
    else:
        verdict = "ok: the add-on is active and vLLM's MLA layer is patched."
        code = EXIT_OK

    environment = {
        name: os.environ.get(name) for name in (BACKEND_ENV, OVERRIDES_ENV, activation.DISABLE_ENV)
    }
    payload = {
        **base,
        "vllm_version": host.vllm_version,
        "vllm_supported": version_reason is None,
        "supported_range": _supported_range(),
        "torch_version": host.torch_version,
        "disabled_by_env": disabled,
        "active": active,
        "patched": patched,
        "skipped_reason": st.skipped_reason,
        "platform": platform_info,
        "targets": [
            {"target": t.path, "role": "wraps" if t.wrapped else "reads", "problem": t.problem}
            for t in targets
        ],
        "choice": choice,
        "backends": backends,
        "backend_packages": entry_points,
        "environment": environment,
        "findings": [f._asdict() for f in findings],
        "verdict": "problem" if problems else "ok",
        "exit_code": code,
    }
    vllm_state = "supported" if version_reason is None else "NOT supported"
    lines = [
        header,
        f"vLLM {host.vllm_version}: {vllm_state} (the add-on supports {_supported_range()})",
        f"PyTorch {host.torch_version}",
        f"add-on: {addon}",
        _platform_line(platform_info, patched and not disabled, disabled),
        f"patch targets in {patches.MLA_MODULE} (the add-on wraps or reads each):",
        *(
            f"  {'ok     ' if t.ok else 'PROBLEM'}  {'wraps' if t.wrapped else 'reads'}  {t.path}"
            + (f": {t.problem}" if t.problem else "")
            for t in targets
        ),
        *choice_lines,
        "backends:",
        *(_backend_line(b) for b in backends),
        *(
            f"  PROBLEM  entry point {e['name']} = '{e['value']}' (package {e['distribution'] or '?'}): "
            "not used (see the findings)"
            for e in entry_points
            if e["problem"]
        ),
        "environment:",
        *(f"  {k}={v if v is not None else '(unset)'}" for k, v in environment.items()),
        "findings:" if findings else "findings: none",
        *(f"  {'PROBLEM' if f.level == 'problem' else 'note   '}  {f.message}" for f in findings),
        f"verdict: {verdict}",
    ]
    _emit(args, payload, lines)
    return code


def _backend_line(b: dict[str, Any]) -> str:
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
    return f"  ok       {b['name']} ({kind}): {b['class_path']}; {_claim_text(claim)} ({where})"


# select


def cmd_select(args: argparse.Namespace) -> int:
    host = _probe_host()
    if host.problems:
        return _cannot_check(args, host)
    _note_unsupported(host)
    from mla_prefill_ext.registry import registered_backends
    from mla_prefill_ext.selector import (
        MLAPrefillSelectorConfig,
        builtin_priorities,
        check_backend,
        claims,
        mla_prefill_backend_priorities,
        select,
    )

    choice = _backend_choice(args)
    cap = _capability(args.capability)
    config = MLAPrefillSelectorConfig.from_dims(_dtype(args.dtype), *_dims(args.dims))
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
        chosen, source, error = None, (choice.source if choice else "automatic"), str(e)
    by_claim = chosen is not None and source == "automatic" and chosen in claimed
    payload = {
        "capability": None if cap is None else f"{cap.major}.{cap.minor}",
        "dtype": str(config.dtype).removeprefix("torch."),
        "r1_dims": config.is_r1_compatible,
        "automatic_order": order,
        "automatic_order_error": order_error,
        "builtin_order": [m.name for m in builtin_priorities(cap)],
        "claims": list(claimed.values()),
        "requested": choice.name if choice else "AUTO",
        "source": source,
        "selected": chosen,
        "selected_by_claim": by_claim,
        "error": error,
        "candidates": candidates,
    }
    if order is None:
        shown_order = f"cannot be made: {order_error}"
    else:
        shown_order = " > ".join(f"{n} ({_claim_text(claimed[n])})" if n in claimed else n for n in order)
    if chosen:
        selected = f"selected: {chosen}" + (
            " (it joined automatic selection by its claim)" if by_claim else ""
        )
    else:
        selected = f"selected: none\nerror: {error}"
    lines = [
        f"capability {_cap_str(cap)}, dtype {payload['dtype']}, DeepSeek-R1 MLA dims: "
        f"{'yes' if config.is_r1_compatible else 'no'}",
        f"automatic order: {shown_order}",
        f"requested: {payload['requested']} ({source})",
        selected,
        "candidates:",
        *(
            f"  {c['name']:<14} {'valid' if c['valid'] else 'invalid: ' + '; '.join(c['reasons'])}"
            for c in candidates
        ),
    ]
    _emit(args, payload, lines)
    return EXIT_OK if chosen else EXIT_PROBLEM


# check

# The embedded problem: DeepSeek-V2-Lite's MLA prefill (16 heads, qk 128+64, v 128,
# YaRN-scaled softmax scale), three requests, two with cached context in two chunks.
CHECK_NEW_TOKENS = [384, 256, 128]
CHECK_CONTEXT = [1024, 512, 0]
CHECK_CHUNKS = 2
CHECK_HEADS = 16


def _failure(args: argparse.Namespace, payload: dict[str, Any], message: str) -> int:
    _emit(args, {**payload, "ok": False, "error": message}, [f"FAIL: {message}"])
    return EXIT_PROBLEM


def _describe_exception(e: BaseException) -> str:
    """``Type: message (at file:line)`` of the innermost frame, for a one-line report."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def cmd_check(args: argparse.Namespace) -> int:
    host = _probe_host(import_vllm=False)
    if host.problems:
        return _cannot_check(args, host)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        args.parser.error(
            "argument --device: cuda was asked for, but PyTorch sees no CUDA GPU here "
            "(torch.cuda.is_available() is False); use --device cpu, or leave --device out."
        )
    host = _probe_host()
    if host.problems:
        return _cannot_check(args, host)
    _note_unsupported(host)
    if args.conformance:
        return _check_conformance(args, host)

    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability, select
    from mla_prefill_ext.testing.problem import deepseek_yarn_scale, make_problem, run_backend

    choice = _backend_choice(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(args.dtype or DEFAULT_CHECK_DTYPE)
    cap = current_device_capability() if device == "cuda" else None
    config = MLAPrefillSelectorConfig.from_dims(dtype, 128, 64, 128)
    base = {
        "device": device,
        "capability": None if cap is None else f"{cap.major}.{cap.minor}",
        "dtype": str(dtype).removeprefix("torch."),
    }
    try:
        selection = select(cap, config, choice)
    except (TypeError, ValueError) as e:  # TypeError: a backend's malformed auto_select_claim
        return _failure(args, base, str(e))
    base["backend"] = selection.name
    scale = deepseek_yarn_scale()
    try:
        problem = make_problem(
            CHECK_NEW_TOKENS,
            CHECK_CONTEXT,
            CHECK_CHUNKS,
            CHECK_HEADS,
            dtype=dtype,
            device=device,
            seed=args.seed,
        )
    except Exception as e:  # e.g. vLLM's prefill metadata shaped differently (an unsupported vLLM)
        message = f"the test problem cannot be built with vLLM {host.vllm_version}: {_describe_exception(e)}"
        _emit(args, {**base, "ok": False, "error": message}, [f"cannot check: {message}"])
        return EXIT_CANNOT_CHECK
    try:
        backend = selection.backend(CHECK_HEADS, scale, 512, 128, 64, 128, None)

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        out = run_backend(backend, problem)  # warm-up (and JIT, where a backend compiles)
        sync()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = run_backend(backend, problem)
            sync()
            times.append(time.perf_counter() - t0)
        ref = problem.reference(scale).to(out.device)
    except Exception as e:  # the backend under test failed: that is the finding
        return _failure(args, base, f"backend {selection.name} failed: {_describe_exception(e)}")
    err = (out.to(torch.float64) - ref).abs()
    ref_max = ref.abs().max().item()
    max_err = err.max().item()
    # Output rounding alone costs half an ulp of the largest value: 2^-9 relative
    # in bf16, 2^-12 in fp16; allow four times that (accumulation order).
    rel_tol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 1e-5)
    ok = bool(torch.isfinite(out).all()) and max_err <= rel_tol * ref_max
    median = statistics.median(times)
    payload = {
        **base,
        "ok": ok,
        "class": f"{selection.backend.__module__}.{selection.backend.__qualname__}",
        "source": selection.source,
        "problem": {
            "heads": CHECK_HEADS,
            "dims": [128, 64, 128],
            "scale": scale,
            "new_tokens": CHECK_NEW_TOKENS,
            "context_tokens": CHECK_CONTEXT,
            "context_chunks": CHECK_CHUNKS,
        },
        "max_abs_error": max_err,
        "mean_abs_error": err.mean().item(),
        "max_abs_reference": ref_max,
        "tolerance": rel_tol * ref_max,
        "time_ms_median": median * 1e3,
        "time_ms_all": [t * 1e3 for t in times],
        "tflops": problem.flops() / median / 1e12,
    }
    lines = [
        f"backend: {selection.name} ({payload['class']}, {selection.source})",
        f"device: {device}, capability {_cap_str(cap)}, dtype {payload['dtype']}",
        f"problem: DeepSeek-V2-Lite MLA prefill, {CHECK_HEADS} heads, qk 128+64, v 128, "
        f"scale {scale:.6f}; new tokens {CHECK_NEW_TOKENS}, context {CHECK_CONTEXT} "
        f"in {CHECK_CHUNKS} chunks",
        f"max |error| vs float64 reference: {max_err:.3e} (tolerance {rel_tol * ref_max:.3e}; "
        f"mean {payload['mean_abs_error']:.3e}; max |ref| {ref_max:.3f})",
        f"time: {median * 1e3:.2f} ms median of {args.repeat} ({payload['tflops']:.3f} TFLOP/s)",
        "PASS" if ok else "FAIL: the output is not within the tolerance of the float64 reference.",
    ]
    _emit(args, payload, lines)
    return EXIT_OK if ok else EXIT_PROBLEM


def _is_class_path(text: str) -> bool:
    """``pkg.module.Class`` or ``pkg.module:Class`` (a backend name is an identifier)."""
    return "." in text or ":" in text


def _check_conformance(args: argparse.Namespace, host: Host) -> int:
    """``check --conformance``: the conformance suite (mla_prefill_ext.testing) on one backend."""
    import torch

    from mla_prefill_ext.registry import load_backend_class, lookup
    from mla_prefill_ext.selector import MLAPrefillSelectorConfig, current_device_capability, select

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cap = current_device_capability() if device == "cuda" else None
    base: dict[str, Any] = {
        "mode": "conformance",
        "device": device,
        "capability": None if cap is None else f"{cap.major}.{cap.minor}",
        "dtypes": [args.dtype] if args.dtype else list(DTYPES),
        "seed": args.seed,
    }
    # The backend: --backend (a name, checked while parsing, or a class path), else the one the
    # selector picks here (MLA_PREFILL_BACKEND, else automatic) for a DeepSeek-R1 model.
    if args.backend and _is_class_path(args.backend):
        name, source, cls = args.backend, "--backend, a class path", None
    elif args.backend:
        name, source, cls = lookup(_backend_choice(args).name).name, "--backend", None
    else:
        config = MLAPrefillSelectorConfig.from_dims(_dtype(args.dtype or DEFAULT_CHECK_DTYPE), 128, 64, 128)
        try:
            selection = select(cap, config, _backend_choice(args))
        except (TypeError, ValueError) as e:  # TypeError: a backend's malformed auto_select_claim
            return _failure(args, base, str(e))
        name, source, cls = selection.name, selection.source, selection.backend
    base.update(backend=name, source=source)
    if cls is None:
        try:
            if _is_class_path(name):
                cls = load_backend_class(name.replace(":", "."), name)
            else:
                cls = lookup(name).get_class()
        except Exception as e:  # ImportError/TypeError/ValueError, or whatever the module raises
            error = str(e).rstrip(".")
            if not error.startswith(f"MLA prefill backend {name}"):
                error = f"MLA prefill backend {name} cannot be loaded: {error}"
            return _failure(args, base, error)

    from mla_prefill_ext.testing import run_conformance

    try:
        report = run_conformance(cls, device=device, dtype=args.dtype, seed=args.seed)
    except Exception as e:  # the suite itself failed (a bad backend is reported, never raised)
        message = f"the conformance suite cannot run with vLLM {host.vllm_version}: {_describe_exception(e)}"
        _emit(args, {**base, "ok": False, "error": message}, [f"cannot check: {message}"])
        return EXIT_CANNOT_CHECK
    payload = {**report.to_dict(), **base, "get_name": report.backend}
    where = "selected automatically here" if source == "automatic" else f"from {source}"
    named = "" if report.backend == name else f"; its get_name() is {report.backend}"
    lines = [f"backend under test: {name} ({where}{named})", report.format()]
    _emit(args, payload, lines)
    return EXIT_OK if report.ok else EXIT_PROBLEM


# The command line


def _version_line() -> str:
    import mla_prefill_ext

    return f"{PROG} {mla_prefill_ext.__version__} (an add-on for {_supported_range()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Diagnostics for the pluggable MLA prefill backends this add-on brings to vLLM 0.20.x.",
        epilog="Exit codes: 0 all is well, 1 a problem was found, 2 the check could not run "
        "(vLLM or PyTorch missing, or a bad flag).",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,select,check}")

    p = sub.add_parser(
        "info",
        help="check the installation: vLLM, the patch, the backend choice, the registrations",
        description="Check the installation: the vLLM version and whether the add-on supports it, "
        "the patch and each of its targets, the backend choice and whether it can serve on this "
        "machine, and every registered backend. Ends with a verdict line.",
        epilog="Exit codes: 0 no problem found, 1 a problem found, 2 cannot check (vLLM or PyTorch missing).",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "select",
        help="which backend would serve, and why each other would not",
        description="Which MLA prefill backend would serve a model on this machine (or on the "
        "given one), and why each other backend would not.",
        epilog="Exit codes: 0 a backend was selected, 1 none can serve, 2 cannot check.",
    )
    p.add_argument(
        "--capability",
        type=_capability_arg,
        metavar="MAJOR.MINOR|cpu",
        help="the GPU's compute capability, e.g. 9.0 (Hopper) or 10.0 (Blackwell), or 'cpu' "
        "(default: this machine's)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=DTYPES, help="the model's dtype (default: %(default)s)"
    )
    p.add_argument(
        "--dims",
        type=_dims_arg,
        default="r1",
        metavar="r1|NOPE,ROPE,V",
        help="the model's MLA head dims: 'r1' (DeepSeek-V2/V3/R1: 128,64,128) or "
        "qk_nope,qk_rope,v (default: r1)",
    )
    p.add_argument(
        "--backend",
        metavar="NAME",
        help="an explicit choice to validate, any case (default: MLA_PREFILL_BACKEND, else automatic)",
    )
    p.set_defaults(func=cmd_select)

    p = sub.add_parser(
        "check",
        help="run one MLA prefill through the selected backend against a float64 reference "
        "(or, with --conformance, the conformance suite)",
        description="Run one MLA prefill (new tokens plus two context chunks, DeepSeek-V2-Lite "
        "sized) through the selected backend and compare it with a float64 reference. With "
        "--conformance, run the conformance suite instead: every property a backend must hold, "
        "each checked on every dtype, MLA head dims and head count the backend can serve.",
        epilog="Exit codes: 0 pass, 1 fail, 2 cannot check.",
    )
    p.add_argument(
        "--backend",
        metavar="NAME",
        help="the backend to run, any case (default: MLA_PREFILL_BACKEND, else automatic); with "
        "--conformance also a class path, pkg.module.Class",
    )
    p.add_argument(
        "--conformance",
        action="store_true",
        help="run the conformance suite (mla_prefill_ext.testing.run_conformance) on the backend "
        "and report each property; --repeat does not apply",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where to run (default: cuda when PyTorch sees a GPU, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help=f"the dtype of q, k and v (default: {DEFAULT_CHECK_DTYPE}; with --conformance: each of "
        f"{', '.join(DTYPES)})",
    )
    p.add_argument(
        "--repeat",
        type=_positive_int,
        default=DEFAULT_CHECK_REPEAT,
        metavar="N",
        help="timed runs after one warm-up run; the median is reported (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=_seed_arg,
        default=0,
        metavar="N",
        help="seed of the random inputs (default: %(default)s)",
    )
    p.set_defaults(func=cmd_check)

    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="print the report as JSON (on stdout)")
        p.add_argument(
            "--debug",
            action="store_true",
            help="show the Python traceback when the command itself fails unexpectedly",
        )
        p.set_defaults(parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # vLLM logs to stdout by default; keep stdout for the report (and valid JSON).
    # Set before vLLM is first imported, which configures its logging once.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(
            f"{PROG} {args.command}: the command failed unexpectedly: {_describe_exception(e)}. "
            "Run it again with --debug to see the traceback, and please report it.",
            file=sys.stderr,
        )
        return EXIT_CANNOT_CHECK


if __name__ == "__main__":
    sys.exit(main())
