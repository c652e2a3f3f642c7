"""SecAgg's key derivation: HKDF-SHA256 as RFC 5869 defines it."""

from __future__ import annotations

from fedweave.plugins.secure.secagg import hkdf


def test_hkdf_is_rfc5869_sha256() -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    secret = bytes(range(32))
    ours = hkdf(secret, b"one", b"two")
    for info, key in zip((b"one", b"two"), ours):
        assert key == HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(secret)
    assert ours[0] != ours[1]
