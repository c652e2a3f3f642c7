"""Tests of fedweave.certs: credentials written whole, private files owner-only."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedweave.certs import CA_KEY, SERVER_CERT, SERVER_KEY, TOKENS, make_credentials


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("umask_022")
def test_keys_and_tokens_end_owner_only_even_over_looser_files(tmp_path: Path) -> None:
    private = [CA_KEY, SERVER_KEY, "client-0.key", "client-0.token", TOKENS]
    for name in private:
        (tmp_path / name).write_text("stale")
        (tmp_path / name).chmod(0o644)
    make_credentials(tmp_path, 1)
    for name in private:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
        assert (tmp_path / name).read_text() != "stale"
    assert stat.S_IMODE((tmp_path / SERVER_CERT).stat().st_mode) == 0o644
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
