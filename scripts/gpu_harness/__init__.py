"""The GPU verification harness: engine scenarios, their runner, verdicts and the sharp checkpoint.

Run from the checkout's root, e.g. ``python -m scripts.gpu_harness.scenarios --results DIR``
(docs/gpu-verification.md). The GPU tests (tests/gpu/) read what it records.
"""
