"""The contributor guides in docs/, followed literally: their Python blocks run in order, in an
empty folder, and the tests they add pass. A guide whose code no longer works fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO

DOCS = REPO / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def guide_program(path: Path) -> str:
    """The guide's Python blocks in order, every other line blank: a traceback's line numbers
    are the guide's own."""
    lines = path.read_text(encoding="utf-8").splitlines()
    program, inside = [], False
    for line in lines:
        if line.startswith("```"):
            inside = line == "```python" and not inside
            program.append("")
            continue
        program.append(line if inside else "")
    return "\n".join(program)


@pytest.mark.parametrize("guide", ["adding-a-quantization-method.md", "adding-a-modifier.md", "adding-a-format.md"])
def test_a_guide_followed_literally_gives_a_working_extension(guide, tmp_path, monkeypatch, scoped_registries):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(DOCS / guide)
    assert len(blocks) >= 3, f"{guide} has {len(blocks)} Python blocks"
    namespace: dict = {"__name__": f"guide_{guide}"}
    exec(compile(guide_program(DOCS / guide), str(DOCS / guide), "exec"), namespace)
    tests = [value for name, value in namespace.items() if name.startswith("test_") and callable(value)]
    assert tests, f"{guide} adds no test"
    for test in tests:
        test()
