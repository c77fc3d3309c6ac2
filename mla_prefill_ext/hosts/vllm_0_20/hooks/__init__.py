"""The wrappers the MLA patch set puts on vLLM 0.20's MLA module, by the object they serve.

``layer``: ``MLAAttention`` builds and owns its backend, ``MLACommonImpl`` is bound to
it; ``builder``: ``MLACommonMetadataBuilder`` prepares one instance per step;
``dispatch``: which prefill runs, and the per-layer calls routed to the prepared
instance. They know the backend base class (``backends/base.py``) and nothing more of
the backends: which backend runs is the selector's answer.
"""
