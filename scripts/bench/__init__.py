"""The project's benchmarks, one module per measurement, run from the checkout's root:

    python -m scripts.bench NAME [flags]       # python -m scripts.bench NAME --help: what it measures

docs/benchmarks.md has the commands and the recorded results. The measurements share
``common`` (the run's environment, its JSON, --help from the docstring) and ``sides`` (the runner of
side-by-side engine lifetimes: switches, cold caches, process control, tables).
"""

from __future__ import annotations

# Each measurement: its module in this package (main(argv) runs it) and what it measures.
MEASUREMENTS = {
    "kernel": "each backend's TFLOP/s next to the bare kernel, and the fastest per shape",
    "kernel_report": "the kernel benchmark's tables and plot, rebuilt from a run's log",
    "engine": "engine prefill throughput: stock and the backends, side by side, interleaved",
    "first_request": "start-up time and first-wave latency after a fresh start, per side",
    "serving": "a real `vllm serve` per side, loaded by `vllm bench serve`: TTFT, TPOT, throughput, timers",
    "shared_prefix_layer": "one layer's context attention: vLLM's plan, the shared plan, decode path (GPU)",
    "shared_prefix_engine": "engine time with a shared cached prefix: stock, the add-on, its path off (GPU)",
    "shared_decode_crossover": "where the shared-prefix decode beats vLLM's, one layer, B x P x S (GPU)",
    "step_profile": "where a worker step's time goes (host, GPU, kernel groups), from vLLM's profiler traces",
}
