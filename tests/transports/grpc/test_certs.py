"""Tests of fedweave.transports.grpc.certs: credentials written whole, private files owner-only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fedweave.errors import ConfigError
from fedweave.transports.grpc.certs import CA_KEY, SERVER_CERT, SERVER_KEY, TOKENS, check_token, make_credentials

SRC = Path(__file__).resolve().parents[3] / "src"


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


@pytest.mark.parametrize("token", ["", "ab\ncd", "ab\rcd", "tab\there", "nul\x00", "naïve"])
def test_a_token_that_cannot_travel_in_a_header_is_refused_without_echoing_it(token: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_token(token, "--token")
    assert str(refused.value).startswith("--token: a token is one line of printable ASCII characters")
    assert not token or token not in str(refused.value)
    assert check_token("0123abcdef", "--token") == "0123abcdef"


def test_more_nodes_than_the_limit_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Issue 26 item 10: `certs --clients 1000000` ran for hours without a word."""
    for clients, sites, error in [(1_000_000, 0, "certs: --clients must lie in 1..10,000, got 1,000,000"),
                                  (0, 0, "certs: --clients must lie in 1..10,000, got 0"),
                                  (1, 10_001, "certs: --sites must lie in 0..10,000, got 10,001")]:
        with pytest.raises(ConfigError) as refused:
            make_credentials(tmp_path / "out", clients, sites=sites)
        assert str(refused.value) == error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("days", "hosts", "error"),
    [
        (0, ["localhost"], "certs: --days must lie in 1..36,500 (100 years), got 0"),
        (-5, ["localhost"], "certs: --days must lie in 1..36,500 (100 years), got -5"),
        (10_000_000, ["localhost"], "certs: --days must lie in 1..36,500 (100 years), got 10,000,000"),  # issue 26
        (1, ["bücher.example"], "certs: --host 'bücher.example' is neither an IP address nor a DNS name of ASCII "
         "letters, digits and hyphens (its ASCII form is 'xn--bcher-kva.example')"),
        (1, ["two words"], "certs: --host 'two words' is neither an IP address nor a DNS name of ASCII letters, "
         "digits and hyphens"),
        (1, ["a..b"], "certs: --host 'a..b' is neither an IP address nor a DNS name of ASCII letters, digits and hyphens"),
    ],
)
def test_bad_days_and_hosts_are_refused_before_anything_is_written(
    tmp_path: Path, days: int, hosts: list[str], error: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        make_credentials(tmp_path / "out", 1, hosts, days)
    assert str(refused.value) == error
    assert not (tmp_path / "out").exists()


def test_ip_addresses_and_wildcard_names_are_hosts(tmp_path: Path) -> None:
    make_credentials(tmp_path, 1, ["fl.example.org", "*.example.org", "10.0.0.1", "fe80::1"], 1)
    assert (tmp_path / SERVER_CERT).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")


def test_the_certificate_code_loads_neither_torch_nor_grpc() -> None:
    """``fedweave certs`` runs where neither is installed, and starts fast."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, fedweave.transports.grpc.certs; print(sorted({'torch', 'grpc'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
