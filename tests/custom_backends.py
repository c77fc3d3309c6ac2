"""Out-of-tree MLA prefill backends for the registry tests.

An importable module (not the test file) so that a spawned child process can load
these classes by class path, as vLLM's engine and worker processes would. The
registry is deliberately not imported at module level: :func:`child_view` imports
it inside the child, where it must pick the parent's registrations up from the
environment.
"""

from __future__ import annotations

from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend


class WrappedSDPABackend(TorchSDPAPrefillBackend):
    """A real, runnable backend: TORCH_SDPA under another name."""

    @staticmethod
    def get_name() -> str:
        return "WRAPPED_SDPA"


class Outer:
    class NestedSDPABackend(TorchSDPAPrefillBackend):
        """Registered by qualname 'Outer.NestedSDPABackend'."""

        @staticmethod
        def get_name() -> str:
            return "NESTED_SDPA"


class NotABackend:
    """A class, but not an MLAPrefillBackend."""


NOT_A_CLASS = 42


def child_view(name: str) -> tuple[bool, str, str, str]:
    """Run in a spawned child: what the registry there makes of backend ``name``.

    Returns (name is a member, its class path, the class's __name__, its get_name()).
    """
    from mla_prefill_ext.registry import MLAPrefillBackendEnum

    is_member = name in MLAPrefillBackendEnum.__members__
    member = MLAPrefillBackendEnum[name]
    cls = member.get_class()
    return is_member, member.get_path(), cls.__name__, cls.get_name()
