"""Every Python block of the docs and the README runs, so no example rots.

A block whose first line is ``# file: NAME.py`` is written to a folder on the Python path
(the module a config names by import path) and imported; a block whose first line is
``# doc: skip`` is a fragment and is left out; the other blocks of a page run in order,
in one namespace, in a fresh process whose working directory holds ``examples/``.

Each page's process is forked from a clean interpreter that has imported torch and nothing of
fedweave (:data:`ZYGOTE`), so nine pages import torch once, not nine times; the child then is
what ``python -c PROGRAM`` would be: its own environment, working directory, ``sys.path`` ('' and
then PYTHONPATH's folders first), a fresh ``__main__`` module, and a normal interpreter exit
(atexit handlers, non-daemon threads) whose status the test reads.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FILE = re.compile(r"# file: (\w+)\.py\n")
SKIP = "# doc: skip"


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


ZYGOTE = r"""
import json, os, sys, types
import torch

torch.set_num_threads(1)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the page's process: as `python -c PROGRAM` with the job's cwd, environment and PYTHONPATH
        sys.stdin.close()
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.path[0:1] = ["", *job["path"]]
        sys.argv = ["-c"]
        out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDWR), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(job["program"], "<string>", "exec"), main.__dict__)
        raise SystemExit(0)  # an uncaught exception above ends the child with status 1 and its traceback
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
"""A clean interpreter that imports torch, then forks a process per page it is sent (one JSON line)."""


class Zygote:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)

    def _line(self, timeout: float, what: str) -> str:
        assert self.proc.stdout is not None
        if not self.selector.select(timeout):
            raise TimeoutError(what)
        line = self.proc.stdout.readline()
        assert line, f"the zygote ended ({self.proc.poll()})"
        return line

    def run(self, program: str, cwd: Path, env: dict[str, str], path: list[str], output: Path, timeout: float) -> int:
        """The exit status of ``program`` run as ``python -c`` would, its stdout and stderr written to ``output``."""
        assert self.proc.stdin is not None
        job = {"program": program, "cwd": str(cwd), "env": env, "path": path, "output": str(output)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        pid = int(self._line(120, "the zygote forked no page process"))
        try:
            return int(self._line(timeout, f"the page did not end within {timeout} s"))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    made = Zygote()
    try:
        yield made
    finally:
        made.close()


def test_the_pages_hold_examples() -> None:
    assert len(blocks(ROOT / "docs" / "extending.md")) >= 10
    skipped = [b for page in PAGES for b in blocks(page) if b.startswith(SKIP)]
    assert len(skipped) <= 3  # fragments stay few


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page: Path, tmp_path: Path, zygote: Zygote) -> None:
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
    path = [str(ROOT / "src"), str(tmp_path), str(ROOT / "examples")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    code = zygote.run(program, tmp_path, env, path, tmp_path / "output.txt", timeout=300)
    assert code == 0, f"{page.name}: {(tmp_path / 'output.txt').read_text(errors='replace')[-3000:]}"


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
