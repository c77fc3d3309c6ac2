"""The benchmarks' pausing of the shared-prefix path's parts (``scripts/bench/path_parts.py``): each part,
paused, does what the path off does, through the add-on's own functions; resumed, the add-on's again."""

from __future__ import annotations

import numpy as np
import pytest

from scripts.bench import path_parts

BS = 16


def _routable_step() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """16 short extends of 128 tokens over one cached 4,096-token prefix: routed when nothing is paused."""
    rows = np.array([list(range(1, 257)) + [1000 + i] * 8 for i in range(16)], dtype=np.int32)
    return rows, np.full(16, 256 * BS), np.full(16, 128)


def test_parts_are_paused_with_what_they_imply_and_resumed(paused_parts):
    from mla_prefill_ext.hosts.core.shared_prefix import routing

    assert paused_parts(["hits", "route"]) == ["route", "hits"]  # in the parts' order
    assert path_parts.paused() == ["route", "hits"]
    assert routing.route_threshold(*_routable_step(), BS, 512) is None  # paused: vLLM's threshold
    assert paused_parts(["plan"]) == ["plan", "route"]  # no routing without the plan
    assert paused_parts(["hashes"]) == ["hashes", "gather"]  # no gathering without the hash reuse
    assert routing.route_threshold(*_routable_step(), BS, 512) == 1  # resumed: the add-on's own
    assert paused_parts(list(path_parts.PARTS)) == list(path_parts.PARTS)
    assert paused_parts(()) == [] and path_parts.paused() == []
    with pytest.raises(ValueError, match=r"unknown shared-prefix part\(s\) \['hash'\]: the parts are plan"):
        paused_parts(["hash"])
    assert path_parts.paused() == []  # a refused call changes nothing


def test_paused_the_engine_cores_parts_leave_each_call_to_vllm(paused_parts):
    """Hashes, hits and gathering paused: the add-on's objects hand each call to vLLM's own code as is."""
    from mla_prefill_ext.hosts.core.shared_prefix import arrivals, prefix_hashes, prefix_hits

    calls = []
    hasher = prefix_hashes.ReusingHasher(
        lambda request: calls.append(("hash", request)) or ["h"], BS, lambda: 0
    )
    hits = prefix_hits.PrefixHits(BS)
    paused_parts(["hashes", "hits"])
    assert hasher("a request") == ["h"] and calls == [("hash", "a request")]
    assert hits.find(lambda *args: calls.append(("lookup", args)) or "vLLM's", [1, 2], 32) == "vLLM's"
    assert calls[-1] == ("lookup", ([1, 2], 32)) and hits.looked_up == 0  # the memo never saw it
    assert arrivals._window(object()) == 0.0  # an idle engine core steps at its first request
