"""``fedweave deploy image --code DIR --extras LIST --out CONTEXT``: the build context of an image
derived from fedweave's, with the user's modules on the Python path and the extras they need.

The context holds a Dockerfile (``FROM`` the fedweave image, the extras' pinned requirements installed
into its environment, ``DIR`` copied to :data:`CODE_DIR` and put on ``PYTHONPATH``), ``DIR``'s files
under ``code/`` (without caches and version-control folders) and a ``.dockerignore``. A config then
names the user's modules by import path (``task.dataset: mymodule:load``) as it does on a laptop. The
data is no part of the image: a volume holds it (docs/deployment.md, Images).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from fedweave import __version__
from fedweave.errors import ConfigError
from fedweave.files import atomic_write_text

BASE = f"fedweave:{__version__}"
CODE_DIR = "/opt/fedweave/code"
SKIPPED = ("__pycache__", "*.pyc", ".git", ".venv", "*.egg-info", ".pytest_cache", "runs")
REQUIREMENT = re.compile(r'^(?P<req>[^;]+?)\s*;\s*extra\s*==\s*"(?P<extra>[^"]+)"\s*$')
SELF = re.compile(r"^fedweave\[(?P<extras>[^\]]*)\]$")


def extra_pins(extras: Sequence[str]) -> list[str]:
    """The pinned requirements of fedweave's ``extras``, as the installed package declares them
    (``fedweave[a,b]`` within an extra expanded), each once, in order."""
    declared = importlib.metadata.metadata("fedweave").get_all("Provides-Extra") or []
    by_extra: dict[str, list[str]] = {}
    for line in importlib.metadata.requires("fedweave") or []:
        m = REQUIREMENT.match(line)
        if m:
            by_extra.setdefault(m["extra"], []).append(m["req"])
    pins: list[str] = []

    def add(extra: str) -> None:
        if extra not in declared:
            raise ConfigError(f"fedweave deploy image: --extras {extra!r} is not an extra of fedweave "
                              f"(one of {', '.join(declared)})")
        for req in by_extra.get(extra, []):
            nested = SELF.match(req)
            if nested:
                for inner in nested["extras"].split(","):
                    add(inner.strip())
            elif req not in pins:
                pins.append(req)

    for extra in extras:
        add(extra)
    return pins


def dockerfile(base: str, pins: Sequence[str]) -> str:
    """The derived image's Dockerfile: the base, the pinned ``pins``, the code on the Python path."""
    lines = [
        "# fedweave with the user's modules (code/, on PYTHONPATH) and the extras they need; written by",
        "# `fedweave deploy image`. Build it: docker build -t REGISTRY/NAME:TAG THIS_FOLDER",
        f"ARG BASE_IMAGE={base}",
        "FROM ${BASE_IMAGE}",
    ]
    if pins:
        lines += [
            "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu",
            "USER 0",
            '# the pins of fedweave\'s pyproject.toml; torch stays the base image\'s build',
            'RUN /opt/fedweave/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" \\',
            "    " + " ".join(pins),
        ]
    lines += [
        f"COPY code {CODE_DIR}",
        f"ENV PYTHONPATH={CODE_DIR}",
        "USER 10001:10001",
        "",
    ]
    return "\n".join(lines)


def write_context(code: str | Path, extras: Sequence[str], out: str | Path, base: str = BASE) -> Path:
    """Write the build context of the derived image into ``out``; its Dockerfile's path."""
    code, out = Path(code), Path(out)
    if not code.is_dir():
        raise ConfigError(f"fedweave deploy image: --code {str(code)!r} is not a folder")
    if not base or any(ch.isspace() for ch in base):
        raise ConfigError(f"fedweave deploy image: --base {base!r} is not an image reference")
    if out.resolve() == code.resolve() or out.resolve().is_relative_to(code.resolve()):
        raise ConfigError(f"fedweave deploy image: --out {str(out)!r} must lie outside --code")
    pins = extra_pins([e.strip() for e in extras if e.strip()])
    target = out / "code"
    if target.exists():
        shutil.rmtree(target)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(code, target, ignore=shutil.ignore_patterns(*SKIPPED))
    atomic_write_text("\n".join(["**/__pycache__", "**/*.pyc", ""]), out / ".dockerignore")
    path = out / "Dockerfile"
    atomic_write_text(dockerfile(base, pins), path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``fedweave deploy image``."""
    parser.add_argument("--code", required=True, metavar="DIR",
                        help="folder of the modules a config names by import path (put on PYTHONPATH)")
    parser.add_argument("--extras", default="", metavar="LIST",
                        help="fedweave extras to add, comma-separated, e.g. prometheus,mlflow")
    parser.add_argument("--out", required=True, metavar="CONTEXT", help="folder to write the build context into")
    parser.add_argument("--base", default=BASE, metavar="IMG", help=f"the fedweave image to derive from (default {BASE})")
