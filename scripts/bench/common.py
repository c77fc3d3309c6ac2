"""What the measurements share: the checkout's root, the run's environment, output and --help."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def use_this_checkout() -> None:
    """Import ``mla_prefill_ext`` from this checkout, not from wherever it is installed (a script run
    from another tree, e.g. an older commit's, measures that tree's code)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def stamp(message: str) -> None:
    """One line of progress, with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose --help shows the script's docstring: first line, then what it measures."""
    first, _, rest = doc.strip().partition("\n")
    return argparse.ArgumentParser(
        description=first, epilog=rest.strip("\n"), formatter_class=argparse.RawDescriptionHelpFormatter
    )


def environment() -> dict[str, Any]:
    """Python, torch, vLLM, FlashInfer and, where there is one, the GPU and its driver."""
    import torch
    import vllm

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "vllm": vllm.__version__}
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        try:
            info["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.split()[0]
        except (OSError, IndexError):
            pass
    return info


def record(**results: Any) -> dict[str, Any]:
    """A run's JSON: the command line, the environment, then the results."""
    return {"command": " ".join(sys.argv), "environment": environment(), **results}


def write_json(path: str | None, out: dict[str, Any]) -> None:
    """Write ``out`` to ``path``, if one was given."""
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


def seeded_tokens(seed: str, length: int, vocab: int) -> list[int]:
    """``length`` random token ids in ``[2, vocab)``, the same for the same string ``seed`` in every
    process (str hashes are salted, ``Random(str)`` is not)."""
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]
