"""A site that joins a federation once: ``fedweave federation join SITE.yaml``.

The site polls the federation (``Poll``, mutual TLS as ``site-<name>``) every ``poll_interval``
seconds, telling it where each of its jobs stands; the answer holds the jobs offered to it, the jobs
it is assigned (its client id, the job server's address, its token) and the jobs still live. An
unreachable federation (a network cut, a restart) is polled again after a bounded, growing wait; the
jobs' clients run on meanwhile, as they talk to the job's own server.

An offer is judged here, before anything of the job runs: the site's policy
(:meth:`fedweave.federation.policy.SitePolicy.check`) on the job's raw config, then its code bundle,
fetched and unpacked only if the policy lets it in, whose sha256 must be the submitted one
(:func:`fedweave.federation.bundle.unpack`), then the catalogue entry it reads
(:func:`fedweave.federation.catalog.resolve`). The answer is ``accepted`` or ``refused`` with the
rule's name. An assignment starts today's ``fedweave client`` for the site's id in the job's own
folder ``WORKDIR/<job>/``, reading only the catalogue entry's path (``--data``), on the site's device,
its token in the environment, the bundle on its ``PYTHONPATH``. A client whose job server moved (a
restarted federation) is started again at the new address. A job no longer live is stopped.
Every decision is appended to ``WORKDIR/audit.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedweave.errors import ConfigError, SerializationError
from fedweave.federation import protocol as fp
from fedweave.federation.audit import AuditLog
from fedweave.federation.bundle import BundleError, modules, unpack
from fedweave.federation.catalog import resolve
from fedweave.federation.config import SiteConfig
from fedweave.federation.policy import SHA256, Refusal
from fedweave.files import atomic_write_text
from fedweave.nodes.signals import PARENT_ENV
from fedweave.transports.grpc import certs
from fedweave.transports.grpc.protocol import TOKEN_ENV, grpc_module

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0
"""Seconds one call to the federation may take."""
STOP_GRACE = 5.0
"""Seconds a stopped job's client has to end after SIGTERM before it is killed."""


@dataclass
class _Job:
    """What this site knows of one job."""

    state: str  # accepted | refused | running | done | failed | stopped
    rule: str | None = None
    reason: str | None = None
    code: Path | None = None
    data: Path | None = None
    config: dict[str, Any] | None = None  # this site's config of the job (catalogue resolved)
    client: subprocess.Popen[bytes] | None = None
    address: str | None = None  # the job server the client was started for
    starts: int = 0  # clients started for that address
    reported: bool = False  # an ended job whose last state the federation has heard
    extra: dict[str, Any] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return {"state": self.state, "rule": self.rule, "reason": self.reason}


class SiteAgent:
    """Site ``config.name``'s side of the federation: :meth:`run` polls until ``stop`` is set."""

    def __init__(self, config: SiteConfig):
        self.config = config
        self.work = Path(config.workdir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.audit = AuditLog(self.work / "audit.jsonl")
        self._jobs: dict[str, _Job] = {}
        self._channel = fp.channel(config.server, config.credentials, "site", config.name, fp.message_limit(1024))
        self.connected = False
        self._error: str | None = None  # the last failure logged

    def run(self, stop: threading.Event) -> None:
        """Poll the federation and carry out its answers until ``stop`` is set; then stop every client."""
        grpc = grpc_module()
        delay = self.config.poll_interval
        try:
            while not stop.is_set():
                try:
                    reply = self._poll()
                    if not self.connected:
                        log.info("site %s: connected to the federation at %s", self.config.name, self.config.server)
                    self.connected, self._error, delay = True, None, self.config.poll_interval
                    self._carry_out(reply)
                except (grpc.RpcError, SerializationError) as exc:  # away, or a malformed answer: try again later
                    why = _why(exc)
                    if why != self._error:
                        log.warning("site %s: the federation at %s: %s; retrying", self.config.name,
                                    self.config.server, why)
                    self.connected, self._error = False, why
                    delay = min(delay * 2, self.config.backoff_max)
                    self._reap()
                stop.wait(delay)
        finally:
            for job in self._jobs.values():
                self._stop_client(job)
            self._channel.close()

    def _poll(self) -> dict[str, Any]:
        self._reap()
        reports = {job: view.report() for job, view in self._jobs.items() if not view.reported}
        raw = fp.call(self._channel, fp.POLL, fp.encode_json({"jobs": reports}), CALL_TIMEOUT)
        reply = fp.decode(raw)
        for job, view in self._jobs.items():  # an ended job's last state has now reached the federation
            if job in reports and view.state in ("refused", "done", "failed", "stopped") and view.client is None:
                view.reported = True
        return reply

    def _carry_out(self, reply: dict[str, Any]) -> None:
        active = {fp.check_job_id(j) for j in reply.get("active", [])}
        for offer in reply.get("offers", []):
            job = fp.check_job_id(offer.get("job"))
            if job not in self._jobs:
                self._jobs[job] = self._judge(job, offer.get("config"), offer.get("bundle_sha256"))
        for assignment in reply.get("assignments", []):
            self._assigned(assignment)
        for job, view in self._jobs.items():
            if job not in active and view.state in ("accepted", "running"):
                self._stop_client(view)
                view.state = "done" if view.extra.get("exit") == 0 else "stopped"
                view.reported = False
                self.audit.append("stopped", job=job, state=view.state)
                log.info("site %s: %s is no longer live here (%s)", self.config.name, job, view.state)

    # ------------------------------------------------------------------ offers

    def _judge(self, job: str, config: Any, sha: Any) -> _Job:
        """Accept or refuse an offer, and say so in the audit log."""
        digest = fp.config_digest(config) if isinstance(config, dict) else None
        self.audit.append("offered", job=job, config_sha256=digest, bundle_sha256=sha)
        refusal, view = self._check(job, config, sha)
        if refusal is not None:
            view = _Job("refused", refusal.rule, refusal.reason)
            self.audit.append("refused", job=job, rule=refusal.rule, reason=refusal.reason)
            log.info("site %s refuses %s (%s): %s", self.config.name, job, refusal.rule, refusal.reason)
        else:
            self.audit.append("accepted", job=job, config_sha256=digest, bundle_sha256=sha,
                              data=view.data.name if view.data else None)
            log.info("site %s accepts %s", self.config.name, job)
        return view

    def _check(self, job: str, config: Any, sha: Any) -> tuple[Refusal | None, _Job]:
        view = _Job("accepted")
        if not isinstance(config, dict):
            return Refusal("offer", "the offer carries no config mapping"), view
        if sha is not None and not (isinstance(sha, str) and SHA256.fullmatch(sha)):
            return Refusal("bundle", "the offer's bundle_sha256 is not a sha256"), view
        policy = self.config.parsed_policy
        refusal = policy.check(config, sha)
        if refusal is not None:
            return refusal, view
        folder = self.work / job
        if sha is not None:
            try:
                data = fp.call(self._channel, fp.BUNDLE, fp.encode_json({"job": job}), CALL_TIMEOUT * 6)
                shutil.rmtree(folder / "code", ignore_errors=True)
                view.code = unpack(data, sha, folder / "code")
            except BundleError as exc:
                return Refusal("bundle", str(exc)), view
            refusal = policy.check(config, sha, bundle_modules=modules(view.code))
            if refusal is not None:
                return refusal, view
            self.audit.append("bundle_verified", job=job, bundle_sha256=sha)
        try:
            view.config, view.data = resolve(config, self.config.parsed_catalog)
        except ConfigError as exc:
            return Refusal("catalog", str(exc)), view
        return None, view

    # ------------------------------------------------------------------ clients

    def _assigned(self, assignment: dict[str, Any]) -> None:
        job = fp.check_job_id(assignment.get("job"))
        view = self._jobs.get(job)
        if view is None:  # this site restarted since it accepted: judge the job again
            view = self._jobs[job] = self._judge(job, assignment.get("config"), assignment.get("bundle_sha256"))
        if view.state == "refused":
            return
        cid, clients, address, token = (assignment.get(k) for k in ("client_id", "clients", "address", "token"))
        if not (isinstance(cid, int) and isinstance(clients, int) and 0 <= cid < clients <= 10_000
                and isinstance(address, str) and isinstance(token, str)):
            log.warning("site %s: a malformed assignment of %s, ignored", self.config.name, job)
            return
        if view.address != address:  # a new job server (the first, or after a restart of the federation)
            self._stop_client(view)
            view.address, view.starts = address, 0
            view.extra.pop("exit", None)  # how the client of the old one ended says nothing of this one
        if view.client is None and view.starts < self.config.max_client_starts and view.extra.get("exit") != 0:
            self._start_client(job, view, cid, clients, address, certs.check_token(token, f"the token of {job}"))
        elif view.client is None and view.extra.get("exit") not in (None, 0):
            view.state = "failed"

    def _start_client(self, job: str, view: _Job, cid: int, clients: int, address: str, token: str) -> None:
        assert view.config is not None and view.data is not None
        folder = self.work / job
        creds = folder / "credentials"
        creds.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(self.config.credentials) / certs.CA_CERT, creds / certs.CA_CERT)
        config = dict(view.config)
        grpc = {k: v for k, v in dict(config.get("grpc") or {}).items() if k not in ("listen", "health_listen")}
        grpc.update(tls="tls", credentials=str(creds), tokens=True)
        config.update(clients=clients, transport="grpc", grpc=grpc)
        if self.config.threads is not None:
            config["threads"] = self.config.threads
        atomic_write_text(yaml.safe_dump(config, sort_keys=False), folder / "client.yaml")
        command = [sys.executable, "-m", "fedweave", "client", str(folder / "client.yaml"), "--id", str(cid),
                   "--address", address, "--data", str(view.data)]
        if self.config.device is not None:
            command += ["--device", self.config.device]
        env = {**os.environ, TOKEN_ENV: token, PARENT_ENV: str(os.getpid())}
        if view.code is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(view.code), env.get("PYTHONPATH")) if p)
        with open(folder / "client.log", "ab") as out:
            view.client = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env, cwd=folder)
        view.starts += 1
        view.state, view.reported = "running", False
        view.extra.pop("exit", None)
        self.audit.append("client_started", job=job, client_id=cid, address=address, start=view.starts)
        log.info("site %s: client %d of %s started for %s", self.config.name, cid, job, address)

    def _reap(self) -> None:
        for job, view in self._jobs.items():
            if view.client is not None and view.client.poll() is not None:
                code = view.client.returncode
                view.client, view.extra["exit"] = None, code
                self.audit.append("client_ended", job=job, exit_code=code)
                log.info("site %s: the client of %s ended (exit %d)", self.config.name, job, code)
                if code == 0:
                    view.state, view.reported = "done", False

    def _stop_client(self, view: _Job) -> None:
        proc = view.client
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_GRACE)
        view.client, view.extra["exit"] = None, proc.returncode


def _why(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{getattr(code(), 'name', code())}: {details()}"
    return str(exc)


def join(config: SiteConfig, stop: threading.Event | None = None) -> None:
    """Join the federation of ``config`` and serve it until ``stop`` is set (or SIGTERM / Ctrl-C)."""
    grpc_module()
    log.info("site %s joining %s (catalogue: %s; policy: %s)", config.name, config.server,
             ", ".join(config.parsed_catalog.names()), json.dumps(config.parsed_policy.describe()))
    SiteAgent(config).run(stop or threading.Event())

