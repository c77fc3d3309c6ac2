"""What the serving benchmark gives `vllm bench serve`: the workloads (its dataset and traffic flags, all in
vLLM 0.20.2 and 0.34.0), its command line, and a tokenizer of the R1 slice's vocabulary (the server's too)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

INF = float("inf")
SPECIAL = ["<s>", "</s>", "<unk>"]  # ids 0 and 1: the config's bos and eos; 2: unknown words


class Workload(NamedTuple):
    name: str
    flags: tuple[str, ...]  # the timed run's
    warm_flags: tuple[str, ...]  # the untimed run's, just before
    rate: float  # requests per second (Poisson); inf: all at once


def _random(prefix: int, new: int, out: int, prompts: int, rate: float) -> tuple[str, ...]:
    lengths = f"--random-prefix-len {prefix} --random-input-len {new} --random-output-len {out}"
    return tuple(f"--dataset-name random {lengths} --num-prompts {prompts} --request-rate {rate}".split())


def shared(name: str, prefix: int, new: int, out: int, prompts: int, rate: float = INF) -> Workload:
    """vLLM's random dataset: a prefix shared by all (0: none), ``new`` tokens of each request's own, ``out``
    generated. Its prefix depends on the seed and the number of prompts alone (fixed lengths), so the untimed
    run (one token each of their own, one out, all at once) caches the timed run's prefix and no more."""
    return Workload(name, _random(prefix, new, out, prompts, rate), _random(prefix, 1, 1, prompts, INF), rate)


def mix(name: str, k: int, prefix: int, new: int, prompts: int, rate: float = INF) -> Workload:
    """vLLM's prefix_repetition dataset: ``k`` prefixes, ``prompts / k`` requests each, shuffled, one token
    out. Each prefix is drawn after the previous one's suffixes: none can be cached beforehand, each is
    computed in the timed run (the untimed one only warms the server up)."""
    lengths = f"--prefix-repetition-prefix-len {prefix} --prefix-repetition-suffix-len {new}"
    rest = f"--prefix-repetition-num-prefixes {k} --prefix-repetition-output-len 1 --num-prompts {prompts}"
    flags = f"--dataset-name prefix_repetition {lengths} {rest} --request-rate {rate}".split()
    return Workload(name, tuple(flags), _random(0, 1, 1, 8, INF), rate)


PRESETS: dict[str, tuple[Workload, ...]] = {"start": ()}  # start: each lifetime only starts and stops
PRESETS["bursts-32k"] = tuple(shared(f"burst-32k-n{n}", 32768, n, 1, 64) for n in (32, 128, 512))
PRESETS["bursts-8k"] = tuple(shared(f"burst-8k-n{n}", 8192, n, 1, 64) for n in (32, 128, 512))
PRESETS["sweep-low"] = tuple(shared(f"sweep-32k-{r}rps", 32768, 128, 1, 32, r) for r in (2, 4, 8))
PRESETS["sweep-high"] = tuple(shared(f"sweep-32k-{r}rps", 32768, 128, 1, 4 * r, r) for r in (16, 32, 64))
PRESETS["sweep"] = PRESETS["sweep-low"] + PRESETS["sweep-high"]
PRESETS["mix"] = (mix("mix-4x8k-burst", 4, 8192, 128, 64), mix("mix-4x32k-16rps", 4, 32768, 128, 256, 16))
PRESETS["free"] = (shared("free-2k-burst", 0, 2048, 1, 64), shared("free-2k-8rps", 0, 2048, 1, 64, 8))
PRESETS["decode"] = (shared("decode-8k-out512", 8192, 128, 512, 32),)
PRESETS["decode"] += (shared("decode-8k-4rps-out256", 8192, 128, 256, 64, 4),)
PRESETS |= {w.name: (w,) for ws in list(PRESETS.values()) for w in ws}  # each workload by its name too


def select(text: str) -> list[Workload]:
    """``bursts-32k,free-2k-8rps`` -> those presets' workloads (a workload's name: itself), in order, once."""
    names = [p.strip() for p in text.split(",")]
    if unknown := [p for p in names if p not in PRESETS]:
        raise ValueError(
            f"unknown workloads {unknown}: presets {', '.join(p for p in PRESETS if p[-1] != 's')}"
        )
    return list({w.name: w for p in names for w in PRESETS[p]}.values())


def client_command(port: int, model: str, tokenizer: Path, seed: int, flags: tuple, out: Path) -> list[str]:
    """`vllm bench serve` against the server on ``port``, its result JSON saved as ``out``."""
    command = [sys.executable, *"-m vllm.entrypoints.cli.main bench serve --host 127.0.0.1 --port".split()]
    command += [str(port), "--model", model, "--tokenizer", str(tokenizer), "--seed", str(seed)]
    command += "--ignore-eos --temperature 0 --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el".split()
    command += ["--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent)]
    return [*command, "--result-filename", out.name, *flags]


def build_tokenizer(folder: Path, model_dir: Path) -> Path:
    """Id i is the word ``t{i}`` (0-2: SPECIAL): text decoded from any ids encodes back to them, so the
    client's prompts have the lengths it asks for. The model's config.json goes beside it (vLLM reads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    words = {w: i for i, w in enumerate(SPECIAL + [f"t{i}" for i in range(len(SPECIAL), size)])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: ids decode to words and spaces
    tokenizer.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update(bos_token=SPECIAL[0], eos_token=SPECIAL[1], unk_token=SPECIAL[2])
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "config.json", folder)
    return folder
