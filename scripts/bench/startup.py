"""Where the add-on's start-up time goes, and what it costs with and without compiled bytecode.

    python -m scripts.bench startup [--reps 7] [--tree LABEL=DIR ...] [--whole-process] [--json out.json]

Every measurement runs in a fresh process that has already imported vLLM (untimed) and
times, from inside, ``import mla_prefill_ext; activate()`` and then the patch applied
by the post-import hook when vLLM's MLA module is imported (the whole add-on cost in a
process that builds an MLA model).

1. Profile, in the environment as found: one run under ``python -X importtime`` lists
   every module imported after vLLM (the add-on's own and its dependencies'), with
   whether each has bytecode on disk, and a cProfile of activate() and the hook.
   ``-X importtime`` logs only imports made by ``import`` statements: modules loaded
   through ``importlib.import_module`` (the patch package's lazy names) are missing
   from its list, so the cProfile is the complete account.
2. Timing, interleaved repetitions, for each code tree (``--tree``; default: this
   checkout) in two states of the add-on's package:
   * ``compiled``: its bytecode written beforehand (``compileall``), as ``pip install``
     leaves a package (pip compiles unless told ``--no-compile``); wrapt compiled too;
   * ``source``: a copy without bytecode, with ``PYTHONDONTWRITEBYTECODE=1``, so Python
     compiles its modules from source in every process (an install made with
     ``--no-compile`` into a read-only or no-bytecode environment).
3. With ``--whole-process``, in the same repetitions: whole processes with this checkout,
   ``import vllm``, and ``import vllm`` + vLLM's plugin loading with the add-on's entry point
   excluded or allowed (``VLLM_PLUGINS``). Seconds each: differences of tens of milliseconds
   drown in their spread.
"""

from __future__ import annotations

import compileall
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import common
from .common import ROOT

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
MARK = "--- after vllm ---"
# Activation's post-import hooks: one for every patch set (vLLM 0.20), one for the bridge's modules
# (vLLM 0.23+), or (trees before patches.PATCH_SETS) the MLA one. Each existing one is wrapped.
HOOKS = ("_on_imported", "_on_mla_module_imported", "_on_bridge_module_imported")
WRAP_HOOKS = f"""
def wrap(name, around):
    inner = getattr(a, name, None)
    if inner is not None:
        setattr(a, name, lambda m: around(inner, m))
for name in {HOOKS!r}:
    wrap(name, around)
"""
# The add-on landed: the patch (vLLM 0.20) or the bridge (vLLM 0.23+, trees that have one).
# Asked in the order that imports nothing more than the mode loaded: the bridge's package is loaded
# by then where it applies, the patch's lazy modules are not.
LANDED = """
bridge = sys.modules.get("mla_prefill_ext.hosts.vllm_0_23")
if bridge is not None and bridge.is_instrumented():
    landed = True
else:
    from mla_prefill_ext.hosts import vllm_0_20 as patches
    landed = patches.is_instrumented()
"""

TIMED = f"""
import sys, time, vllm
t = time.perf_counter()
import mla_prefill_ext
from mla_prefill_ext import activation as a
spent = []
def around(inner, m):
    s = time.perf_counter(); inner(m); spent.append(time.perf_counter() - s)
{WRAP_HOOKS}
mla_prefill_ext.activate()
act = time.perf_counter() - t
before = sum(spent)  # hooks run by activate() itself (modules vLLM had already imported)
print({MARK!r}, file=sys.stderr, flush=True)
import importlib; importlib.import_module({MLA_MODULE!r})
{LANDED}
assert landed and spent, "neither the patch nor the bridge was applied by the hooks"
import json; print(json.dumps({{"activate_ms": act * 1e3, "patch_ms": (sum(spent) - before) * 1e3,
    "file": mla_prefill_ext.__file__}}))
"""

HOOK_PROFILE = f"""
import cProfile, io, pstats, vllm
import mla_prefill_ext
from mla_prefill_ext import activation as a
prof = cProfile.Profile()
def around(inner, m):
    prof.enable(); inner(m); prof.disable()
{WRAP_HOOKS}
prof.enable(); mla_prefill_ext.activate(); prof.disable()
import importlib; importlib.import_module({MLA_MODULE!r})
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
print(out.getvalue())
"""


# 3. Whole processes: seconds since the start, printed by the process itself.
OTHER_PLUGINS = "lora_filesystem_resolver,lora_hf_hub_resolver"
IMPORT_VLLM = "import time; t=time.perf_counter(); import vllm; print(time.perf_counter()-t)"
LOAD_PLUGINS = (
    "import time; t=time.perf_counter(); import vllm, vllm.plugins; vllm.plugins.load_general_plugins(); "
    "print(time.perf_counter()-t)"
)
WHOLE_PROCESS = {
    "import vllm": (IMPORT_VLLM, {}),
    "import vllm + plugins, without add-on": (LOAD_PLUGINS, {"VLLM_PLUGINS": OTHER_PLUGINS}),
    "import vllm + plugins, with add-on": (
        LOAD_PLUGINS,
        {"VLLM_PLUGINS": OTHER_PLUGINS + ",mla_prefill_ext"},
    ),
}


def run_python(code: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    # Run outside any checkout: ``-c`` puts the working folder first on sys.path.
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", **env},
        check=True,
    )


def has_bytecode(module_file: str | None) -> bool | None:
    if not module_file or not module_file.endswith(".py"):
        return None
    return Path(importlib.util.cache_from_source(module_file)).exists()


def import_profile(tree: Path) -> dict:
    """``-X importtime`` of the add-on's part, in the environment as found."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    err = run_python(TIMED, env, "-X", "importtime").stderr.splitlines()
    after = err[err.index(MARK) + 1 :] if MARK in err else err
    before = err[: err.index(MARK)] if MARK in err else []
    # Post-order: a module's line follows its children's. What activate() imported sits
    # after "vllm"'s own line and before the marker; the patch's imports follow the marker
    # mixed with vLLM's MLA module's, so only the add-on's and wrapt's are kept there.
    top = max((i for i, line in enumerate(before) if line.rstrip().endswith("| vllm")), default=-1)
    rows = []
    for phase, lines in (("activate", before[top + 1 :]), ("patch", after)):
        for line in lines:
            if not line.startswith("import time:"):
                continue
            self_us, cumulative_us, name = (part.strip() for part in line[len("import time:") :].split("|"))
            if phase == "patch" and not name.startswith(("mla_prefill_ext", "wrapt")):
                continue
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            rows.append(
                {
                    "phase": phase,
                    "module": name,
                    "self_us": int(self_us),
                    "cumulative_us": int(cumulative_us),
                    "bytecode_on_disk": has_bytecode(getattr(spec, "origin", None)),
                }
            )
    return {"modules": rows, "hook_profile": run_python(HOOK_PROFILE, env).stdout}


def source_copy(tree: Path, scratch: Path, label: str) -> Path:
    dest = scratch / f"{label}-source"
    shutil.copytree(
        tree / "mla_prefill_ext", dest / "mla_prefill_ext", ignore=shutil.ignore_patterns("__pycache__")
    )
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per variant")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        help="LABEL=DIR: a folder holding an mla_prefill_ext package (repeatable; this checkout always)",
    )
    parser.add_argument(
        "--whole-process", action="store_true", help="also time whole processes: import vllm, plugins"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    trees = {"this": ROOT} | dict((t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree)

    import wrapt

    environment = {
        "python": sys.version.split()[0],
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "wrapt": wrapt.__version__,
        "wrapt_bytecode_before": has_bytecode(wrapt.__file__),
        "addon_bytecode_before": has_bytecode(str(ROOT / "mla_prefill_ext" / "__init__.py")),
    }
    print("environment", json.dumps(environment), flush=True)
    profile = import_profile(ROOT)
    for row in profile["modules"]:
        print(
            f"{row['phase']:9} {row['cumulative_us']:7d} us cumulative {row['self_us']:7d} us self "
            f"bytecode={row['bytecode_on_disk']} {row['module']}"
        )
    print(profile["hook_profile"], flush=True)

    # As pip leaves an installed package: bytecode for the add-on and wrapt.
    for tree in trees.values():
        compileall.compile_dir(str(tree / "mla_prefill_ext"), quiet=1)
    compileall.compile_dir(str(Path(wrapt.__file__).parent), quiet=1)
    samples: dict[str, list[dict]] = {}
    process_variants = WHOLE_PROCESS if args.whole_process else {}
    process_ms: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        variants = {}
        for label, tree in trees.items():
            variants[f"{label} compiled"] = {"PYTHONPATH": str(tree)}
            variants[f"{label} source"] = {
                "PYTHONPATH": str(source_copy(tree, Path(scratch), label)),
                "PYTHONDONTWRITEBYTECODE": "1",
            }
        for name in variants:
            extra = os.environ.get("PYTHONPATH")
            variants[name]["PYTHONPATH"] = os.pathsep.join(
                filter(None, [variants[name]["PYTHONPATH"], extra])
            )
        for rep in range(args.reps):
            for name, env in variants.items():
                out = json.loads(run_python(TIMED, env).stdout.strip().splitlines()[-1])
                samples.setdefault(name, []).append(out)
            for name, (code, env) in process_variants.items():  # this checkout, with bytecode
                printed = run_python(code, {**variants["this compiled"], **env}).stdout
                process_ms.setdefault(name, []).append(float(printed.strip().splitlines()[-1]) * 1e3)
            print(f"rep {rep + 1}/{args.reps} done", flush=True)
    results = {}
    for name, runs in samples.items():
        expected = Path(variants[name]["PYTHONPATH"].split(os.pathsep)[0]) / "mla_prefill_ext"
        if Path(runs[0]["file"]).parent != expected:
            raise SystemExit(f"{name}: imported {runs[0]['file']}, not the package in {expected}")
        whole = [r["activate_ms"] + r["patch_ms"] for r in runs]
        results[name] = {
            part: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
            for part, v in (
                ("activate", [r["activate_ms"] for r in runs]),
                ("patch", [r["patch_ms"] for r in runs]),
                ("whole", whole),
            )
        }
        results[name]["package_file"] = runs[0]["file"]
        w = results[name]["whole"]
        print(f"{name:24} whole {w['median_ms']:.1f} ms ({w['min_ms']:.1f}-{w['max_ms']:.1f})", flush=True)
    record = {"environment": environment, "profile": profile, "timing": results}
    if process_ms:
        whole_process = {
            name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
            for name, v in process_ms.items()
        }
        whole_process["added_by_add_on_ms"] = (
            whole_process["import vllm + plugins, with add-on"]["median_ms"]
            - whole_process["import vllm + plugins, without add-on"]["median_ms"]
        )
        for name, value in whole_process.items():
            print(name, value, flush=True)
        record["whole_process"] = whole_process
    common.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
