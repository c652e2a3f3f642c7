"""A site's catalogue: entries loaded against the site file's folder, and jobs resolved to this site's data."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedweave.errors import ConfigError
from fedweave.federation.catalog import (
    Catalog,
    CatalogEntry,
    catalog_reference,
    resolve,
)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cardiology.csv").write_text("a,b,outcome\n1,2,0\n")
    (tmp_path / "images").mkdir()
    return tmp_path


def test_relative_paths_are_the_site_files_folder(site: Path):
    catalog = Catalog.from_dict(
        {"cardiology": {"path": "data/cardiology.csv", "format": "csv", "label": "outcome", "features": ["a", "b"]},
         "scans": {"path": str(site / "images"), "format": "imagefolder"}},
        base=site,
    )
    assert catalog.names() == ["cardiology", "scans"]
    assert catalog.entry("cardiology") == CatalogEntry(
        "cardiology", str(site / "data" / "cardiology.csv"), "csv", {"label": "outcome", "features": ["a", "b"]}
    )
    assert catalog.entry("scans").path == str(site / "images")
    assert catalog.describe() == {"cardiology": {"format": "csv"}, "scans": {"format": "imagefolder"}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"x": {"path": "data/none.csv", "label": "y"}}, "config key 'site.catalog.x.path': no such file or folder"),
        ({"x": {"format": "csv", "label": "y"}}, "config key 'site.catalog.x.path' is required"),
        ({"x": {"path": None, "label": "y"}}, "config key 'site.catalog.x.path' is required"),
        ({"x": {"path": 5}}, "config key 'site.catalog.x.path': expected a string"),
        ({"x": {"path": "data/cardiology.csv", "format": "xls"}}, "config key 'site.catalog.x.format'"),
        ({"x": {"path": "data/cardiology.csv", "format": "csv"}}, "config key 'site.catalog.x.label'"),
        ({"x": {"path": "data/cardiology.csv", "num_classes": 2}}, "unknown config key 'site.catalog.x.num_classes'"),
        ({"x": {"path": "data/cardiology.csv", "test_path": "t.csv"}}, "unknown config key 'site.catalog.x.test_path'"),
        ({"../x": {"path": "data/cardiology.csv"}}, "config key 'site.catalog.../x': an entry name"),
        ({"x": "data/cardiology.csv"}, "config key 'site.catalog.x': expected a mapping"),
        (["x"], "config key 'site.catalog': expected a mapping"),
    ],
)
def test_load_errors_name_the_entry(site: Path, data, message):
    with pytest.raises(ConfigError) as error:
        Catalog.from_dict(data, key="site.catalog", base=site)
    assert message in str(error.value)


def test_catalog_reference_long_form_and_shorthand():
    assert catalog_reference({"task": {"dataset": "files", "dataset_options": {"path": "catalog:cardio"}}}) == "cardio"
    assert catalog_reference({"task": {"dataset": "catalog:cardio"}}) == "cardio"
    assert catalog_reference({"task": {"dataset": "files", "dataset_options": {"path": "/data/x.csv"}}}) is None
    assert catalog_reference({"task": {"dataset": "digits"}}) is None
    assert catalog_reference({}) is None


def test_resolve_the_site_owns_its_layout_the_job_its_model(site: Path):
    catalog = Catalog.from_dict(
        {"cardiology": {"path": "data/cardiology.csv", "format": "csv", "label": "outcome"}}, base=site
    )
    job = {
        "rounds": 3,
        "task": {"dataset": "files", "model": "mlp", "dataset_options": {
            "path": "catalog:cardiology", "label": "target", "num_classes": 2, "input_shape": [2],
            "test_path": "/server/test.csv", "share_label_counts": True}},
    }
    config, data = resolve(job, catalog)
    assert data == site / "data" / "cardiology.csv"
    assert config["rounds"] == 3 and config["task"]["model"] == "mlp"
    # the entry's label and format; the job's model keys; no path, no test_path, no label counts the site did not allow
    assert config["task"]["dataset_options"] == {"num_classes": 2, "input_shape": [2], "format": "csv", "label": "outcome"}
    assert job["task"]["dataset_options"]["label"] == "target"  # the job itself is left as it was


def test_resolve_shorthand(site: Path):
    catalog = Catalog.from_dict({"c": {"path": "data/cardiology.csv", "label": "outcome"}}, base=site)
    config, data = resolve({"task": {"dataset": "catalog:c"}}, catalog)
    assert config["task"] == {"dataset": "files", "dataset_options": {"label": "outcome"}}
    assert data == site / "data" / "cardiology.csv"


def test_resolve_unknown_entry_and_no_entry(site: Path):
    catalog = Catalog.from_dict({"c": {"path": "data/cardiology.csv", "label": "outcome"}}, base=site)
    with pytest.raises(ConfigError, match="catalogue entry 'oncology' is not at this site \\(entries: c\\)"):
        resolve({"task": {"dataset": "catalog:oncology"}}, catalog)
    with pytest.raises(ConfigError, match="reads no catalogue entry"):
        resolve({"task": {"dataset": "digits"}}, catalog)


def test_the_resolved_config_loads(site: Path):
    """What resolve gives is a config fedweave loads (a deployed site's: no path, its client reads --data)."""
    from fedweave.config import from_dict

    catalog = Catalog.from_dict({"c": {"path": "data/cardiology.csv", "format": "csv", "label": "outcome"}}, base=site)
    config, _ = resolve({"task": {"dataset": "catalog:c", "dataset_options": {"num_classes": 2, "input_shape": [2]}},
                         "transport": "grpc", "clients": 2}, catalog)
    loaded = from_dict(config)
    assert loaded.task.file_options().label == "outcome" and loaded.task.file_options().path is None
