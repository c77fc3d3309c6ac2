"""The shared-prefix path in vLLM's MLA context code, on both hosts (vLLM 0.20.x and 0.23+).

The plan and the per-layer computation are host-independent (:mod:`mla_prefill_ext.shared_prefix`);
this package puts them where vLLM runs its own context path:

* :mod:`.switch`: whether the path runs in an engine (the setting, then the exclusions), one
  INFO line per process saying which and why.
* :mod:`.needs`: every vLLM internal the path reads, per part and model runner, declared once and
  checked by signature, fields or callable; a part whose rows do not hold is not wrapped, one line
  says so, and vLLM runs as it always does. ``info`` prints each row's outcome.
* :mod:`.block_tables`: the host rows of the step's block table without a device sync (the V1
  runner's host twin, found by address; a mirror of the V2 runner's ``append_block_ids``).
* :mod:`.costs`: which shared groups are worth a segment (the planner and the router agree).
* :mod:`.step`: once per step, after vLLM's builder: the plan, the private chunks, the segment instance.
* :mod:`.layer`: per layer, in place of ``_compute_prefill_context`` when the step has a plan.
* :mod:`.routing`: short extends that share a prefix moved to the prefill path when cheaper.
* :mod:`.instrumentor`: the wrappers (the core ``Instrumentor``), all or none, symmetric and idempotent.
* :mod:`.prefix_hashes` and :mod:`.engine_core`: in the engine core, a shared prefix's block hashes
  computed once (vLLM's hasher wrapped; its hashes bit for bit), on either model runner.
"""
