"""A site's data catalogue: names a job may read, mapped to the site's own files.

A site file's ``catalog`` section maps entry names to where the data is and how to read it::

    catalog:
      cardiology: {path: data/cardiology.parquet, format: parquet, label: outcome}

A job names the data by entry, never by path: ``task.dataset: files`` with
``task.dataset_options.path: catalog:cardiology``, or the shorthand ``task.dataset: catalog:cardiology``.
:func:`resolve` turns such a job into this site's config and the one path its client reads
(``--data``). The entry describes the site's files and wins for what it owns (:data:`SITE_OWNED`);
the job keeps the keys of the model it expects (:data:`JOB_OWNED`: classes, their count, the input
shape), which every site's data is then checked against.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedweave.errors import ConfigError
from fedweave.federation.policy import CATALOG_PREFIX, PLUGIN_PATH_PARAMS, SITE_PATH_KEYS
from fedweave.schema import parse, unknown_key

SITE_OWNED = ("format", "label", "features", "split", "share_label_counts")
"""Options an entry sets (besides ``path``): how the site's files are laid out, and whether their label
histograms may leave the site. A job's own values of these keys are replaced by the entry's."""

JOB_OWNED = ("num_classes", "input_shape", "classes")
"""Options a job keeps: the model every site's data must fit."""

ENTRY_NAME = re.compile(r"\w[\w.-]{0,99}")


@dataclass(frozen=True)
class CatalogEntry:
    """One named dataset of a site: its absolute ``path``, its ``format`` (None: from the path) and the
    other :data:`SITE_OWNED` options (label, features, split, share_label_counts)."""

    name: str
    path: str
    format: str | None
    options: Mapping[str, Any]


class Catalog:
    """The entries of a site's catalogue, by name."""

    def __init__(self, entries: Mapping[str, CatalogEntry]):
        self._entries = dict(entries)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, key: str = "catalog", base: Path | None = None) -> Catalog:
        """The catalogue of ``data`` (name -> {path, format, label, ...}); relative paths are ``base``'s
        (the site file's folder; None: the current folder). A path that does not exist is an error."""
        from fedweave.task.sources.options import FileOptions

        if data is None:
            return cls({})
        if not isinstance(data, Mapping):
            raise ConfigError(f"config key '{key}': expected a mapping of entry names, got {data!r}")
        entries = {}
        for name, spec in data.items():
            at = f"{key}.{name}"
            if not isinstance(name, str) or not ENTRY_NAME.fullmatch(name):
                raise ConfigError(
                    f"config key '{at}': an entry name takes letters, digits, '_', '.', '-' (first a letter, "
                    "digit or '_'; at most 100)"
                )
            if not isinstance(spec, Mapping):
                raise ConfigError(f"config key '{at}': expected a mapping of path, format, label, ..., got {spec!r}")
            for option in spec:
                if option != "path" and option not in SITE_OWNED:
                    raise unknown_key(at, str(option), ["path", *SITE_OWNED])
            options = parse(FileOptions, dict(spec), at)  # types, formats, label rules as task.dataset_options
            if options.path is None:
                raise ConfigError(f"config key '{at}.path' is required (the entry's file or folder)")
            path = Path(options.path)
            path = (path if path.is_absolute() else (base or Path.cwd()) / path).resolve()
            if not path.exists():
                raise ConfigError(f"config key '{at}.path': no such file or folder: {path}")
            entries[name] = CatalogEntry(
                name=name,
                path=str(path),
                format=options.format,
                options={option: spec[option] for option in SITE_OWNED if option != "format" and option in spec},
            )
        return cls(entries)

    def names(self) -> list[str]:
        """The entries' names, sorted."""
        return sorted(self._entries)

    def entry(self, name: str) -> CatalogEntry:
        """The entry ``name``; a ConfigError naming it when the catalogue has none."""
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"config key 'task.dataset_options.path': catalogue entry {name!r} is not at this site "
                f"(entries: {', '.join(self.names()) or 'none'})"
            ) from None

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each entry's name and format (never its path), for what a site tells its federation."""
        return {name: {"format": entry.format} for name, entry in sorted(self._entries.items())}


def catalog_reference(job: Mapping[str, Any]) -> str | None:
    """The catalogue entry ``job`` reads (``catalog:NAME`` as ``task.dataset`` or as
    ``task.dataset_options.path`` of ``task.dataset: files``), or None."""
    task = job.get("task") if isinstance(job, Mapping) else None
    if not isinstance(task, Mapping):
        return None
    dataset = task.get("dataset")
    if isinstance(dataset, str) and dataset.startswith(CATALOG_PREFIX):
        return dataset[len(CATALOG_PREFIX):]
    options = task.get("dataset_options")
    if dataset == "files" and isinstance(options, Mapping):
        path = options.get("path")
        if isinstance(path, str) and path.startswith(CATALOG_PREFIX):
            return path[len(CATALOG_PREFIX):]
    return None


def named_paths(job: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(key, value)`` of every path on the site ``job`` names besides its data (:data:`SITE_PATH_KEYS`, the
    built-in plugins' :data:`PLUGIN_PATH_PARAMS`); keys of another shape are the loader's to refuse."""
    found = []
    for dotted in SITE_PATH_KEYS:
        node: Any = job
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            found.append((dotted, node))
    plugins = job.get("plugins")
    for point, items in plugins.items() if isinstance(plugins, Mapping) else ():
        for i, item in enumerate(items if isinstance(items, list) else []):
            name = item.get("name") if isinstance(item, Mapping) else None
            if isinstance(name, str):
                found += [(f"plugins.{point}[{i}].{option}", item[option])
                          for option in PLUGIN_PATH_PARAMS.get(name, ()) if item.get(option) is not None]
    return found


def resolve(job: Mapping[str, Any], catalog: Catalog) -> tuple[dict[str, Any], Path]:
    """This site's config of ``job`` and the data its client reads (``--data``).

    The config reads ``task.dataset: files`` with the entry's :data:`SITE_OWNED` options in place of the
    job's, the job's :data:`JOB_OWNED` options kept, no ``path`` (the client's ``--data`` is the entry's)
    and no ``test_path`` (the central test set is the server's). A job naming another path on the site
    (:func:`named_paths`) is a ConfigError, as :meth:`~fedweave.federation.policy.SitePolicy.check` refuses it."""
    name = catalog_reference(job)
    if name is None:
        raise ConfigError(
            "config key 'task.dataset_options.path': the job reads no catalogue entry (catalog:NAME)"
        )
    paths = named_paths(job)
    if paths:
        raise ConfigError(
            f"config key {paths[0][0]!r}: a path on the site; a job names a site's data by catalogue entry, never a path"
        )
    entry = catalog.entry(name)
    config = copy.deepcopy(dict(job))
    task = dict(config["task"])
    given = task.get("dataset_options") or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"config key 'task.dataset_options': expected a mapping, got {given!r}")
    options = {key: given[key] for key in JOB_OWNED if key in given}
    options.update(entry.options)
    if entry.format is not None:
        options["format"] = entry.format
    task["dataset"] = "files"
    task["dataset_options"] = options
    config["task"] = task
    return config, Path(entry.path)
