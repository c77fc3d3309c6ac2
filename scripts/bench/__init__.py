"""The project's benchmarks, one module per measurement, run from the checkout's root:

    python -m scripts.bench NAME [flags]       # python -m scripts.bench NAME --help: what it measures

docs/benchmarks.md has the commands and the recorded results. The measurements share
``common`` (the run's environment, its JSON, --help from the docstring), ``sides`` (the runner of
side-by-side engine lifetimes: switches, cold caches, process control, tables) and ``workload``
(the first-request load).
"""

from __future__ import annotations

# Each measurement: its module in this package (main(argv) runs it) and what it measures.
MEASUREMENTS = {
    "kernel": "each backend's TFLOP/s next to the bare kernel, and the fastest per shape",
    "kernel_report": "the kernel benchmark's tables and plot, rebuilt from a run's log",
    "step": "per-step host cost of the preparation and the prefill hooks (CPU)",
    "plan": "host time of one step's preparation per backend, GPU idle and busy",
    "engine": "engine prefill throughput: stock and the backends, side by side, interleaved",
    "engine_scenarios": "the throughput the GPU suite's engine scenarios recorded, as one table",
    "startup": "where the add-on's start-up time goes, with and without bytecode",
    "first_request": "start-up time and first-wave latency after a fresh start, per side",
    "serve_load": "load on a real `vllm serve` after a fresh start, per side",
    "shared_prefix_plan": "host time of finding a step's shared prefixes and planning its context (CPU)",
    "layer_host_cost": "one MLA layer's host time in a fresh-prefill step, stock and the add-on (CPU)",
    "prefix_host_cost": "vLLM's host time per part for requests over a cached prefix, no GPU (CPU)",
    "hasher_cost": "vLLM's block hasher and the add-on's reusing one, paired, shared or private (CPU)",
    "prefix_fixed_cost": "where a call over a cached prefix spends its time, by function, in-process (GPU)",
    "gpu_timeline": "a profiled call's GPU busy time, idle gaps and what the host did in them (a trace)",
    "shared_prefix_layer": "one layer's context attention: vLLM's plan, the shared plan, decode path (GPU)",
    "shared_prefix_engine": "engine time with a shared cached prefix: stock, the add-on, its path off (GPU)",
    "shared_prefix_steps": "a recorded engine run's calls by arrival split and each forward's time",
    "compact_record": "a recorded engine run made small enough for docs/results (its notes say how)",
    "bench_vs_kernel": "`mla-prefill-ext bench --json` paired with the kernel benchmark on the same shapes",
}
