"""The catalogue of conformance properties: each name, what it means, and the statuses a check records.

A property is checked on every case; ``checks/`` holds one module per family of them.
"""

from __future__ import annotations

PASS, FAIL, SKIP = "pass", "fail", "skip"

PROPERTIES: dict[str, str] = {
    "runs": "the backend constructs with the layer's arguments, and prepare_metadata and the run methods "
    "complete without raising",
    "inputs.unmodified": "q, k, v (and the kv_b_proj rows V is a view of), the chunks' k and v and the "
    "metadata's tensors are not written to",
    "output.shape": "every output is [tokens, num_heads, v_head_dim]",
    "output.unpadded": "the output's last dim is v_head_dim, not the qk head dim a kernel padded V to",
    "output.dtype": "every output has the metadata's output_dtype",
    "output.dense": "every output is contiguous (vLLM's merge_attn_states indexes it densely)",
    "lse.layout": "with return_softmax_lse the result is (output, LSE), the LSE [num_heads, tokens] and "
    "contiguous (merge_attn_states reads it so)",
    "lse.dtype": "the LSE is float32",
    "lse.natural_log": "the LSE is log(sum(exp(scale * q.k))) in natural log, as merge_attn_states "
    "(which uses exp) expects",
    "scale": "the softmax scale is the backend's self.scale (the layer's scale; constructed non-default)",
    "causal": "a new token attends to no later new token (perturbing later tokens leaves it unchanged)",
    "varlen.isolation": "no attention across requests (perturbing one request leaves the others unchanged)",
    "new_tokens.values": "new-token output equals causal attention among each request's new tokens",
    "new_tokens.without_lse": "return_softmax_lse=False returns the output alone, with the same values",
    "context_chunk.values": "a chunk's output equals attention of each request over its keys in that chunk",
    "context_chunk.empty": "a request with no keys in a chunk gets LSE -inf (or +inf) and a finite output, "
    "so the merge gives it no weight",
    "merge.whole_sequence": "the chunks and new tokens merged with merge_attn_states, in vLLM's order, "
    "equal attention over the whole sequence",
    "metadata.restep": "after prepare_metadata with other shapes (more requests, more chunks, no context), "
    "results equal a fresh instance's",
}
"""Every property the suite checks, by name, with what it means (in the report's order)."""
