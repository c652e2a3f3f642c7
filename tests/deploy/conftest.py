"""Rendering manifests and building them with ``kubectl kustomize`` (skipped where kubectl is missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` builds."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}
