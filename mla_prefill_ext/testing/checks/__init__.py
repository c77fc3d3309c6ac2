"""The conformance checks, one module per family of properties; ``case_run`` runs them on one case.

Each property is tested in a way that isolates it, so that one bug is reported under its own
name: ``causal`` and ``varlen.isolation`` perturb what a token must not see (``probes``);
``scale`` fits the scale the backend uses, and the value checks compare at it (``scale``,
``values``, ``merge``); a check that cannot be made because another failed is skipped with
the reason.
"""
