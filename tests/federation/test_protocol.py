"""The federation's wire: submissions and identities, malformed ones refused."""

from __future__ import annotations

import pytest

from fedweave.errors import SerializationError
from fedweave.federation import protocol as fp
from fedweave.transports.grpc.certs import parse_identity


def test_a_submission_carries_its_json_and_its_bundle() -> None:
    data = fp.pack_submit({"config": {"rounds": 2}, "bundle_sha256": "ab"}, b"\x00tar bytes")
    assert fp.unpack_submit(data) == ({"config": {"rounds": 2}, "bundle_sha256": "ab"}, b"\x00tar bytes")
    assert fp.unpack_submit(fp.pack_submit({"config": {}}, None)) == ({"config": {}}, None)


@pytest.mark.parametrize("data", [b"\x00\x00", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[]", b"\x00\x00\x00\x03{x}"])
def test_a_malformed_submission_is_refused(data: bytes) -> None:
    with pytest.raises(SerializationError):
        fp.unpack_submit(data)


def test_job_ids_and_identities() -> None:
    assert fp.check_job_id("job-0001") == "job-0001"
    for bad in ("job-1", "../job-0001", 7, None):
        with pytest.raises(SerializationError):
            fp.check_job_id(bad)
    assert parse_identity("admin-ada") == ("admin", "ada") and parse_identity("site-alpha") == ("site", "alpha")
    assert parse_identity("site-0") is None  # a hierarchical deployment's numbered site leader
    assert parse_identity("client-1") is None and parse_identity("admin-Ada") is None


def test_certs_names_a_federations_sites_and_admins_in_their_certificates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from fedweave.cli.main import main
    from fedweave.errors import ConfigError
    from fedweave.transports.grpc.certs import make_credentials

    assert main(["certs", "--out", str(tmp_path / "c"), "--site-name", "alpha", "--site-name", "beta",
                 "--admin", "ada"]) == 0
    for name in ("site-alpha", "site-beta", "admin-ada"):
        cert = x509.load_pem_x509_certificate((tmp_path / "c" / f"{name}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        assert (tmp_path / "c" / f"{name}.key").stat().st_mode & 0o077 == 0
    assert not list((tmp_path / "c").glob("*.token"))  # their identity is the certificate
    with pytest.raises(ConfigError, match=r"--clients must lie in 1\.\.10,000, got 0"):
        make_credentials(tmp_path / "d", 0)
    with pytest.raises(ConfigError, match="certs: --site-name: 'Alpha' is not a name"):
        make_credentials(tmp_path / "d", 0, site_names=["Alpha"])
    with pytest.raises(ConfigError, match=r"a name is given twice \(site-alpha"):
        make_credentials(tmp_path / "d", 0, site_names=["alpha", "alpha"])
