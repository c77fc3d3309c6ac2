"""The first-request load: the prompts of the first wave after a fresh start, and the model they go to.

Shared by first_request (``AsyncLLM`` in the side's process) and serve_load (``vllm serve``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .common import ROOT

MODEL_DIR = ROOT / "scripts" / "gpu_harness" / "tiny_deepseek_v2"  # the GPU suite's tiny DeepSeek-V2
VOCAB = 32000
MAX_TOKENS = 8


@dataclass(frozen=True)
class Wave:
    """The first wave's shape: how many requests, their prompt lengths, the shared prefix."""

    requests: int = 64
    min_len: int = 100
    max_len: int = 12000
    prefix_len: int = 6000
    share_every: int = 4  # every fourth request starts with the shared prefix
    seed: int = 0


QUICK_WAVE = Wave(requests=16, max_len=6000, prefix_len=3000)


def make_wave(wave: Wave) -> list[list[int]]:
    """The first wave's prompts (token ids), the same for every side."""
    rng = random.Random(wave.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    prefix = tokens(wave.prefix_len)
    prompts = []
    for i in range(wave.requests):
        if i % wave.share_every == 0:
            prompts.append(prefix + tokens(rng.randint(wave.min_len, wave.max_len - wave.prefix_len)))
        else:
            prompts.append(tokens(rng.randint(wave.min_len, wave.max_len)))
    return prompts
