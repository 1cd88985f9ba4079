"""A PS shard process: the core, its ZeroMQ data loop, gRPC control + health, and metrics.

Built as create -> serve: :func:`create_server` binds every endpoint (port 0 = any free port) and
starts serving in background threads; :meth:`ServerShard.serve` blocks until :meth:`stop` (or a
signal, in ``ps.__main__``).

A shard is never a zombie: when one of its threads fails (a bug; bad requests get typed
errors), it logs a last line naming the thread and the error, turns its gRPC health
``NOT_SERVING`` and records :attr:`ServerShard.failure`; :meth:`~ServerShard.serve` then stops
and raises it, and ``bitps-server`` exits with status 1.

With ``checkpoint_dir`` the shard restores its newest valid checkpoint before it binds anything,
saves from the data loop every ``checkpoint_every_updates`` / ``checkpoint_every_s``, and writes
a final checkpoint in :meth:`ServerShard.stop` (SIGTERM), after answering its held pulls with
``SHUTTING_DOWN`` (docs/checkpoints.md).

With ``curve_secret_key`` the data plane is CURVE (``ps.data``), with ``tls_cert_file`` the gRPC
port takes TLS only (docs/security.md); their files are read before anything is bound or
restored, and a bad one is a ``KeyFileError`` naming it.

    >>> shard = create_server(ServerConfig(mode="sync"))   # doctest: +SKIP
    >>> shard.ports                                         # doctest: +SKIP
    {'grpc_port': 40123, 'data_port': 40124, 'metrics_port': 40125}
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from bitps.native.preload import preload
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.keys import KeyFileError, load_allowed_keys, load_key_pair, read_pem
from bitps.ps.checkpoint import Checkpoint, Checkpointer
from bitps.ps.config import ServerConfig
from bitps.ps.control import ControlServicer, TokenInterceptor
from bitps.ps.data import CurveServer, DataLoop
from bitps.ps.metrics import ShardMetrics
from bitps.ps.shard import ShardCore

__all__ = ["ServerShard", "ShardFailure", "create_server"]

log = logging.getLogger(__name__)
_GRPC_MAX_MESSAGE = 64 << 20
_POLL_S = 0.2  # how often serve() looks at exit_when_done


class ShardFailure(RuntimeError):
    """One of a shard's threads failed: ``thread`` names it, ``error`` is what it raised."""

    def __init__(self, thread: str, error: BaseException) -> None:
        self.thread, self.error = thread, error
        super().__init__(f"thread {thread} failed: {type(error).__name__}: {error}")


class ServerShard:
    """A running shard. ``core`` holds its state; ``ports`` its bound endpoints."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        # the key files first: a bad one refuses the start before any state is touched
        self.curve = _curve_keys(cfg)
        """The data plane's CURVE keys, or ``None``: plain ZeroMQ."""
        tls = _tls_credentials(cfg)
        self.metrics = ShardMetrics()
        self.core = ShardCore(cfg, metrics=self.metrics)
        self.failure: ShardFailure | None = None
        """Set when a thread of the shard failed; health is then NOT_SERVING."""
        self.checkpointer: Checkpointer | None = None
        """With ``checkpoint_dir``: what saves this shard (``ps.checkpoint``)."""
        self.restored: Checkpoint | None = None
        """The checkpoint restored at start, if any."""
        if cfg.checkpoint_dir:
            # before any endpoint is bound: nothing may see the shard before its state is back;
            # a directory that cannot be made fails here, not at the first save
            Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            self.checkpointer = Checkpointer(
                self.core, cfg.checkpoint_dir, keep=cfg.checkpoint_keep,
                every_updates=cfg.checkpoint_every_updates, every_s=cfg.checkpoint_every_s,
                background=not cfg.checkpoint_durable)
            self.restored = self.checkpointer.restore_latest()
            self._log_restored()
        self.data = DataLoop(self.core, host=cfg.host, port=cfg.data_port,
                             on_failure=self._fail,
                             after_request=None if self.checkpointer is None
                             else self.checkpointer.maybe_save, curve=self.curve)
        self._http = self._http_thread = None
        metrics_port = -1
        if cfg.metrics_port >= 0:
            self._http, self._http_thread = start_http_server(
                cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry)
            metrics_port = self._http.server_port
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="bitps-grpc"),
            options=[("grpc.max_receive_message_length", _GRPC_MAX_MESSAGE),
                     ("grpc.max_send_message_length", _GRPC_MAX_MESSAGE),
                     ("grpc.so_reuseport", 0)],
            interceptors=[TokenInterceptor(cfg.token)] if cfg.token else None)
        self.control = ControlServicer(self.core, data_port=self.data.port,
                                       metrics_port=metrics_port, curve=self.curve)
        pb_grpc.add_ControlServicer_to_server(self.control, self.grpc)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        address = f"{cfg.host}:{cfg.grpc_port}"
        grpc_port = (self.grpc.add_insecure_port(address) if tls is None
                     else self.grpc.add_secure_port(address, tls))
        if not grpc_port:
            raise OSError(f"cannot bind gRPC on {cfg.host}:{cfg.grpc_port}")
        self.ports = {"grpc_port": grpc_port, "data_port": self.data.port,
                      "metrics_port": metrics_port, "health_port": -1}
        self.health_grpc = None
        """The plaintext health-only gRPC server (``health_port``), or ``None``."""
        if cfg.health_port >= 0:
            self.health_grpc = grpc.server(
                futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="bitps-health"),
                options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_grpc)
            bound = self.health_grpc.add_insecure_port(f"{cfg.host}:{cfg.health_port}")
            if not bound:
                raise OSError(f"cannot bind the health port on {cfg.host}:{cfg.health_port}")
            self.ports["health_port"] = bound
        self._stopped = threading.Event()
        self._stopping = threading.Event()
        self._stop_requested = threading.Event()
        self._reload_requested = threading.Event()

    def start(self) -> ServerShard:
        preload()  # numba's set-up now, not inside the first push's update
        self.data.start()
        self.grpc.start()
        if self.health_grpc is not None:
            self.health_grpc.start()
        for service in ("", "bitps.Control"):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._supervise, name="bitps-supervisor", daemon=True).start()
        return self

    def _supervise(self) -> None:
        """The no-zombie rule for the thread no loop of ours runs, the Prometheus endpoint's
        (prometheus-client's ``serve_forever``): one that ends while the shard serves takes
        the shard down (:meth:`_fail`), as the data loop and ZAP threads do themselves."""
        thread = self._http_thread
        while thread is not None and not self._stopping.wait(_POLL_S):
            if not thread.is_alive() and not self._stopping.is_set():
                self._fail("metrics", RuntimeError(
                    f"the Prometheus endpoint's thread {thread.name} ended while the shard "
                    f"served (port {self.ports['metrics_port']})"))
                return

    def _fail(self, thread: str, error: BaseException) -> None:
        """A thread died of ``error``: say so last, stop reporting healthy, ask serve() to
        stop."""
        self.failure = ShardFailure(thread, error)
        log.error("shard %d: thread %s raised", self.cfg.shard_id, thread, exc_info=error)
        for service in ("", "bitps.Control"):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.critical("shard %d: %s; health NOT_SERVING, shutting down", self.cfg.shard_id,
                     self.failure)
        self._stop_requested.set()

    def _log_restored(self) -> None:
        core, ckpt = self.core, self.restored
        if ckpt is None:
            log.info("shard %d: no checkpoint in %s; starting fresh", self.cfg.shard_id,
                     self.cfg.checkpoint_dir)
            return
        clocks = {r: w.clock for r, w in sorted(core.clocks.workers.items())}
        log.info("shard %d restored %s: %d updates applied, %d keys, world size %d, clocks %s, "
                 "%d push ids in the exactly-once window", self.cfg.shard_id, ckpt.path,
                 ckpt.updates, len(core.slots), core.clocks.world_size, clocks,
                 sum(map(len, core.dedup.state_dict()["ids"].values())))

    def workers_done(self) -> bool:
        """Whether every rank of the registered world has registered and then left (never
        before a first registration): ``exit_when_done``'s condition."""
        with self.core.lock:
            c = self.core.clocks
            return bool(c.world_size) and len(c.workers) >= c.world_size and all(
                w.registered and w.left for w in c.workers.values())

    def ready_event(self) -> dict:
        """The JSON object printed on stdout once serving (launchers and tests read it)."""
        return {"event": "ready", "shard_id": self.cfg.shard_id, **self.ports}

    def request_stop(self) -> None:
        """Ask :meth:`serve` to return (safe from a signal handler: it only sets a flag)."""
        self._stop_requested.set()

    def request_reload(self) -> None:
        """Ask :meth:`serve` to :meth:`reload_keys` (SIGHUP's handler: it only sets a flag)."""
        self._reload_requested.set()

    def reload_keys(self) -> int | None:
        """Read ``curve_allowed_keys`` again and let exactly those clients' next handshakes
        in: a key added is allowed, a key removed refused from its next connection on (one
        made stays). Returns how many keys are allowed now; ``None`` (logged) without CURVE,
        or when the directory no longer reads (``KeyFileError``: the old set stays)."""
        zap, cfg = self.data.zap, self.cfg
        if zap is None:
            log.warning("shard %d: SIGHUP: no CURVE data plane, no keys to reload",
                        cfg.shard_id)
            return None
        try:
            allowed = load_allowed_keys(cfg.curve_allowed_keys)
        except KeyFileError as err:
            log.error("shard %d: allowed keys not reloaded, the %d before stay: %s",
                      cfg.shard_id, len(zap.allowed), err)
            return None
        before = len(zap.allowed)
        # both checks: Register's (a diagnosis, ps.control) and the handshake's (ZAP)
        self.curve = self.control.curve = dataclasses.replace(self.curve, allowed=allowed)
        zap.set_allowed(allowed)
        log.info("shard %d: reloaded %s: %d client keys allowed (%d before)", cfg.shard_id,
                 cfg.curve_allowed_keys, len(allowed), before)
        return len(allowed)

    def serve(self) -> None:
        """Block until :meth:`request_stop` or :meth:`stop` (or, with ``exit_when_done``, until
        :meth:`workers_done`), then stop; raises :class:`ShardFailure` when a thread of the
        shard failed."""
        while not (self._stop_requested.wait(_POLL_S) or self._stopped.is_set()):
            if self._reload_requested.is_set():
                self._reload_requested.clear()
                self.reload_keys()
            if self.cfg.exit_when_done and self.workers_done():
                log.info("shard %d: every worker has left; exiting (exit_when_done)",
                         self.cfg.shard_id)
                break
        self.stop()
        if self.failure is not None:
            raise self.failure

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, in an order that loses nothing: gRPC first (no registration or leave
        after the final checkpoint), then the data loop (held pulls get ``SHUTTING_DOWN``
        replies, then no more updates), then the final checkpoint with ``checkpoint_dir``."""
        if self._stopped.is_set():
            return
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.grpc.stop(grace_s).wait()
        if self.health_grpc is not None:
            self.health_grpc.stop(0).wait()
        self.data.stop()
        self.core.key_pool.close()
        self._final_checkpoint()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self._stopped.set()


    def _final_checkpoint(self) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        if self.failure is not None:
            # a thread died mid-request: its state may be half changed; keep the last good one
            ckpt.close()
            log.error("shard %d: no final checkpoint after a failure; the newest is %s",
                      self.cfg.shard_id, ckpt.last_path)
            return
        if not self.core.slots:
            ckpt.close()
            log.info("shard %d: no worker ever registered; no final checkpoint",
                     self.cfg.shard_id)
            return
        t0 = time.monotonic()
        try:
            path = ckpt.save_final()
        except OSError as err:  # a full disk: the shard exits with status 1, loudly
            self.failure = ShardFailure("final checkpoint", err)
            log.critical("shard %d: final checkpoint into %s failed: %s", self.cfg.shard_id,
                         ckpt.directory, err)
            return
        if path is None:
            log.info("shard %d: nothing changed since checkpoint %s; no final checkpoint",
                     self.cfg.shard_id, ckpt.last_path)
            return
        log.info("shard %d: final checkpoint %s (%d updates applied) in %.3f s",
                 self.cfg.shard_id, path, self.core.updates_applied, time.monotonic() - t0)


def _curve_keys(cfg: ServerConfig) -> CurveServer | None:
    if not cfg.curve_secret_key:
        return None
    public, secret = load_key_pair(cfg.curve_secret_key)
    return CurveServer(public=public, secret=secret,
                       allowed=load_allowed_keys(cfg.curve_allowed_keys))


def _tls_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert_file:
        return None
    chain = read_pem(cfg.tls_cert_file, "a certificate chain")
    key = read_pem(cfg.tls_key_file, "a private key")
    ca = read_pem(cfg.tls_client_ca_file, "CA certificates") if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def create_server(cfg: ServerConfig) -> ServerShard:
    """Bind every endpoint of a shard and start serving in background threads."""
    return ServerShard(cfg).start()
