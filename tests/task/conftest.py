"""Fixtures shared by the task tests."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Write a throwaway importable module; returns its name."""
    name = "fw_user_" + re.sub(r"\W", "_", tmp_path.name)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    yield write
    sys.modules.pop(name, None)
