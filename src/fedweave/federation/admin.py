"""An admin's calls to a federation: submit a job, list the jobs, show one, cancel it, read its log.

The admin is whoever holds an ``admin-<name>`` certificate of the federation's CA whose name
``FED.yaml`` lists; the federation reads that from the verified certificate (a site's certificate is
refused). Each call is one unary gRPC call (:mod:`fedweave.federation.protocol`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedweave.errors import FedweaveError
from fedweave.federation import protocol as fp
from fedweave.federation.bundle import digest, pack
from fedweave.federation.config import AdminConfig

CALL_TIMEOUT = 30.0


class FederationRefused(FedweaveError):
    """The federation refused an admin's call; the message is its reason."""


class Admin:
    """Calls of admin ``config.name`` (or of whatever identity ``role`` names: a site trying to submit)."""

    def __init__(self, config: AdminConfig, role: str = "admin"):
        self.config = config
        self._channel = fp.channel(config.federation, config.credentials, role, config.name, fp.message_limit(1024))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: bytes) -> dict[str, Any]:
        grpc = fp.grpc_module()
        try:
            return fp.decode(fp.call(self._channel, method, request, CALL_TIMEOUT))
        except grpc.RpcError as exc:
            code = exc.code()
            raise FederationRefused(f"federation {self.config.federation}: {getattr(code, 'name', code)}: "
                                    f"{exc.details()}") from None

    def submit(self, config: dict[str, Any], code: str | Path | None = None,
               bundle: tuple[bytes, str] | None = None) -> str:
        """Submit a job (its config as plain data, its code folder packed as its bundle); its id.
        ``bundle`` gives the bundle's bytes and the sha256 to claim for them instead (tests of a tampered one)."""
        if code is not None:
            data = pack(Path(code))
            bundle = (data, digest(data))
        body = {"config": config, "bundle_sha256": None if bundle is None else bundle[1]}
        return str(self._call(fp.SUBMIT, fp.pack_submit(body, None if bundle is None else bundle[0]))["job"])

    def jobs(self) -> dict[str, Any]:
        return self._call(fp.JOBS, fp.encode_json({}))

    def job(self, job: str) -> dict[str, Any]:
        return self._call(fp.JOB, fp.encode_json({"job": job}))

    def cancel(self, job: str) -> dict[str, Any]:
        return self._call(fp.CANCEL, fp.encode_json({"job": job}))

    def logs(self, job: str, tail: int = 65536) -> str:
        return str(self._call(fp.LOGS, fp.encode_json({"job": job, "tail": tail}))["server"])


def describe(record: dict[str, Any]) -> list[str]:
    """The lines of ``fedweave job ID``: state, rounds done, run folder, each site's part."""
    lines = [
        f"{record['id']}  {record['state']}  ({record.get('name') or 'unnamed'}, submitted by {record['submitted_by']})",
        f"rounds: {record.get('rounds_done', 0)} of {record.get('rounds') or '?'}",
        f"run folder: {record['run_dir']}",
    ]
    if record.get("bundle_sha256"):
        lines.append(f"code bundle: sha256 {record['bundle_sha256']}")
    if record.get("reason"):
        lines.append(f"reason: {record['reason']}")
    if record.get("sites"):
        lines.append("sites:")
        clients = record.get("clients") or {}
        for site in sorted(record["sites"]):
            entry = record["sites"][site]
            part = f"client {clients[site]}" if site in clients else ""
            why = f"{entry.get('rule')}: {entry.get('reason')}" if entry.get("rule") else (entry.get("reason") or "")
            lines.append(f"  {site:<16} {entry.get('state', '?'):<9} {part:<9} {why}".rstrip())
    return lines
