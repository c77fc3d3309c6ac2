#!/usr/bin/env python3
"""Writes a seeded "sharp attention" checkpoint of the tiny DeepSeek-V2 that vLLM loads.

    python scripts/gpu_harness/make_sharp_checkpoint.py OUT_DIR [--seed 0] [--config CONFIG_JSON]

vLLM's dummy weights (uniform +-1e-3) make attention uniform: a wrong prefill backend (scale 2% off,
LSE in base 2) still gives the same greedy tokens. Here the softmax logits spread (std about 5), so
it does not: norms 1, ``q_proj``/``q_b_proj``/``kv_b_proj`` normal with std 0.06, every other weight
std 0.02, drawn from one generator seeded with ``--seed`` tensor by tensor in sorted name order,
stored as bfloat16 (the same seed, the same bytes). Names and shapes come from transformers'
``DeepseekV2ForCausalLM`` on the meta device, written with safetensors in the per-expert layout
vLLM's loader reads; ``config.json`` is copied unchanged. Idempotent (a marker records seed, config
and generator version); no tokenizer (the engines skip it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "tiny_deepseek_v2" / "config.json"
WEIGHTS_FILE = "model.safetensors"
MARKER_FILE = "sharp_checkpoint.json"
GENERATOR_VERSION = 1  # bump when the weight rule changes: old directories are regenerated

SHARP_STD = 0.06
BASE_STD = 0.02
SHARP_WEIGHTS = re.compile(r"\.(q_proj|q_b_proj|kv_b_proj)\.weight$")
NORM_WEIGHTS = re.compile(r"(layernorm|norm)\.weight$")


def config_digest(config_path: Path) -> str:
    return hashlib.sha256(config_path.read_bytes()).hexdigest()


def transformers_parameter_shapes(config_path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of transformers' DeepseekV2ForCausalLM built from the config (meta device)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config.from_pretrained(str(config_path.parent))
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def vllm_checkpoint_shapes(hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers' names -> the per-expert names vLLM's loader reads: fused routed experts
    (transformers >= 5) split, ``gate_up_proj[e]`` as ``[gate; up]`` along dim 0."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in hf_shapes.items():
        fused = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if fused is None:
            out[name] = shape
            continue
        prefix, which = fused.groups()
        parts = {"gate_proj": shape[1] // 2, "up_proj": shape[1] // 2} if which == "gate_up_proj" else None
        for e in range(shape[0]):  # each expert
            for part, rows in (parts or {"down_proj": shape[1]}).items():
                out[f"{prefix}.{e}.{part}.weight"] = (rows, shape[2])
    return out


def std_of(name: str) -> float | None:
    """None: a norm weight (all ones)."""
    if NORM_WEIGHTS.search(name):
        return None
    return SHARP_STD if SHARP_WEIGHTS.search(name) else BASE_STD


def make_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        if (std := std_of(name)) is None:  # a norm
            t = torch.ones(shapes[name], dtype=torch.float32)
        else:
            t = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std
        tensors[name] = t.to(torch.bfloat16).contiguous()
    return tensors


def is_complete(out_dir: Path, seed: int, config_path: Path) -> bool:
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    weights = out_dir / WEIGHTS_FILE
    return (
        marker.get("seed") == seed
        and marker.get("generator_version") == GENERATOR_VERSION
        and marker.get("config_sha256") == config_digest(config_path)
        and weights.is_file()
        and weights.stat().st_size == marker.get("weights_bytes")
        and (out_dir / "config.json").is_file()
    )


def make_checkpoint(out_dir: Path, seed: int = 0, config_path: Path = DEFAULT_CONFIG) -> Path:
    """Write (or keep) the checkpoint in ``out_dir``; return ``out_dir``. Several processes at once:
    one writes, the others wait and keep it."""
    import fcntl

    out_dir = Path(out_dir)
    config_path = Path(config_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing it
        if is_complete(out_dir, seed, config_path):
            print(f"sharp checkpoint (seed {seed}) already in {out_dir}", flush=True)
        else:
            _write(out_dir, seed, config_path)
    return out_dir


def _write(out_dir: Path, seed: int, config_path: Path) -> None:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    (out_dir / MARKER_FILE).unlink(missing_ok=True)  # incomplete until the marker is back
    shapes = vllm_checkpoint_shapes(transformers_parameter_shapes(config_path))
    tensors = make_tensors(shapes, seed)
    tmp = out_dir / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_dir / WEIGHTS_FILE)
    shutil.copyfile(config_path, out_dir / "config.json")
    marker = dict(seed=seed, generator_version=GENERATOR_VERSION, config_sha256=config_digest(config_path))
    marker.update(weights_bytes=(out_dir / WEIGHTS_FILE).stat().st_size, num_tensors=len(tensors))
    marker.update(num_parameters=sum(t.numel() for t in tensors.values()))
    marker["rule"] = {"norms": 1.0, "q_proj|q_b_proj|kv_b_proj": SHARP_STD, "other": BASE_STD}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=1))
    took = f"{marker['num_parameters'] / 1e6:.0f} M parameters in {out_dir}"
    took += f" ({time.perf_counter() - t0:.0f} s)"
    print(f"sharp checkpoint (seed {seed}): {len(tensors)} tensors, {took}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config.json of the model")
    args = parser.parse_args(argv)
    make_checkpoint(args.out_dir, args.seed, args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
