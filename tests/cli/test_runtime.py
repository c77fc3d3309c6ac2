"""The process ``info`` runs in (mla_prefill_ext/cli/runtime.py): the platform line, bytecode notes."""

from __future__ import annotations

from pathlib import Path


def test_the_platform_line_says_where_vllms_own_prefill_stays() -> None:
    """ROCm, XPU and other platforms cannot be had here: the line info prints for each case."""
    from mla_prefill_ext.cli.runtime import platform_line as _platform_line

    served = {"name": "CUDA", "served": True, "reason": None, "error": None}
    assert _platform_line(served, True, False) == "platform: CUDA: the add-on serves MLA prefill here"
    assert _platform_line({**served, "name": "none"}, True, False) == (
        "platform: none (vLLM detected no GPU platform): the add-on serves MLA prefill here"
    )
    assert _platform_line(served, False, True) == (
        "platform: CUDA: the add-on would serve MLA prefill here (it is disabled)"
    )
    rocm = {
        "name": "ROCm",
        "served": False,
        "reason": "platform RocmPlatform has its own kernels",
        "error": None,
    }
    assert _platform_line(rocm, True, False) == (
        "platform: ROCm: vLLM's own MLA prefill stays (platform RocmPlatform has its own kernels); "
        "an explicit MLA_PREFILL_BACKEND is honoured if a backend can serve it"
    )
    broken = {"name": None, "served": None, "reason": None, "error": "RuntimeError: no platform"}
    assert _platform_line(broken, True, False) == "platform: unknown (see the findings)"


def test_info_notes_modules_compiled_from_source_in_every_process(tmp_path: Path) -> None:
    import compileall

    from mla_prefill_ext.cli.runtime import bytecode_findings as _bytecode_findings

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "mod.py").write_text("Y = 2\n")
    # Python may write bytecode: the first import does, nothing to say.
    assert _bytecode_findings({"pkg": str(pkg)}, can_write=True) == []
    # It may not, and there is none: every process compiles these modules.
    (note,) = _bytecode_findings({"pkg": str(pkg)}, can_write=False)
    assert note.level == "note" and "pkg has modules without bytecode" in note.message
    assert note.message.endswith(f"-m compileall -q {pkg}")
    # Compiled once (as pip does unless --no-compile): nothing to say.
    assert compileall.compile_dir(str(pkg), quiet=1)
    assert _bytecode_findings({"pkg": str(pkg)}, can_write=False) == []
    (pkg / "late.py").write_text("Z = 3\n")  # one module left without bytecode is enough
    assert len(_bytecode_findings({"pkg": str(pkg)}, can_write=False)) == 1
    # The command names every folder, as the README's does: the add-on's and wrapt's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "__init__.py").write_text("W = 4\n")
    assert compileall.compile_dir(str(other), quiet=1)
    (note,) = _bytecode_findings({"pkg": str(pkg), "other": str(other)}, can_write=False)
    assert "pkg has modules without bytecode" in note.message
    assert note.message.endswith(f"-m compileall -q {pkg} {other}")
    (other / "late.py").write_text("V = 5\n")
    (note,) = _bytecode_findings({"pkg": str(pkg), "other": str(other)}, can_write=False)
    assert "pkg and other have modules without bytecode" in note.message
