"""The federation's files (examples/federation/), checked at load with one line naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from fedweave.errors import ConfigError
from fedweave.federation.config import load_admin, load_federation, load_site
from fedweave.federation.service import server_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "federation"


def test_the_example_federation_file_loads_with_its_paths_made_the_files_folders() -> None:
    fed = load_federation(EXAMPLES / "FED.yaml")
    assert fed.sites == ["alpha", "beta", "gamma"] and fed.admins == ["ada"] and fed.max_concurrent_jobs == 1
    assert fed.store == str(EXAMPLES / "jobs") and fed.credentials == str(EXAMPLES / "certs")
    assert fed.host == "127.0.0.1" and fed.ports is None


def test_job_ports_name_the_range_jobs_bind_and_the_host_sites_dial(tmp_path: Path) -> None:
    data = yaml.safe_load((EXAMPLES / "FED.yaml").read_text()) | {
        "job_ports": "7400-7402", "listen": "0.0.0.0:7300", "job_host": "fed-server"}
    (tmp_path / "FED.yaml").write_text(yaml.safe_dump(data))
    fed = load_federation(tmp_path / "FED.yaml")
    assert fed.ports == range(7400, 7403) and fed.host == "fed-server" and fed.job_bind_host == "0.0.0.0"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sites": ["alpha", "Beta"]}, "config key 'sites[1]': 'Beta' is not a name"),
        ({"admins": ["ada", "ada"]}, "config key 'admins': a name is listed twice"),
        ({"address": "nowhere"}, "config key 'address': expected host:port"),
        ({"max_concurrent_jobs": 0}, "max_concurrent_jobs"),
        ({"queue": 3}, "queue"),
        ({"sites": []}, "config key 'sites': name at least one site"),
        ({"job_ports": "7400"}, "config key 'job_ports': expected LOW-HIGH"),
        ({"job_ports": "7400-70000"}, "config key 'job_ports': ports lie in 1-65535"),
        ({"job_ports": "7409-7400"}, "config key 'job_ports': LOW is at most HIGH"),
        ({"job_ports": 7400}, "config key 'job_ports'"),
        ({"job_ports": "7290-7310"}, "config key 'job_ports': 7290-7310 holds port 7300 of 127.0.0.1:7300"),
        ({"job_ports": "7400-7401", "max_concurrent_jobs": 3},
         "config key 'job_ports': 7400-7401 has 2 ports, fewer than max_concurrent_jobs=3"),
    ],
)
def test_a_wrong_federation_key_is_named(tmp_path: Path, change: dict, message: str) -> None:
    data = yaml.safe_load((EXAMPLES / "FED.yaml").read_text()) | change
    (tmp_path / "FED.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_federation(tmp_path / "FED.yaml")


def test_the_example_site_file_loads_its_catalogue_and_policy(tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "SITE.yaml", tmp_path / "SITE.yaml")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "alpha.csv").write_text("f0,label\n0.5,1\n")
    site = load_site(tmp_path / "SITE.yaml")
    assert site.name == "alpha" and site.workdir == str(tmp_path / "work-alpha") and site.device == "cpu"
    assert site.parsed_catalog.names() == ["digits"]
    assert site.parsed_policy.describe()["strategies"] == ["fedavg", "fedprox"]
    data = yaml.safe_load((EXAMPLES / "SITE.yaml").read_text())
    data["policy"]["catalog"] = ["digit"]
    (tmp_path / "SITE.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"config key 'policy.catalog\[0\]': 'digit' is not an entry"):
        load_site(tmp_path / "SITE.yaml")


def test_an_admin_file_needs_its_three_keys(tmp_path: Path) -> None:
    (tmp_path / "admin.yaml").write_text("federation: 127.0.0.1:7300\ncredentials: certs\nname: ada\n")
    assert load_admin(tmp_path / "admin.yaml").credentials == str(tmp_path / "certs")
    (tmp_path / "admin.yaml").write_text("federation: 127.0.0.1:7300\ncredentials: certs\n")
    with pytest.raises(ConfigError, match="config key 'name' is required"):
        load_admin(tmp_path / "admin.yaml")


def test_a_jobs_server_reads_no_site_data_and_serves_the_accepting_sites_over_tls_with_tokens(tmp_path: Path) -> None:
    job = yaml.safe_load((EXAMPLES / "JOB.yaml").read_text()) | {"grpc": {"listen": "0.0.0.0:1", "join_timeout": 9}}
    config = server_config(job, 2, tmp_path)
    assert config["clients"] == 2 and config["transport"] == "grpc"
    assert config["grpc"] == {"join_timeout": 9, "tls": "tls", "credentials": str(tmp_path), "tokens": True}
    assert config["task"]["dataset"] == "files" and "path" not in config["task"]["dataset_options"]
    assert job["task"]["dataset_options"]["path"] == "catalog:digits"  # the submitted config is untouched
    shorthand = job | {"task": {"dataset": "catalog:digits", "dataset_options": {"num_classes": 10}}}
    assert server_config(shorthand, 3, tmp_path)["task"]["dataset"] == "files"
