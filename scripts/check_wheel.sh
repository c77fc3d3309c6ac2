#!/usr/bin/env bash
# The wheel a user installs, installed as a user installs it beside an existing vLLM, then used.
#
# Builds the sdist and, from it, the wheel (python -m build, without isolation: .venv has the build
# tools), installs the wheel with pip into a new virtual environment, then checks there that vLLM's
# own plugin loader finds the add-on's entry point (vllm.general_plugins) in the wheel's files and
# loads it, and runs the wheel's console script, `mla-prefill-ext info`. Fails if any step fails.
#
# vLLM in the new environment: reinstalling it would cost 8 GB and minutes, and
# --system-site-packages would show the checkout's editable install, not the wheel. Instead a .pth
# file adds a folder of links to what .venv has installed (vLLM, PyTorch, ...; through
# site.addsitedir, so that their own .pth files run as in .venv) less the add-on's editable install.
# Nothing of the checkout is reachable there: the add-on comes from the wheel's own files, its
# entry points and its console script, put in place by pip, which also checks that the wheel's
# requirements (wrapt) are met, as for a user. About 30 s; a few MB in a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The package's files only, so that the build writes nothing into the checkout.
mkdir "$work/src"
cp -r pyproject.toml README.md LICENSE mla_prefill_ext "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
if ! .venv/bin/python -m build --no-isolation --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1; then
  tail -n 30 "$work/build.log" >&2
  exit 1
fi
wheel=$(ls "$work"/dist/*.whl)
echo "check_wheel: built $(cd "$work/dist" && ls | tr '\n' ' ')in $SECONDS s"

site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir "$work/vllm-site"
for entry in "$site"/*; do
  case ${entry##*/} in
    mla_prefill_ext* | __editable__*mla_prefill_ext*) ;; # the checkout's editable install
    *) ln -s "$entry" "$work/vllm-site/" ;;
  esac
done
.venv/bin/python -m venv --without-pip "$work/venv"
venv_site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$work/vllm-site')" >"$venv_site/vllm_in_dot_venv.pth"
.venv/bin/python -m pip --python "$work/venv/bin/python" install --no-input -q "$wheel"
echo "check_wheel: installed into a new environment beside .venv's vLLM at $SECONDS s"

cd "$work" # not the checkout: nothing of it on sys.path
env -u PYTHONPATH "$work/venv/bin/python" - "$work/venv" "$checkout" <<'EOF'
import sys
from importlib.metadata import entry_points

venv, checkout = sys.argv[1:]
found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "mla_prefill_ext"]
assert len(found) == 1, f"entry point mla_prefill_ext in vllm.general_plugins: {found}"
(ep,) = found
assert ep.value == "mla_prefill_ext:activate", ep
assert str(ep.dist.locate_file("")).startswith(venv), f"from {ep.dist.locate_file('')}, not the wheel"
(script,) = [e for e in entry_points(group="console_scripts") if e.name == "mla-prefill-ext"]
assert script.value == "mla_prefill_ext.cli:main", script

import mla_prefill_ext
from vllm.plugins import load_plugins_by_group

assert mla_prefill_ext.__file__.startswith(venv) and not mla_prefill_ext.__file__.startswith(checkout)
plugins = load_plugins_by_group("vllm.general_plugins")  # vLLM's own loader, as each of its processes
assert plugins.get("mla_prefill_ext") is mla_prefill_ext.activate, plugins
print(f"entry points ok: vLLM's plugin loader loads {ep.value} from {mla_prefill_ext.__file__}")
EOF
env -u PYTHONPATH "$work/venv/bin/mla-prefill-ext" info
echo "check_wheel: ok in $SECONDS s"
