"""Import layering: strategies and plugins never reach transports, launchers, topologies, the runner or the CLI.

Checked on the source (``ast``), so a module that fails to import is still checked, and
through every fedweave module they import in turn, so a detour does not hide a violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "src"
FEDWEAVE = PACKAGE_ROOT / "fedweave"
FORBIDDEN = (
    "fedweave.transports",
    "fedweave.launchers",
    "fedweave.topologies",
    "fedweave.runner",
    "fedweave.cli",
    "grpc",
    "ray",
)
CHECKED = sorted((FEDWEAVE / "strategies").rglob("*.py")) + sorted((FEDWEAVE / "plugins").rglob("*.py"))


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path = PACKAGE_ROOT) -> set[str]:
    """Every dotted name ``path`` imports, anywhere in the file; ``from a import b`` gives ``a`` and ``a.b``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def source_of(name: str, root: Path = PACKAGE_ROOT) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def is_forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def forbidden_chain(start: Path, root: Path = PACKAGE_ROOT) -> list[str] | None:
    """The import path from ``start`` to a forbidden module, following fedweave's own modules; None if none."""
    first = module_name(start, root)
    chains = {first: [first]}
    queue = [start]
    while queue:
        path = queue.pop(0)
        chain = chains[module_name(path, root)]
        for name in sorted(imported_names(path, root)):
            if is_forbidden(name):
                return [*chain, name]
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b too
                prefix = ".".join(parts[:depth])
                source = source_of(prefix, root) if prefix.split(".")[0] == "fedweave" else None
                if source is not None and prefix not in chains:
                    chains[prefix] = [*chain, prefix]
                    queue.append(source)
    return None


def test_there_is_something_to_check() -> None:
    names = {module_name(p) for p in CHECKED}
    assert {"fedweave.strategies.fedavg", "fedweave.strategies.base", "fedweave.plugins.chain"} <= names


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: module_name(p))
def test_no_transport_launcher_topology_runner_or_cli_import(path: Path) -> None:
    chain = forbidden_chain(path)
    assert chain is None, "layering broken: " + " -> ".join(chain or [])


def test_the_check_sees_direct_relative_lazy_and_indirect_imports(tmp_path: Path) -> None:
    package = tmp_path / "fedweave"
    for sub in ("strategies", "transports", "helpers"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "transports" / "grpc_link.py").write_text("")
    (package / "helpers" / "net.py").write_text("from fedweave.transports import grpc_link\n")
    sources = {
        "relative.py": "from ..transports import grpc_link\n",
        "lazy.py": "def f():\n    import ray\n",
        "indirect.py": "from fedweave.helpers import net\n",
        "clean.py": "import torch\nfrom . import relative_free\n",
    }
    for name, text in sources.items():
        (package / "strategies" / name).write_text(text)
    chain = {name: forbidden_chain(package / "strategies" / name, tmp_path) for name in sources}
    assert chain["relative.py"] == ["fedweave.strategies.relative", "fedweave.transports"]
    assert chain["lazy.py"] == ["fedweave.strategies.lazy", "ray"]
    assert chain["indirect.py"] == ["fedweave.strategies.indirect", "fedweave.helpers.net", "fedweave.transports"]
    assert chain["clean.py"] is None
