"""Import layering: strategies and plugins never reach transports, launchers, topologies, the runner or the CLI,
nor the config loader; no module imports a private name of another; no import circle anywhere in ``src/``
(lazy ones and the registries' named imports included).

Checked on the source (``ast``), so a module that fails to import is still checked, and
through every fedweave module they import in turn, so a detour does not hide a violation.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
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
    "fedweave.api",
    "fedweave.load_config",
    "fedweave.run",
    "fedweave.resume",
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
    tree = ast.parse(path.read_text(), filename=str(path))
    if name == "fedweave":
        # The root package's __getattr__ loads the public API (fedweave.run, ...) when one of
        # those names is used; importing a submodule never calls it. Using them is forbidden above.
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = imported_from(node, package)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from MODULE import ...`` in ``package`` (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


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


# --------------------------------------------------------------------------- private names and cycles

ALL = sorted(FEDWEAVE.rglob("*.py"))
DATA_PARALLEL = "fedweave.data_parallel"


def private_imports(path: Path, root: Path = PACKAGE_ROOT) -> list[str]:
    """Private names (a leading underscore) that ``path`` imports from fedweave's modules."""
    found = []
    for name in sorted(imported_names(path, root)):
        module, _, last = name.rpartition(".")
        if module.split(".")[0] == "fedweave" and last.startswith("_") and not last.startswith("__"):
            found.append(name)
    return found


def _runs_at_import(tree: ast.Module) -> list[ast.stmt]:
    """The statements of a module that run when it is imported: not function bodies, not
    ``if TYPE_CHECKING:`` blocks."""
    statements, queue = [], list(tree.body)
    while queue:
        node = queue.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            queue.extend(node.orelse)
            continue
        statements.append(node)
        queue.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return statements


REGISTERED = re.compile(r"(fedweave(?:\.\w+)+):\w+")
"""A registry's entry (``fedweave.strategies.fedavg:FedAvg``): the registry imports the module by name."""


def import_graph(paths: list[Path], root: Path = PACKAGE_ROOT, lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the fedweave modules it imports (``lazy``: also inside functions and the entries of a
    registry; never under ``TYPE_CHECKING``). ``from a import b`` points at ``a.b`` when that is a module,
    else at ``a``."""
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = module_name(path, root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        if name == "fedweave":  # the root's __getattr__ (the public API) runs on use, never on a submodule's import
            tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
        nodes = list(ast.walk(tree)) if lazy else _runs_at_import(tree)
        if lazy:
            hidden = [n for n in ast.walk(tree) if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
                      and n.test.id == "TYPE_CHECKING"]
            skipped = {id(s) for block in hidden for stmt in block.body for s in ast.walk(stmt)}
            nodes = [n for n in nodes if id(n) not in skipped]
        targets: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = imported_from(node, package)
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    targets.add(full if source_of(full, root) is not None else module)
            elif lazy and isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = REGISTERED.fullmatch(node.value)  # a registry's entry: imported when its name is asked for
                if named:
                    targets.add(named.group(1))
        graph[name] = {t for t in targets if t.split(".")[0] == "fedweave" and source_of(t, root) is not None} - {name}
    return graph


@functools.cache
def src_graph() -> dict[str, set[str]]:
    """:func:`import_graph` of every module of ``src/``, lazy imports included (parsed once)."""
    return import_graph(ALL)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected parts of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_data_parallel_package_imports_on_its_own() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import fedweave.data_parallel"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {module_name(p) for p in ALL if module_name(p).startswith(DATA_PARALLEL + ".")} >= {
        f"{DATA_PARALLEL}.{m}"
        for m in ("gradients", "group", "records", "workers", "elastic", "bsp", "parameter_server", "asp", "launch")
    }


@pytest.mark.parametrize("path", ALL, ids=lambda p: module_name(p))
def test_no_module_imports_a_private_name_of_another(path: Path) -> None:
    assert private_imports(path) == []


def test_no_import_cycle_when_modules_load() -> None:
    assert cycles(import_graph(ALL, lazy=False)) == []


KNOWN_CIRCLES: list[list[str]] = []
"""Today's import circles in ``src/`` (lazy imports included), each as the sorted modules of one: none.
This list may only shrink; a new circle fails :func:`test_no_new_import_circle_in_src_even_lazily`."""


def test_no_new_import_circle_in_src_even_lazily() -> None:
    """Lazy imports (inside functions) and a registry's named ones hide a circle from Python, not from the reader."""
    assert {module_name(p) for p in ALL} >= {"fedweave.nodes.server", "fedweave.reach", "fedweave.rules",
                                              "fedweave.config.loading", "fedweave.observe.loggers"}
    found = cycles(src_graph())
    assert [c for c in found if c not in KNOWN_CIRCLES] == [], "a new import circle"
    assert [c for c in KNOWN_CIRCLES if c not in found] == [], "a circle is gone: drop it from KNOWN_CIRCLES"


# --------------------------------------------------------------------------- the config loader

LOADER = ("fedweave.config.loading", "fedweave.rules", "fedweave.api")
"""The config loader and what it runs: strategies and plugins get their settings (hyper-parameters, the
strategy context, a plugin's bound context) and never load or check a config themselves."""

LOADER_EDGES = {("fedweave.training", "fedweave.config.sections")}
"""Imports through which strategies and plugins reach the loader today, which may only go: local training
(the client halves', DP-SGD's) checks an instruction's keys against the ``local`` schema, and importing
``fedweave.config.sections`` runs the config package, which imports its loader."""


def runs_on_import(name: str, root: Path = PACKAGE_ROOT) -> list[str]:
    """The fedweave modules importing ``name`` runs: it and each package above it (``a.b.c``: ``a``, ``a.b``)."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:d]) for d in range(1, len(parts) + 1)) if source_of(p, root) is not None]


def loader_chain(start: str, graph: dict[str, set[str]], root: Path = PACKAGE_ROOT) -> list[str] | None:
    """The import path from ``start`` to the loader (:data:`LOADER`) not through :data:`LOADER_EDGES`; None if none."""
    chains = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(graph.get(module, ())):
            if (module, target) in LOADER_EDGES:
                continue
            for ran in runs_on_import(target, root):
                if ran in chains:
                    continue
                chains[ran] = [*chains[module], ran]
                if ran in LOADER:
                    return chains[ran]
                queue.append(ran)
    return None


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: module_name(p))
def test_strategies_and_plugins_never_reach_the_config_loader(path: Path) -> None:
    chain = loader_chain(module_name(path), src_graph())
    assert chain is None, "reaches the config loader: " + " -> ".join(chain or [])


def test_the_imports_allowed_to_reach_the_loader_are_still_there() -> None:
    graph = src_graph()
    assert [(a, b) for a, b in sorted(LOADER_EDGES) if b not in graph.get(a, set())] == [], "drop it from LOADER_EDGES"


def test_the_loader_check_follows_packages_lazy_imports_and_registries_not_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "fedweave"
    for sub in ("strategies", "config"):
        (package / sub).mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "rules.py": "",
        "config/__init__.py": "from fedweave.config.loading import load\n",
        "config/loading.py": "",
        "config/sections.py": "",
        "strategies/__init__.py": "NAMED = 'fedweave.strategies.named:Named'\n",
        "strategies/schema.py": "from fedweave.config.sections import LocalConfig\n",
        "strategies/lazy.py": "def f():\n    from fedweave import rules\n",
        "strategies/named.py": "from fedweave.config import loading\n",
        "strategies/typed.py": "from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from fedweave.config import Config\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = import_graph(sorted(package.rglob("*.py")), tmp_path)
    chain = {n: loader_chain(f"fedweave.strategies.{n}", graph, tmp_path) for n in ("schema", "lazy", "typed")}
    assert chain["schema"] == ["fedweave.strategies.schema", "fedweave.config", "fedweave.config.loading"]
    assert chain["lazy"] == ["fedweave.strategies.lazy", "fedweave.rules"]
    assert chain["typed"] is None
    assert loader_chain("fedweave.strategies", graph, tmp_path) == [
        "fedweave.strategies", "fedweave.strategies.named", "fedweave.config.loading"]


def test_the_checks_see_private_names_and_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    package = tmp_path / "fedweave"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    sources = {
        "a.py": "from fedweave.sub import b\n",
        "sub/b.py": "def f():\n    from fedweave import c\n",
        "c.py": "from fedweave.a import _hidden, shown\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fedweave import a\n",
        "e.py": "NAMED = {'f': 'fedweave.f:F'}\n",
        "f.py": "from fedweave import e\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    paths = sorted(package.rglob("*.py"))
    assert cycles(import_graph(paths, tmp_path)) == [
        ["fedweave.a", "fedweave.c", "fedweave.sub.b"], ["fedweave.e", "fedweave.f"]]
    assert cycles(import_graph(paths, tmp_path, lazy=False)) == []
    assert import_graph(paths, tmp_path)["fedweave.d"] == set()
    assert private_imports(package / "c.py", tmp_path) == ["fedweave.a._hidden"]
    assert private_imports(package / "a.py", tmp_path) == []
