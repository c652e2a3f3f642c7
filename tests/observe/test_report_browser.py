"""The reports of a federated run, a data-parallel run and a three-run comparison, opened
in a real browser (Debian's ``chromium``, headless): the page loads with no console
message, names no resource outside itself (and can reach none: every host name resolves
to nothing), every figure decodes to a non-empty image, and a screenshot is written."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fedweave.observe.report import write_report

from .conftest import FEDERATED, cli_run, embedded
from .test_report import PNG, resources

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")


def chromium(page: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr",
         "--v=0", "--window-size=1200,2400", *mode, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=60, check=True,
    )


def check_in_browser(page: Path, tmp_path: Path) -> None:
    figures = len(embedded(page)["figures"])
    assert figures > 0
    assert all(u.startswith("data:image/png;base64,") for u in resources(page.read_text()))
    loaded = chromium(page, tmp_path / "profile-dom", "--dump-dom")
    body = re.search(r"<body[^>]*>", loaded.stdout)
    assert body is not None, loaded.stderr[-2000:]
    marks = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(0)))
    assert marks == {"figures-total": str(figures), "figures-ok": str(figures), "figures-broken": "",
                     "json-ok": "1"}
    assert [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line] == []
    shot = tmp_path / f"{page.stem}.png"
    chromium(page, tmp_path / "profile-shot", f"--screenshot={shot}")
    assert shot.read_bytes().startswith(PNG) and shot.stat().st_size > 10_000


def test_federated_report_in_a_browser(federated_run: Path, tmp_path: Path) -> None:
    check_in_browser(federated_run / "report.html", tmp_path)


def test_data_parallel_report_in_a_browser(data_parallel_run: Path, tmp_path: Path) -> None:
    check_in_browser(data_parallel_run / "report.html", tmp_path)


def test_comparison_of_three_runs_in_a_browser(federated_run: Path, data_parallel_run: Path, tmp_path: Path) -> None:
    fedprox = cli_run(tmp_path / "fedprox", [*FEDERATED, "strategy={name: fedprox, mu: 0.1}"])
    page = write_report([federated_run, fedprox, data_parallel_run], tmp_path / "compare.html")
    assert [r["name"] for r in embedded(page)["runs"]] == ["fed", "fedprox", "dp"]
    check_in_browser(page, tmp_path)
