"""Credentials of a gRPC federation: a CA, a server certificate, client certificates, tokens.

``fedweave certs --out DIR --clients N [--sites S]`` writes, into ``DIR``:

===========================  ====================================================
``ca.pem``                   the federation's certificate authority (every node)
``ca.key``                   its private key (keep it off the nodes)
``server.pem``/``server.key``  the server's certificate, valid for the given hosts
``client-<i>.pem``/``.key``  client ``i``'s certificate (common name ``client-<i>``)
``client-<i>.token``         client ``i``'s secret token (give it to that client only)
``site-<s>.pem``/``.key``    site ``s``'s leader certificate (common name ``site-<s>``)
``site-<s>.token``           site ``s``'s leader token
``tokens.json``              SHA-256 of every token (the server's copy): client ``i``
                             under ``"<i>"``, site ``s`` under ``"site-<s>"``
``site-<name>.pem``/``.key``  a named site of a long-lived federation (``--site-name``)
``admin-<name>.pem``/``.key``  an admin of a long-lived federation (``--admin``)
===========================  ====================================================

The named identities are those of :mod:`fedweave.federation`: the certificate's common name says
both the role and the name (``site-alpha``, ``admin-ada``), and the federation server reads both from
the peer's verified certificate. A name starts with a lowercase letter, so a named site is never taken
for the numbered leader of a hierarchical deployment (``site-0``).

A site leader of a hierarchical gRPC deployment is one node for its whole site, so it
has credentials of its own, not its members'.

``fedweave certs`` refuses a folder that holds credentials already unless given ``--force``, and
even then while a run directory refers to them (:func:`fedweave.cli.keys.refuse_replacing`).

A config points ``grpc.credentials`` at such a folder; :mod:`fedweave.transports.grpc`
reads the files a node needs by these names. Keys and tokens are written readable by
their owner only.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from fedweave.errors import ConfigError
from fedweave.files import atomic_write_bytes

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
TOKENS = "tokens.json"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_NODES = 10_000
"""The most clients (and, apart, site leaders) one ``fedweave certs`` makes: a key pair and a signature
each, some milliseconds apiece; a federation of more makes its credentials in its own PKI."""
MAX_DAYS = 36_500
"""The longest validity (100 years; an X.509 date ends at 9999)."""


ROLES = ("site", "admin")
"""The roles of a named identity (:func:`identity_name`)."""
NAME = re.compile(r"[a-z][a-z0-9-]{0,39}")
"""A named identity's name: a lowercase letter, then up to 39 lowercase letters, digits and hyphens."""


def check_name(name: str, source: str) -> str:
    """``name`` if it may name a site or an admin (:data:`NAME`), else a ConfigError naming ``source``."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(
            f"{source}: {str(name)[:40]!r} is not a name (a lowercase letter, then up to 39 lowercase letters, "
            "digits and hyphens)"
        )
    return name


def identity_name(role: str, name: str) -> str:
    """The common name of a named identity's certificate (and the stem of its files): ``<role>-<name>``."""
    return f"{role}-{name}"


def parse_identity(common_name: str) -> tuple[str, str] | None:
    """The (role, name) a certificate's common name gives (:func:`identity_name`), or None."""
    role, _, name = common_name.partition("-")
    return (role, name) if role in ROLES and NAME.fullmatch(name) else None


def credential_files(folder: Path) -> list[Path]:
    """The files of a credentials folder that exist in ``folder``."""
    fixed = [folder / name for name in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY, TOKENS)]
    patterns = ("client-*", "site-*", "admin-*")
    nodes = sorted(p for pattern in patterns for p in folder.glob(pattern)) if folder.is_dir() else []
    return [p for p in fixed if p.is_file()] + [p for p in nodes if p.suffix in (".pem", ".key", ".token")]


def client_name(client_id: int) -> str:
    """The common name of client ``client_id``'s certificate (and the stem of its files)."""
    return f"client-{client_id}"


def site_name(site: int) -> str:
    """The common name of site ``site``'s leader certificate (and the stem of its files)."""
    return f"site-{site}"


def cert_file(name: str) -> str:
    return f"{name}.pem"


def key_file(name: str) -> str:
    return f"{name}.key"


def token_file(name: str) -> str:
    return f"{name}.token"


def token_entry(name: str) -> str:
    """The key of a node's token in tokens.json: a client's id alone, a site's name."""
    return name.removeprefix("client-") if name.startswith("client-") else name


def check_token(token: str, source: str) -> str:
    """``token`` if it is one line of printable ASCII (it travels in a gRPC header), else a
    ConfigError naming ``source`` (never the token itself)."""
    if not token or not token.isascii() or not token.isprintable():
        raise ConfigError(
            f"{source}: a token is one line of printable ASCII characters; this one is empty or holds "
            "a newline, a control or a non-ASCII character"
        )
    return token


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _crypto():  # type: ignore[no-untyped-def]
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ConfigError(
            "creating certificates needs the 'cryptography' package: pip install 'fedweave[grpc]'"
        ) from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _check_host(host: str) -> None:
    """A ConfigError unless ``host`` is an IP address or an ASCII DNS name (a certificate's SAN)."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.split(".")
    if host.isascii() and all(re.fullmatch(r"(\*|[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)", x) for x in labels):
        return
    hint = ""
    try:
        hint = f" (its ASCII form is {host.encode('idna').decode()!r})" if not host.isascii() else ""
    except UnicodeError:
        pass
    raise ConfigError(
        f"certs: --host {host!r} is neither an IP address nor a DNS name of ASCII letters, digits and "
        f"hyphens{hint}"
    )


def make_credentials(
    out: str | Path,
    clients: int,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = 365,
    sites: int = 0,
    *,
    site_names: Sequence[str] = (),
    admins: Sequence[str] = (),
) -> Path:
    """Write a CA, a server certificate for ``hosts``, a certificate and token for each of
    ``clients`` clients and ``sites`` site leaders, and a certificate for each named site and admin
    of a long-lived federation (``site-<name>``, ``admin-<name>``; no token: their identity is the
    certificate)."""
    named = [identity_name("site", check_name(n, "certs: --site-name")) for n in site_names]
    named += [identity_name("admin", check_name(n, "certs: --admin")) for n in admins]
    if len(set(named)) != len(named):
        raise ConfigError(f"certs: a name is given twice ({', '.join(sorted(n for n in named if named.count(n) > 1))})")
    least = 0 if named else 1
    if not least <= clients <= MAX_NODES:
        raise ConfigError(f"certs: --clients must lie in {least}..{MAX_NODES:,}, got {clients:,}")
    if len(named) > MAX_NODES:
        raise ConfigError(f"certs: at most {MAX_NODES:,} named sites and admins, got {len(named):,}")
    if not 0 <= sites <= MAX_NODES:
        raise ConfigError(f"certs: --sites must lie in 0..{MAX_NODES:,}, got {sites:,}")
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"certs: --days must lie in 1..{MAX_DAYS:,} (100 years), got {days:,}")
    for host in hosts:
        _check_host(host)
    x509, hashes, serialization, ec, eku, name_oid = _crypto()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def key_pem(key) -> bytes:  # type: ignore[no-untyped-def]
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def cert_pem(cert) -> bytes:  # type: ignore[no-untyped-def]
        return cert.public_bytes(serialization.Encoding.PEM)

    def subject(common_name: str):  # type: ignore[no-untyped-def]
        return x509.Name(
            [
                x509.NameAttribute(name_oid.ORGANIZATION_NAME, "fedweave"),
                x509.NameAttribute(name_oid.COMMON_NAME, common_name),
            ]
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = subject("fedweave federation CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name: str, usage, names: list) -> tuple[bytes, bytes]:  # type: ignore[no-untyped-def]
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject(common_name))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return cert_pem(builder.sign(ca_key, hashes.SHA256())), key_pem(key)

    alt_names = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    atomic_write_bytes(cert_pem(ca), out / CA_CERT)
    atomic_write_bytes(key_pem(ca_key), out / CA_KEY, private=True)
    server_cert, server_key = leaf(hosts[0] if hosts else "fedweave-server", eku.SERVER_AUTH, alt_names)
    atomic_write_bytes(server_cert, out / SERVER_CERT)
    atomic_write_bytes(server_key, out / SERVER_KEY, private=True)
    token_hashes = {}
    for name in [client_name(c) for c in range(clients)] + [site_name(s) for s in range(sites)]:
        cert, key = leaf(name, eku.CLIENT_AUTH, [x509.DNSName(name)])
        atomic_write_bytes(cert, out / cert_file(name))
        atomic_write_bytes(key, out / key_file(name), private=True)
        token = secrets.token_hex(32)
        atomic_write_bytes(token.encode(), out / token_file(name), private=True)
        token_hashes[token_entry(name)] = hash_token(token)
    for name in named:
        cert, key = leaf(name, eku.CLIENT_AUTH, [x509.DNSName(name)])
        atomic_write_bytes(cert, out / cert_file(name))
        atomic_write_bytes(key, out / key_file(name), private=True)
    atomic_write_bytes(json.dumps(token_hashes, indent=1).encode(), out / TOKENS, private=True)
    return out
