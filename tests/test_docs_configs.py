"""Every full config shown in the docs loads, so a config on a page cannot rot.

A ```yaml block of a page under ``docs/`` is a full config when it is a mapping with a ``name``
(every config starts with one); it must pass :func:`fedweave.load_config`. A block of a site's own
settings (only keys of :data:`fedweave.nodes.client.SITE_KEYS`) must turn into overrides that the
page's last full config before it accepts, as ``fedweave client --site FILE`` applies them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import fedweave
from fedweave.nodes.client import SITE_KEYS, site_data, site_overrides

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
PAGES = sorted((ROOT / "docs").glob("*.md"))


def yaml_blocks(page: Path) -> list[object]:
    return [yaml.safe_load(block) for block in BLOCK.findall(page.read_text())]


def is_config(block: object) -> bool:
    return isinstance(block, dict) and "name" in block


def is_site_file(block: object) -> bool:
    return isinstance(block, dict) and bool(block) and set(block) <= set(SITE_KEYS)


def test_the_pages_show_configs_and_a_site_file() -> None:
    federation = yaml_blocks(ROOT / "docs" / "federation.md")
    assert sum(map(is_config, federation)) >= 2
    assert any(map(is_site_file, federation))


@pytest.mark.parametrize("page", [p for p in PAGES if any(map(is_config, yaml_blocks(p)))], ids=lambda p: p.name)
def test_every_full_config_loads(page: Path) -> None:
    for block in filter(is_config, yaml_blocks(page)):
        config = fedweave.load_config(block)
        assert config.name == block["name"]


@pytest.mark.parametrize("page", [p for p in PAGES if any(map(is_site_file, yaml_blocks(p)))], ids=lambda p: p.name)
def test_every_site_file_applies_to_the_config_before_it(page: Path, tmp_path: Path) -> None:
    config = None
    for block in yaml_blocks(page):
        if is_config(block):
            config = block
        elif is_site_file(block):
            assert config is not None, f"{page.name}: a site file before any config"
            site = tmp_path / "site.yaml"
            site.write_text(yaml.safe_dump(block))
            loaded = fedweave.load_config(config, site_overrides(site))
            if "data" in block:
                assert site_data(site) == str(tmp_path / block["data"])
            if "threads" in block:
                assert loaded.threads == block["threads"]
