"""The shard's gRPC control service: Register, Heartbeat, Status, Leave, RuleState.

Failures are gRPC status codes whose details read ``"<ERROR_CODE>: <message>"`` and whose trailing
metadata carries ``bitps-error-code``, so clients re-raise the same typed ``PSError``.

The token travels in the ``bitps-token`` metadata of every call, and :class:`TokenInterceptor`
checks it before the call's request is read, so a wrong token costs the shard its metadata and
nothing more (a Register with a wrong token and 256 MiB of values raised the shard's RSS by
365 MiB while the token was checked in the message). The messages' ``token`` fields are still
sent and checked too.

Few calls wait: a Register that arrives before the initial values of its keys (from rank 0,
or the worker that initializes them: ``ClientConfig.initializes``) is registered, waits for
them up to :data:`REGISTER_WAIT_S` while fewer than :data:`REGISTER_WAITERS` others do (so that
a small cluster starts the moment rank 0's values land), and is otherwise answered
``NOT_INITIALIZED`` (``UNAVAILABLE``); ``PSClient.register`` calls again with backoff. Waiting
without a bound took one of the 16 gRPC threads per early rank, and 16 of them starved rank 0's
Register, every Heartbeat and Status.

With CURVE on the data plane (``ServerConfig.curve_secret_key``), Register also says what the
data plane will do with this worker, so that a key configured on one side only, or a key the
shard does not allow, is a typed ``UNAUTHENTICATED`` error at registration and not a silent
data plane (ZeroMQ drops a refused handshake without a word to the application): the worker
names its CURVE public key in the ``bitps-curve-key`` metadata, and the shard refuses a
Register without one or with one it would not let in, and names its own public key in the
reply's ``bitps-curve-server-key`` trailing metadata for the worker to compare with its
``curve_server_key``. This is a diagnosis, not the protection: the data plane's ZAP handler
checks the key that the CURVE handshake proves (``ps.data.ZapHandler``).
"""

from __future__ import annotations

import math
import threading

import grpc

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.wire import PSError, error_name
from bitps.ps.checks import token_ok
from bitps.ps.data import CurveServer
from bitps.ps.held import HeldPull
from bitps.ps.shard import ShardCore

__all__ = ["ControlServicer", "ERROR_METADATA_KEY", "HELD_SHOWN", "REGISTER_WAITERS",
           "CURVE_KEY_METADATA_KEY", "CURVE_SERVER_KEY_METADATA_KEY", "REGISTER_WAIT_S",
           "TOKEN_METADATA_KEY", "TokenInterceptor"]

REGISTER_WAITERS = 4
"""Registrations that may wait in a gRPC thread at once for initial values (of 16 threads)."""
REGISTER_WAIT_S = 2.0
"""Longest one of them waits before it is answered ``NOT_INITIALIZED`` and calls again."""
HELD_SHOWN = 8
"""Held pulls a Status reply details per worker (``WorkerStatus.held``); ``pending_pulls``
counts them all. A worker holds about one step's pull messages per shard, and the doctor needs
the lowest clock's; a flood of up to ``max_held_pulls`` must not make Status slow."""

ERROR_METADATA_KEY = "bitps-error-code"
TOKEN_METADATA_KEY = "bitps-token"
CURVE_KEY_METADATA_KEY = "bitps-curve-key"
"""Register metadata: the worker's CURVE public key (Z85), when it has one."""
CURVE_SERVER_KEY_METADATA_KEY = "bitps-curve-server-key"
"""RegisterReply trailing metadata: the shard's CURVE public key (Z85), with CURVE on."""
_SERVICE = "/bitps.Control/"
_STATUS = {
    pb.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    pb.NOT_REGISTERED: grpc.StatusCode.NOT_FOUND,
    pb.NOT_INITIALIZED: grpc.StatusCode.UNAVAILABLE,
    pb.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    pb.PROTOCOL: grpc.StatusCode.FAILED_PRECONDITION,
    pb.LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _speed(reported: float) -> float:
    """A heartbeat's speed as kept: a positive finite number, else 0 (not measured)."""
    return reported if math.isfinite(reported) and reported > 0 else 0.0


def _abort(context: grpc.ServicerContext, err: PSError):
    context.set_trailing_metadata(((ERROR_METADATA_KEY, str(err.code)),))
    context.abort(_STATUS.get(err.code, grpc.StatusCode.INVALID_ARGUMENT),
                  f"{error_name(err.code)}: {err.message}")


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses a ``bitps.Control`` call whose ``bitps-token`` metadata is not ``token``
    (``UNAUTHENTICATED``) before its request is read: the refusal's handler never reads nor
    deserializes it. Other services (gRPC health) need no token."""

    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_SERVICE):
            return handler
        got = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if token_ok(self.token, got if isinstance(got, str) else ""):
            return handler
        return _refusal(handler, handler_call_details.method)


def _refusal(handler, method: str):
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED at once."""
    def refuse(request_or_iterator, context):
        _abort(context, PSError(pb.UNAUTHENTICATED, f"{method}: token missing or wrong "
                                f"(metadata {TOKEN_METADATA_KEY})"))

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](refuse)


class ControlServicer(pb_grpc.ControlServicer):
    """Serves ``core``; ``endpoints`` fills the ports a RegisterReply advertises."""

    def __init__(self, core: ShardCore, *, data_port: int, metrics_port: int,
                 curve: CurveServer | None = None) -> None:
        self.core = core
        self.data_port = data_port
        self.metrics_port = metrics_port
        self.curve = curve
        self._waiters = threading.BoundedSemaphore(REGISTER_WAITERS)

    def _check_token(self, token: str, context) -> None:
        if not token_ok(self.core.cfg.token, token):
            _abort(context, PSError(pb.UNAUTHENTICATED, "token missing or wrong"))

    def Register(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("body") != "request":
            _abort(context, PSError(pb.BAD_HEADER, "Register must start with a RegisterRequest"))
        req = first.request
        self._check_curve(req.rank, context)
        try:
            self.core.check_registration(req)  # before a single value is read
            values = _read_values(req, request_iterator)
            reply = self.core.register(req, values)
        except PSError as err:
            _abort(context, err)
        keys = [spec.key for spec in req.keys]
        if not self._wait_initialized(keys, context):
            waiting = [k for k in keys if not self.core.keys_initialized((k,))][:8]
            _abort(context, PSError(pb.NOT_INITIALIZED, f"rank {req.rank} is registered; the "
                                    f"initial values of its keys {waiting} have not landed yet "
                                    f"(call again)"))
        reply.data_port, reply.metrics_port = self.data_port, max(self.metrics_port, 0)
        if req.value_digests:
            keys, versions = self.core.current_copies(req)
            reply.current_keys.extend(keys)
            reply.current_versions.extend(versions)
        return reply

    def _check_curve(self, rank: int, context) -> None:
        """With CURVE on: refuse a worker whose data plane would be refused (no key, or one
        not allowed), and name this shard's public key in the reply's trailing metadata."""
        curve = self.curve
        if curve is None:
            return
        shard = self.core.cfg.shard_id
        got = dict(context.invocation_metadata() or ()).get(CURVE_KEY_METADATA_KEY, "")
        if not got:
            _abort(context, PSError(pb.UNAUTHENTICATED, f"rank {rank}: shard {shard}'s data "
                                    f"plane is CURVE; expected the worker to have "
                                    f"curve_server_key and curve_client_key"))
        if got.encode() not in curve.allowed:
            _abort(context, PSError(pb.UNAUTHENTICATED, f"rank {rank}: CURVE public key "
                                    f"{got} is not in shard {shard}'s curve_allowed_keys"))
        context.set_trailing_metadata(((CURVE_SERVER_KEY_METADATA_KEY, curve.public.decode()),))

    def _wait_initialized(self, keys: list[int], context) -> bool:
        """Whether the initial values of ``keys`` (the registering worker's) have landed,
        waiting a little while few others wait."""
        core = self.core
        if core.keys_initialized(keys) or not self._waiters.acquire(blocking=False):
            return core.keys_initialized(keys)
        try:
            left = context.time_remaining()
            return core.wait_initialized(keys, min(REGISTER_WAIT_S, left if left is not None
                                                   else REGISTER_WAIT_S))
        finally:
            self._waiters.release()

    def Heartbeat(self, request, context):
        self._check_token(request.token, context)
        core = self.core
        with core.lock:
            if not core.clocks.is_registered(request.rank):
                _abort(context, PSError(pb.NOT_REGISTERED, f"rank {request.rank} is not "
                                        f"registered with shard {core.cfg.shard_id}"))
            clocks = core.clocks
            clocks.seen(request.rank)
            worker = clocks.workers[request.rank]
            worker.steps_per_s = _speed(request.steps_per_s)
            worker.samples_per_s = _speed(request.samples_per_s)
            live = clocks.live()
            fastest = max((clocks.workers[r].steps_per_s for r in live), default=0.0)
            samples = {r: clocks.workers[r].samples_per_s for r in live
                       if clocks.workers[r].samples_per_s > 0}
            return pb.HeartbeatReply(min_clock=clocks.min_clock(), live=live,
                                     max_steps_per_s=fastest, samples_per_s=samples,
                                     incarnation=core.incarnation)

    def Status(self, request, context):
        """Clocks, liveness and held pulls of every worker the shard knows, and for each held
        pull whom it waits for (``bitps-status``). Read in one pass under the core's lock: the
        clock table, and at most :data:`HELD_SHOWN` held pulls per worker (lowest clock
        first), never the parameters; a held pull's slots are looked at only until the first
        one still waiting (sync)."""
        self._check_token(request.token, context)
        core = self.core
        with core.lock:
            clocks, now = core.clocks, core.now()
            live = set(clocks.live())
            min_clock = clocks.min_clock()
            max_clock = max((clocks.workers[r].clock for r in live), default=0)
            held: dict[int, list[pb.HeldPullStatus]] = {}
            reasons: dict[int, str] = {}
            for h in core.held:  # lowest clock first: the one that blocks comes first
                shown = held.setdefault(h.header.worker, [])
                if len(shown) < HELD_SHOWN:
                    shown.append(_held_status(core, h, now))
                    reasons.setdefault(h.header.worker, shown[-1].reason)
            workers = [pb.WorkerStatus(
                rank=w.rank, clock=w.clock, live=w.rank in live,
                seconds_since_seen=now - w.last_seen, pending_pulls=core.held.count(w.rank),
                waiting_for=reasons.get(w.rank, ""), registered=w.registered, left=w.left,
                dropped=w.dropped, clock_lead=w.clock - min_clock,
                clock_lag=max_clock - w.clock if w.rank in live else 0,
                held=held.get(w.rank, ()), steps_per_s=w.steps_per_s,
                samples_per_s=w.samples_per_s)
                for w in sorted(clocks.workers.values(), key=lambda w: w.rank)]
            return pb.StatusReply(
                shard_id=core.cfg.shard_id, mode=core.cfg.mode, staleness=core.cfg.staleness,
                min_clock=min_clock, workers=workers, num_keys=len(core.slots),
                num_elements=sum(s.length for s in core.slots.values()),
                updates_applied=core.updates_applied, initialized=core.initialized.is_set(),
                signature=core.signature, max_clock=max_clock, world_size=clocks.world_size,
                heartbeat_timeout_s=core.cfg.heartbeat_timeout_s, held_pulls=len(core.held),
                held_shown=HELD_SHOWN, uninitialized_keys=core.uninitialized_keys())

    def RuleState(self, request, context):
        """The update rule's state of the asking worker's keys (``UpdateRule.rule_state``),
        or its typed refusal."""
        self._check_token(request.token, context)
        try:
            states = self.core.rule_state(request.rank)
        except PSError as err:
            _abort(context, err)
        yield from states

    def Leave(self, request, context):
        self._check_token(request.token, context)
        self.core.leave(request.rank)
        return pb.LeaveReply()


def _read_values(req: pb.RegisterRequest, messages) -> dict[int, bytes]:
    """The KeyValues that follow a registration, each checked as it arrives (a key of the plan,
    once, of its length), so that what is kept never exceeds the plan the shard accepted."""
    lengths = {spec.key: spec.length * 4 for spec in req.keys}
    values: dict[int, bytes] = {}
    for msg in messages:
        if msg.WhichOneof("body") != "values" or not req.sends_values:
            raise PSError(pb.BAD_HEADER, "only KeyValues may follow the request, and only when "
                          "it sends values")
        key, data = msg.values.key, msg.values.data
        if key not in lengths or key in values:
            raise PSError(pb.UNKNOWN_KEY, f"initial value of key {key}: not in rank "
                          f"{req.rank}'s plan for this shard, or sent twice")
        if len(data) != lengths[key]:
            raise PSError(pb.BAD_LENGTH, f"initial value of key {key} is {len(data)} bytes; "
                          f"expected {lengths[key]}")
        values[key] = data
    return values


def _held_status(core: ShardCore, held: HeldPull, now: float) -> pb.HeldPullStatus:
    return pb.HeldPullStatus(
        clock=held.clock, waited_s=now - held.since, deadline_in_s=held.deadline - now,
        num_keys=len(held.slots),
        waiting_for=core.consistency.waited_ranks(core.clocks, held.clock, held.slots),
        reason=core.consistency.waiting_for(core.clocks, held.header.worker, held.clock,
                                            held.slots))
