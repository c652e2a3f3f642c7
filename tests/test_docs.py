"""Every Python block of the docs and the README runs, so no example rots.

A block whose first line is ``# file: NAME.py`` is written to a folder on the Python path
(the module a config names by import path) and imported; a block whose first line is
``# doc: skip`` is a fragment and is left out; the other blocks of a page run in order,
in one namespace, in a fresh process whose working directory holds ``examples/``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FILE = re.compile(r"# file: (\w+)\.py\n")
SKIP = "# doc: skip"


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_the_pages_hold_examples() -> None:
    assert len(blocks(ROOT / "docs" / "extending.md")) >= 10
    skipped = [b for page in PAGES for b in blocks(page) if b.startswith(SKIP)]
    assert len(skipped) <= 3  # fragments stay few


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page: Path, tmp_path: Path) -> None:
    modules, script = [], []
    for block in blocks(page):
        if block.startswith(SKIP):
            continue
        named = FILE.match(block)
        if named:
            (tmp_path / f"{named.group(1)}.py").write_text(block)
            modules.append(named.group(1))
        else:
            script.append(block)
    program = "import torch\ntorch.set_num_threads(1)\n" + "".join(f"import {m}\n" for m in modules)
    program += "\n".join(script)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path), str(ROOT / "examples")])}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page.name}: {done.stderr[-3000:]}"


def test_the_readme_is_a_front_door() -> None:
    """Short table cells (the long measurements live in docs/benchmarks.md), and every page or file it
    names is in the repository: no absolute paths, nothing above it."""
    text = (ROOT / "README.md").read_text()
    cells = [cell for line in text.splitlines() if line.startswith("|") for cell in line.split("|")]
    assert max(map(len, cells)) <= 400
    named = set(re.findall(r"(?<![\w/.])((?:docs|examples|deploy|benchmarks|src)/[\w./-]*\w)", text))
    assert "docs/benchmarks.md" in named
    assert "docs/architecture.md" in named
    missing = sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / "src" / "fedweave" / p).exists())
    assert not missing, missing
    assert not re.search(r"\]\((?!docs/|examples/|deploy/|benchmarks/|#)", text)  # links stay inside
    assert "DESIGN.md" not in text and "/work/" not in text
