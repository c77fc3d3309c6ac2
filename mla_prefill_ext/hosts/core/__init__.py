"""What both hosts do, on every vLLM the add-on runs on (it imports neither host).

* :mod:`.refusal`: an explicit backend choice the add-on cannot honour fails at start,
  with one message on both hosts; :mod:`.stock_guard` applies it where nothing else is
  patched (vLLM 0.21-0.22, or 0.20 with changed targets).
* :mod:`.platform`: whether the add-on serves on this platform.
* :mod:`.instrumentor`: the one instrumentor design (wrapper bookkeeping, all-or-nothing
  apply, symmetric idempotent undo) behind the patch's patch sets and the bridge.
* :mod:`.builder_lifecycle`: a backend's warm-up, clone and workspace when vLLM creates a
  metadata builder (the patched 0.20 builder, the bridge adapter's ``clone()`` on 0.25+).
* :mod:`.report`: what a host reports to the CLI.
"""
