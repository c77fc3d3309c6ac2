"""The cost models: which groups of prefill requests are worth a segment (the step planner and the router
share it), and which groups of decode rows are worth one shared call.

Routing (:mod:`.routing`) counts only the groups the planner (:mod:`.step`) would form, so a step
it moves to the prefill path is never left there without a shared segment.
"""

from __future__ import annotations

from mla_prefill_ext.shared_prefix import FlopCostModel
from mla_prefill_ext.shared_prefix.decode import DECODE_CROSSOVER

# A segment costs a few extra launches per layer (gather, up-projection, attention, merge, the
# member queries' gather): below about 2,000 shared token-rows saved (8.6 GFLOP of R1
# up-projection at 16 heads) a group is not worth them. A guard from launch counts, not a
# calibration.
GROUP_VALUE = FlopCostModel(min_saved_flops=8.6e9)

# Decode rows: the region where one shared call was measured faster than vLLM's decode.
DECODE_VALUE = DECODE_CROSSOVER
