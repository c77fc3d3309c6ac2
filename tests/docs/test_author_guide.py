"""The backend author's guide (docs/backend-authors.md): its code runs, so it cannot rot.

The guide's blocks headed ``# file: PATH`` are written to PATH in a package folder, which
pip installs when one of them is ``pyproject.toml``; its other Python blocks run, in order,
as one script in a fresh interpreter (vLLM 0.20.2, on the CPU) with that package installed.
The script keeps the guide's line numbers, so a traceback names the guide's line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from pip_install import pip_install

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "backend-authors.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
FILE_HEADER = re.compile(r"# file: (\S+)\n")


class Block(NamedTuple):
    language: str
    line: int  # the guide's line of the block's first line of code
    text: str


def blocks(markdown: str) -> list[Block]:
    return [
        Block(m.group(1), markdown.count("\n", 0, m.start(2)) + 1, m.group(2))
        for m in FENCE.finditer(markdown)
    ]


def files_and_script(markdown: str) -> tuple[dict[str, str], str]:
    """The files the guide names, and its other Python blocks as one script on the guide's lines."""
    files: dict[str, str] = {}
    lines = [""] * (markdown.count("\n") + 1)
    for block in blocks(markdown):
        header = FILE_HEADER.match(block.text)
        if header:
            files[header.group(1)] = block.text
        elif block.language == "python":
            for i, text in enumerate(block.text.splitlines()):
                lines[block.line - 1 + i] = text
    return files, "\n".join(lines)


def run_guide(markdown: str, folder: Path) -> subprocess.CompletedProcess[str]:
    files, script = files_and_script(markdown)
    paths = [str(ROOT)]
    if files:
        package = folder / "package"
        for name, text in files.items():
            (package / name).parent.mkdir(parents=True, exist_ok=True)
            (package / name).write_text(text)
        paths.insert(0, str(pip_install(package, folder / "installed")))
    script_file = folder / GUIDE.name  # tracebacks read 'backend-authors.md", line N'
    script_file.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_PREFILL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return subprocess.run(
        [sys.executable, str(script_file)], capture_output=True, text=True, cwd=folder, env=env, timeout=600
    )


def test_the_guides_code_runs(tmp_path: Path) -> None:
    markdown = GUIDE.read_text()
    files, script = files_and_script(markdown)
    assert set(files) == {"my_prefill.py", "pyproject.toml"} and script.strip()
    proc = run_guide(markdown, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "RESULT: PASS" in proc.stdout  # the conformance report it prints


def test_a_broken_snippet_fails_and_names_the_guides_line(tmp_path: Path) -> None:
    markdown = (
        "# A guide\n\n```python\nimport mla_prefill_ext\n```\n\nText.\n\n```bash\nexit 1\n```\n\n"
        "```python\nfrom mla_prefill_ext import MLAPrefillBackend\n"
        "assert MLAPrefillBackend.get_name.__name__ == 'name'\n```\n"
    )
    proc = run_guide(markdown, tmp_path)
    assert proc.returncode == 1
    assert f'{GUIDE.name}", line 15' in proc.stderr and "AssertionError" in proc.stderr


def test_the_readme_links_the_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Writing and registering your own backend", 1)[1].split("\n## ", 1)[0]
    assert "(docs/backend-authors.md)" in section
