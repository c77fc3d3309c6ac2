"""What the commands tell the user when a backend fails, and how they lay out long names.

Run in this process through ``cli.main`` (the real vLLM, the real selector); the backends are
small TORCH_SDPA variants defined here, registered by their class path.
"""

from __future__ import annotations

from typing import Any

import pytest
from conformance_mutants import WrongScale

from mla_prefill_ext.backends.torch_sdpa import TorchSDPAPrefillBackend
from mla_prefill_ext.cli import main
from mla_prefill_ext.registry import register_mla_prefill_backend

pytestmark = pytest.mark.usefixtures("clean_selection")


class RaisingBackend(TorchSDPAPrefillBackend):
    """Raises inside the prefill, as a broken kernel would."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    def run_prefill_new_tokens(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel exploded")


def run(
    argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# Item 5: a plain check that fails points to the conformance suite


def test_a_failing_check_says_what_to_run_next(capsys, clean_selection):
    register_mla_prefill_backend("CUSTOM", f"{WrongScale.__module__}.WrongScale")
    code, out, _ = run(["check", "--backend", "custom", "--repeat", "1"], capsys, clean_selection)
    assert code == 1, out
    lines = out.splitlines()
    assert lines[-2].startswith("FAIL: the output is not within the tolerance")
    assert lines[-1].startswith("next: run `mla-prefill-ext check --backend CUSTOM --conformance`")


def test_a_passing_check_has_no_next_step(capsys, clean_selection):
    code, out, _ = run(["check", "--backend", "TORCH_SDPA", "--repeat", "1"], capsys, clean_selection)
    assert code == 0 and out.splitlines()[-1] == "PASS"


# Item 9: --debug shows where a backend raised inside check


def test_debug_shows_the_traceback_of_a_backend_that_raises(capsys, clean_selection):
    register_mla_prefill_backend("CUSTOM", f"{__name__}.RaisingBackend")
    code, out, err = run(["check", "--backend", "CUSTOM", "--repeat", "1"], capsys, clean_selection)
    assert code == 1 and "backend CUSTOM failed: RuntimeError: kernel exploded" in out
    assert "Traceback" not in err
    code, out, err = run(
        ["check", "--backend", "CUSTOM", "--repeat", "1", "--debug"], capsys, clean_selection
    )
    assert code == 1 and "backend CUSTOM failed: RuntimeError: kernel exploded" in out  # still the report
    assert "Traceback (most recent call last)" in err
    assert 'raise RuntimeError("kernel exploded")' in err


# Item 9: select's candidate column stays aligned for long names


def test_select_aligns_the_candidates_for_long_names(capsys, clean_selection):
    long_name = "MY_VERY_LONG_PREFILL_BACKEND_NAME"
    register_mla_prefill_backend(long_name, "mla_prefill_ext.backends.torch_sdpa.TorchSDPAPrefillBackend")
    code, out, _ = run(["select", "--capability", "cpu"], capsys, clean_selection)
    assert code == 0, out
    lines = out.splitlines()
    candidates = lines[lines.index("candidates:") + 1 :]
    assert any(line.split()[0] == long_name for line in candidates)
    starts = {len(line) - len(line[2:].split(" ", 1)[1].lstrip()) for line in candidates}
    assert len(starts) == 1, "\n".join(candidates)  # the verdicts start in one column
