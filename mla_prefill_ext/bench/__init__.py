"""``mla-prefill-ext bench``'s engine: time MLA prefill backends next to the built-ins.

``spec`` (the prefill shapes and MLA dims to measure, parsed from the command line; needs
neither vLLM nor PyTorch), ``timing`` (a median of repetitions after warm-up, with the
device synchronised) and ``run`` (each backend driven over the shapes as the installed
vLLM calls it, through the conformance kit's calling conventions).

A tool, like the conformance kit: no engine process imports it.
"""
