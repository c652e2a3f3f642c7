"""The long-lived federation server: ``fedweave federation serve FED.yaml``.

One process holds the job store (:mod:`fedweave.federation.store`) and serves ``fedweave.v1.Jobs``
(:mod:`fedweave.federation.protocol`) and gRPC health on its address, behind mutual TLS. Its main
thread is the scheduler; the gRPC threads only read and update the store.

A job's life: an admin submits it (queued). When fewer than ``max_concurrent_jobs`` jobs are running
or being offered, the oldest queued job is offered to every site of ``FED.yaml``; each site judges it
by its own policy and answers accepted or refused (with the rule's name). Once every site answered,
or ``offer_timeout`` passed, the accepting sites, in name order, become the job's clients
0..k-1 (the job's ``clients`` is set to k): with k at least the job's ``min_clients`` the job runs,
else it ends refused. A running job is today's ``fedweave server`` in a child process, bound to a free
port on ``job_host`` (with ``job_ports``: the first free port of that range, no two running jobs sharing
one; while none is free the job waits, queued, and a resumed one waits running), its run folder in the
job store, over TLS with a fresh token per client that the service hands each site over its own
mutual-TLS channel; each site runs today's ``fedweave client`` for its id. The child dies with the
service (kill -9 too); a restarted service starts it again on the same run folder, which resumes after
its last checkpoint, at a new port that the sites learn from their next poll. Cancelling stops the
job's server (the sites' clients are told to stop) and frees its slot for the next job.

Every decision is appended to ``STORE/audit.jsonl`` (:class:`fedweave.federation.audit.AuditLog`).
"""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from fedweave.errors import SerializationError
from fedweave.federation import protocol as fp
from fedweave.federation.audit import AuditLog
from fedweave.federation.bundle import BundleError, unpack
from fedweave.federation.catalog import catalog_reference
from fedweave.federation.config import FederationConfig
from fedweave.federation.policy import SHA256
from fedweave.federation.ports import free_port
from fedweave.federation.store import AUDIT, ENDED, LOG, RUN, JobStore
from fedweave.files import atomic_write_bytes, atomic_write_text
from fedweave.nodes.signals import KILLED_WITH_ENV, PARENT_ENV
from fedweave.transports.grpc import certs
from fedweave.transports.grpc.health import Health
from fedweave.transports.grpc.protocol import grpc_module, identity

log = logging.getLogger(__name__)

SITE_STATES = ("accepted", "refused", "running", "done", "failed", "stopped")
"""What a site may report of a job (``offered`` and ``absent`` are the server's own)."""
MAX_TEXT = 2000
"""The longest rule or reason a site's report may carry."""
TICK = 0.2
"""Seconds between two passes of the scheduler."""
STOP_GRACE = 10.0
"""Seconds a cancelled job's server has to stop after SIGTERM before it is killed."""
LOCK_WAIT = 60.0
"""Seconds a restarted service waits for a dead job server's run folder to be free."""


def rounds_done(run_dir: Path) -> int:
    """The last round a run folder's metrics record (0: none yet)."""
    path = run_dir / "metrics.jsonl"
    done = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                value = json.loads(line).get("round")
            except (ValueError, AttributeError):
                continue  # a line being written
            if isinstance(value, int):
                done = max(done, value)
    return done


def server_config(job: dict[str, Any], clients: int, credentials: Path) -> dict[str, Any]:
    """The config of a job's server: its clients the accepting sites, its data none (each site reads
    its catalogue entry), gRPC over TLS with a token per client from ``credentials``."""
    config = copy.deepcopy(job)
    if catalog_reference(config) is not None:
        task = dict(config["task"])
        options = dict(task.get("dataset_options") or {})
        options.pop("path", None)
        task["dataset"], task["dataset_options"] = "files", options
        config["task"] = task
    grpc = {k: v for k, v in dict(config.get("grpc") or {}).items() if k not in ("listen", "health_listen")}
    grpc.update(tls="tls", credentials=str(credentials), tokens=True)
    config.update(clients=clients, transport="grpc", grpc=grpc)
    return config


class FederationServer:
    """The federation of ``config``: its gRPC service (started here) and its scheduler (:meth:`serve`)."""

    def __init__(self, config: FederationConfig):
        grpc = grpc_module()
        self.config = config
        self.store = JobStore(config.store)
        self.audit = AuditLog(self.store.folder / AUDIT)
        self._lock = threading.RLock()
        self._seen: dict[str, float] = {}  # site -> when it last polled (monotonic)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._tokens: dict[str, dict[str, str]] = {}  # job -> site -> its token for this start of the job
        self._waiting: dict[str, float] = {}  # job -> since when its run folder's lock is awaited
        self._ports: dict[str, int] = {}  # job -> its server's port of job_ports
        self._no_port: set[str] = set()  # jobs waiting for a free port of job_ports (logged once)
        self._started = time.monotonic()
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(self._handler(name), identity, identity)
            for name in (*fp.ADMIN_METHODS, *fp.SITE_METHODS)
        }
        limit = fp.message_limit(config.max_bundle_mb)
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
                   ("grpc.so_reuseport", 0)]
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=16, thread_name_prefix="fedweave-federation"),
            handlers=[grpc.method_handlers_generic_handler(fp.SERVICE, handlers)], options=options,
        )
        folder = Path(config.credentials)
        pair = (self._read(folder / certs.SERVER_KEY), self._read(folder / certs.SERVER_CERT))
        credentials = grpc.ssl_server_credentials(
            [pair], root_certificates=self._read(folder / certs.CA_CERT), require_client_auth=True
        )
        bind = config.listen or config.address
        try:
            port = self._server.add_secure_port(bind, credentials)
        except RuntimeError as exc:
            port = 0
            log.debug("bind failed: %s", exc)
        if not port:
            from fedweave.errors import TransportError

            raise TransportError(f"cannot listen on {bind} (config key 'listen' or 'address'; is it in use?)")
        self.address = f"{bind.rpartition(':')[0]}:{port}"
        self.health = Health(grpc, self._server, config.health_listen)
        self._recover()
        self._server.start()
        self.health.serving()
        log.info("federation listening on %s (mutual TLS; sites %s; admins %s); job store %s", self.address,
                 ", ".join(config.sites), ", ".join(config.admins), self.store.folder)

    @staticmethod
    def _read(path: Path) -> bytes:
        from fedweave.errors import ConfigError

        try:
            return path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"config key 'credentials': cannot read {str(path)!r} ({exc.strerror}); create the folder with "
                "`fedweave certs --out DIR --site-name NAME ... --admin NAME`"
            ) from None

    # ------------------------------------------------------------------ the scheduler

    def serve(self, stop: threading.Event) -> None:
        """Schedule jobs until ``stop`` is set, then stop serving (running jobs' servers end with it)."""
        try:
            while not stop.wait(TICK):
                self.tick()
        finally:
            self.close()

    def close(self) -> None:
        self.health.close()
        self._server.stop(grace=1.0).wait(timeout=5.0)
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def tick(self) -> None:
        """One pass: reap ended job servers, carry out cancellations, decide offers, offer the next job."""
        with self._lock:
            records = self.store.records()
        for record in records:
            state = record["state"]
            if state == "running":
                self._watch(record)
            elif state == "queued" and record["offered"] is not None:
                self._decide(record)
        with self._lock:
            records = self.store.records()
            busy = sum(r["state"] == "running" or (r["state"] == "queued" and r["offered"] is not None) for r in records)
            for record in records:
                if busy >= self.config.max_concurrent_jobs:
                    break
                if record["state"] == "queued" and record["offered"] is None:
                    self._offer(record["id"])
                    busy += 1

    def _offer(self, job: str) -> None:
        self.store.update(job, offered=time.time())
        for site in self.config.sites:
            self.store.set_site(job, site, state="offered", rule=None, reason=None)
        self.audit.append("offered", job=job, sites=list(self.config.sites))
        log.info("%s offered to %s", job, ", ".join(self.config.sites))

    def _decide(self, record: dict[str, Any]) -> None:
        job = record["id"]
        sites = record["sites"]
        answered = all(sites.get(s, {}).get("state") in ("accepted", "refused") for s in self.config.sites)
        if not answered and time.time() - record["offered"] < self.config.offer_timeout:
            return
        with self._lock:
            for site in self.config.sites:
                if sites.get(site, {}).get("state") == "offered":
                    self.store.set_site(job, site, state="absent", reason="no answer within offer_timeout")
                    self.audit.append("absent", job=job, site=site)
            accepted = sorted(s for s in self.config.sites if sites.get(s, {}).get("state") == "accepted")
            floor = self._min_clients(job)
            if len(accepted) < floor:
                refused = {s: sites[s].get("rule") for s in sorted(sites) if sites[s].get("state") == "refused"}
                reason = (f"{len(accepted)} of {len(self.config.sites)} sites accepted, fewer than min_clients={floor}"
                          + "".join(f"; {s} refused it ({rule})" for s, rule in refused.items()))
                self.store.update(job, state="refused", reason=reason)
                self.audit.append("refused", job=job, reason=reason, accepted=accepted)
                log.info("%s refused: %s", job, reason)
                return
            listen = self._listen(job)
            if listen is None:
                return  # it stays queued, its sites' answers kept, until a port of job_ports is free
            clients = {site: i for i, site in enumerate(accepted)}
            self.store.update(job, state="running", clients=clients, started_at=time.time())
            self.audit.append("started", job=job, clients=clients)
        self._launch(job, listen)

    def _listen(self, job: str) -> str | None:
        """The host:port ``job``'s server binds: a free port of ``job_ports`` (None: none is free now), or 0."""
        ports = self.config.ports
        if ports is None:
            return f"{self.config.host}:0"
        host = self.config.job_bind_host
        port = free_port(ports, host, {p for j, p in self._ports.items() if j != job})
        if port is None:
            if job not in self._no_port:
                self._no_port.add(job)
                log.info("%s waits: no port of job_ports %s is free on %s", job, self.config.job_ports, host)
            return None
        self._no_port.discard(job)
        self._ports[job] = port
        return f"{host}:{port}"

    def _min_clients(self, job: str) -> int:
        value = self.store.config(job).get("min_clients", 1)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1

    def _launch(self, job: str, listen: str) -> None:
        """Start (or start again, after a restart of the service) running ``job``'s server, bound to ``listen``."""
        record = self.store.get(job)
        assert record is not None
        folder = self.store.path(job)
        clients: dict[str, int] = record["clients"]
        creds = folder / "credentials"
        creds.mkdir(exist_ok=True)
        for name in (certs.CA_CERT, certs.SERVER_CERT, certs.SERVER_KEY):
            shutil.copyfile(Path(self.config.credentials) / name, creds / name)
        (creds / certs.SERVER_KEY).chmod(0o600)
        tokens = {site: secrets.token_hex(32) for site in clients}
        hashes = {str(cid): certs.hash_token(tokens[site]) for site, cid in clients.items()}
        atomic_write_text(json.dumps(hashes), creds / certs.TOKENS, private=True)
        # it dies with this process, kill -9 too (SIGKILL when the scheduler thread that starts it ends)
        env = {**{k: v for k, v in os.environ.items() if k != PARENT_ENV}, KILLED_WITH_ENV: str(os.getpid())}
        bundle = self.store.bundle(job)
        if bundle is not None:
            code = folder / "code"
            if not code.is_dir():
                try:
                    unpack(bundle, record["bundle_sha256"], code)
                except BundleError as exc:
                    self._end(job, "failed", f"its code bundle: {exc}")
                    return
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH")) if p)
        config = server_config(self.store.config(job), len(clients), creds)
        atomic_write_text(yaml.safe_dump(config, sort_keys=False), folder / "server.yaml")
        address_file = folder / "address"
        address_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "fedweave", "server", str(folder / "server.yaml"), "--run-dir",
                   str(folder / RUN), "--listen", listen, "--address-file", str(address_file), "-q"]
        with open(folder / LOG, "ab") as out:
            self._procs[job] = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=folder,
            )  # no preexec_fn: in a forked child of this gRPC server, gRPC's fork handlers may abort it (SIGABRT)
        with self._lock:
            self._tokens[job] = tokens
            self.store.update(job, address=None)
        log.info("%s: its server started (pid %d) for clients %s", job, self._procs[job].pid, clients)

    def _watch(self, record: dict[str, Any]) -> None:
        job = record["id"]
        proc = self._procs.get(job)
        if proc is None:  # a job the previous process of the service ran: start its server again
            if record["cancel_requested"]:
                self._end(job, "cancelled", f"cancelled by {record['cancel_requested']}")
            elif self._run_folder_free(job) and (listen := self._listen(job)) is not None:
                self.audit.append("resumed", job=job, rounds_done=rounds_done(self.store.path(job) / RUN))
                self._launch(job, listen)
            return
        code = proc.poll()
        if code is None:
            if record["address"] is None and (self.store.path(job) / "address").is_file():
                address = (self.store.path(job) / "address").read_text().strip()
                if address and job in self._ports:  # the sites dial job_host, not the host it binds
                    address = f"{self.config.host}:{self._ports[job]}"
                if address:
                    self.store.update(job, address=address)
                    log.info("%s: its server listens on %s", job, address)
            if record["cancel_requested"] and not record.get("stop_sent"):
                proc.send_signal(signal.SIGTERM)
                self.store.update(job, stop_sent=time.time())
            elif record.get("stop_sent") and time.time() - record["stop_sent"] > STOP_GRACE:
                proc.kill()
            return
        del self._procs[job]
        if record["cancel_requested"]:
            self._end(job, "cancelled", f"cancelled by {record['cancel_requested']}")
        elif code == 0:
            self._end(job, "finished", None)
        else:
            self._end(job, "failed", f"its server exited with {code}: {self._last_line(job)}")

    def _run_folder_free(self, job: str) -> bool:
        """Whether no process holds the job's run folder (a job server of a killed service may still be ending)."""
        lock = self.store.path(job) / RUN / "run.lock"
        if not lock.is_file():
            return True
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            since = self._waiting.setdefault(job, time.monotonic())
            if time.monotonic() - since > LOCK_WAIT:
                self._end(job, "failed", f"its run folder stayed locked by another process for {LOCK_WAIT:.0f} s")
            return False
        finally:
            os.close(fd)  # (releases the lock if taken)
        self._waiting.pop(job, None)
        return True

    def _last_line(self, job: str) -> str:
        path = self.store.path(job) / LOG
        lines = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
        return lines[-1][:500] if lines else "(no output)"

    def _end(self, job: str, state: str, reason: str | None) -> None:
        with self._lock:
            record = self.store.update(job, state=state, reason=reason, address=None, ended_at=time.time())
            self._tokens.pop(job, None)
            self._ports.pop(job, None)
            self._no_port.discard(job)
        done = rounds_done(self.store.path(job) / RUN)
        self.audit.append(state, job=job, reason=reason, rounds_done=done)
        log.info("%s %s after %d of %s rounds%s", job, state, done, record["rounds"], f": {reason}" if reason else "")

    def _recover(self) -> None:
        """After a restart: a job being offered is offered again from now (its sites' answers kept); a running
        job has no address until its server is started again."""
        for record in self.store.records():
            if record["state"] == "queued" and record["offered"] is not None:
                self.store.update(record["id"], offered=time.time())
        for record in self.store.records():
            if record["state"] == "running" and record["address"] is not None:
                self.store.update(record["id"], address=None)  # its server died with the previous process
        running = [r["id"] for r in self.store.records() if r["state"] == "running"]
        queued = [r["id"] for r in self.store.records() if r["state"] == "queued"]
        if running or queued:
            log.info("job store: running %s; queued %s", ", ".join(running) or "none", ", ".join(queued) or "none")

    # ------------------------------------------------------------------ RPC handlers

    def _handler(self, name: str) -> Callable[[bytes, Any], bytes]:
        method = getattr(self, f"_rpc_{name.lower()}")
        grpc = grpc_module()

        def handle(request: bytes, context: Any) -> bytes:
            who = self._caller(context, name)
            try:
                return method(request, who, context)
            except (SerializationError, ValueError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)[:MAX_TEXT])
                raise AssertionError("unreachable") from None

        return handle

    def _caller(self, context: Any, method: str) -> str:
        """The caller's name, its role checked against ``method``'s (else the call is refused with why)."""
        codes = grpc_module().StatusCode
        identity = fp.peer_identity(context)
        if identity is None:
            context.abort(codes.UNAUTHENTICATED, "the caller's certificate names no site-<name> or admin-<name>")
            raise AssertionError("unreachable")  # (abort raises)
        role, name = identity
        members = self.config.sites if role == "site" else self.config.admins
        if name not in members:
            why = f"{role} {name!r} is not a member of this federation (FED.yaml {role}s)"
            self.audit.append("denied", caller=f"{role}-{name}", method=method, reason=why)
            context.abort(codes.PERMISSION_DENIED, why)
        needed = fp.ROLE_OF[method]
        if role != needed:
            what = "only an admin may submit, cancel or read jobs" if needed == "admin" else "only a site may poll"
            why = f"{method}: {role} {name!r} may not call it; {what} (the role is its certificate's)"
            self.audit.append("denied", caller=f"{role}-{name}", method=method, reason=why)
            context.abort(codes.PERMISSION_DENIED, why)
        return name

    def _rpc_submit(self, request: bytes, who: str, context: Any) -> bytes:
        body, bundle = fp.unpack_submit(request)
        config, sha = body.get("config"), body.get("bundle_sha256")
        if not isinstance(config, dict):
            raise ValueError("a submission's config is a mapping of config keys")
        if (sha is None) != (bundle is None) or (sha is not None and not (isinstance(sha, str) and SHA256.fullmatch(sha))):
            raise ValueError("a submission's bundle_sha256 is the sha256 of its bundle, given with the bundle only")
        if bundle is not None and len(bundle) > self.config.max_bundle_mb * (1 << 20):
            raise ValueError(f"the code bundle is larger than max_bundle_mb={self.config.max_bundle_mb}")
        with self._lock:
            record = self.store.submit(config, bundle, sha, who)
        self.audit.append("submitted", job=record["id"], by=who, config_sha256=record["config_sha256"],
                          bundle_sha256=sha)
        log.info("%s submitted by %s", record["id"], who)
        return fp.encode_json({"job": record["id"]})

    def _rpc_jobs(self, request: bytes, who: str, context: Any) -> bytes:
        now = time.monotonic()
        with self._lock:
            jobs = [self._summary(r) for r in self.store.records()]
            sites = {s: {"online": s in self._seen and now - self._seen[s] <= self.config.site_timeout,
                         "last_poll_s": None if s not in self._seen else round(now - self._seen[s], 1)}
                     for s in self.config.sites}
        return fp.encode_json({"jobs": jobs, "sites": sites})

    def _summary(self, record: dict[str, Any]) -> dict[str, Any]:
        keys = ("id", "name", "state", "submitted_by", "rounds", "reason")
        return {**{k: record.get(k) for k in keys}, "rounds_done": rounds_done(Path(record["run_dir"]))}

    def _record(self, request: bytes) -> dict[str, Any]:
        job = fp.check_job_id(fp.decode(request).get("job"))
        record = self.store.get(job)
        if record is None:
            raise ValueError(f"no job {job} in this federation")
        return record

    def _rpc_job(self, request: bytes, who: str, context: Any) -> bytes:
        record = self._record(request)
        return fp.encode_json({**record, "rounds_done": rounds_done(Path(record["run_dir"]))})

    def _rpc_cancel(self, request: bytes, who: str, context: Any) -> bytes:
        record = self._record(request)
        job = record["id"]
        with self._lock:
            record = self.store.get(job) or record
            if record["state"] in ENDED:
                raise ValueError(f"{job} is {record['state']} already")
            self.audit.append("cancel", job=job, by=who, state=record["state"])
            if record["state"] == "queued":
                record = self.store.update(job, cancel_requested=who)
                self._end(job, "cancelled", f"cancelled by {who}")
            else:  # its server stops now (SIGTERM: it tells its clients to stop); the scheduler reaps it
                record = self.store.update(job, cancel_requested=who, stop_sent=time.time())
                proc = self._procs.get(job)
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        return fp.encode_json({**(self.store.get(job) or record), "rounds_done": rounds_done(Path(record["run_dir"]))})

    def _rpc_logs(self, request: bytes, who: str, context: Any) -> bytes:
        body = fp.decode(request)
        record = self._record(request)
        tail = body.get("tail", 65536)
        tail = tail if isinstance(tail, int) and 0 < tail <= 1 << 20 else 65536
        path = self.store.path(record["id"]) / LOG
        data = b""
        if path.is_file():
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - tail))
                data = f.read()
        return fp.encode_json({"job": record["id"], "server": data.decode(errors="replace")})

    def _rpc_poll(self, request: bytes, site: str, context: Any) -> bytes:
        reports = fp.decode(request).get("jobs", {})
        if not isinstance(reports, dict) or len(reports) > 1000:
            raise ValueError("a poll's jobs is a mapping of at most 1000 job ids to reports")
        with self._lock:
            self._seen[site] = time.monotonic()
            for job, report in reports.items():
                self._apply(site, fp.check_job_id(job), report)
            offers, assignments, active = [], [], []
            for record in self.store.records():
                job, state = record["id"], record["state"]
                mine = record["sites"].get(site, {})
                if state == "queued" and record["offered"] is not None and site in record["sites"]:
                    active.append(job)
                    if mine.get("state") == "offered":
                        offers.append({"job": job, "config": self.store.config(job),
                                       "bundle_sha256": record["bundle_sha256"]})
                elif state == "running" and site in record["clients"]:
                    active.append(job)
                    token = self._tokens.get(job, {}).get(site)
                    if record["address"] is not None and token is not None:
                        assignments.append({
                            "job": job, "client_id": record["clients"][site], "clients": len(record["clients"]),
                            "address": record["address"], "token": token, "config": self.store.config(job),
                            "bundle_sha256": record["bundle_sha256"],
                        })
        return fp.encode_json({"offers": offers, "assignments": assignments, "active": active})

    def _rpc_bundle(self, request: bytes, site: str, context: Any) -> bytes:
        record = self._record(request)
        if site not in record["sites"] or record["state"] not in ("queued", "running"):
            context.abort(grpc_module().StatusCode.PERMISSION_DENIED,
                          f"{record['id']} is not offered to site {site!r}: its bundle is not yours to read")
        return self.store.bundle(record["id"]) or b""

    def _apply(self, site: str, job: str, report: Any) -> None:
        """A site's report of ``job``, where it may make it: an answer to an offer, or its client's state."""
        if not isinstance(report, dict) or report.get("state") not in SITE_STATES:
            raise ValueError(f"a report of {job} names no state of {', '.join(SITE_STATES)}")
        state = report["state"]
        rule, reason = report.get("rule"), report.get("reason")
        for value in (rule, reason):
            if value is not None and (not isinstance(value, str) or len(value) > MAX_TEXT):
                raise ValueError(f"a report's rule and reason are strings of at most {MAX_TEXT} characters")
        record = self.store.get(job)
        if record is None or site not in record["sites"]:
            return
        current = record["sites"][site].get("state")
        if state in ("accepted", "refused"):
            if record["state"] == "queued" and current == "offered":
                self.store.set_site(job, site, state=state, rule=rule, reason=reason)
                self.audit.append(state, job=job, site=site, rule=rule, reason=reason)
                log.info("%s %s by %s%s", job, state, site, f" ({rule}: {reason})" if rule else "")
        elif site in record["clients"] and current != state and current not in ("refused",):
            self.store.set_site(job, site, state=state, reason=reason)
            self.audit.append(f"site_{state}", job=job, site=site, reason=reason)


def run_service(config: FederationConfig, stop: threading.Event | None = None,
                address_file: str | Path | None = None) -> None:
    """Serve the federation of ``config`` until ``stop`` is set (or SIGTERM / Ctrl-C)."""
    server = FederationServer(config)
    if address_file is not None:
        atomic_write_bytes((server.address + "\n").encode(), Path(address_file))
    server.serve(stop or threading.Event())

