"""The checkout's tools: the benchmarks (``python -m scripts.bench``) and the GPU harness
(``scripts.gpu_harness``). Run them from the checkout's root."""
