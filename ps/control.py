"""The shard's gRPC control service: Register, Heartbeat, Status, Leave, OptimizerState.

Failures are gRPC status codes whose details read ``"<ERROR_CODE>: <message>"`` and whose trailing
metadata carries ``bitps-error-code``, so clients re-raise the same typed ``PSError``.
"""

from __future__ import annotations

import grpc

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.wire import PSError, error_name
from bitps.ps.shard import ShardCore

__all__ = ["ControlServicer", "ERROR_METADATA_KEY"]

ERROR_METADATA_KEY = "bitps-error-code"
_STATUS = {
    pb.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    pb.NOT_REGISTERED: grpc.StatusCode.NOT_FOUND,
    pb.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    pb.PROTOCOL: grpc.StatusCode.FAILED_PRECONDITION,
}


def _abort(context: grpc.ServicerContext, err: PSError):
    context.set_trailing_metadata(((ERROR_METADATA_KEY, str(err.code)),))
    context.abort(_STATUS.get(err.code, grpc.StatusCode.INVALID_ARGUMENT),
                  f"{error_name(err.code)}: {err.message}")


class ControlServicer(pb_grpc.ControlServicer):
    """Serves ``core``; ``endpoints`` fills the ports a RegisterReply advertises."""

    def __init__(self, core: ShardCore, *, data_port: int, metrics_port: int,
                 init_timeout_s: float = 120.0) -> None:
        self.core = core
        self.data_port = data_port
        self.metrics_port = metrics_port
        self.init_timeout_s = init_timeout_s

    def _check_token(self, token: str, context) -> None:
        if self.core.cfg.token and token != self.core.cfg.token:
            _abort(context, PSError(pb.UNAUTHENTICATED, "token missing or wrong"))

    def Register(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("body") != "request":
            _abort(context, PSError(pb.BAD_HEADER, "Register must start with a RegisterRequest"))
        req, values = first.request, {}
        for msg in request_iterator:
            if msg.WhichOneof("body") != "values":
                _abort(context, PSError(pb.BAD_HEADER, "only KeyValues may follow the request"))
            values[msg.values.key] = msg.values.data
        try:
            reply = self.core.register(req, values)
        except PSError as err:
            _abort(context, err)
        if not self.core.initialized.wait(self.init_timeout_s):
            _abort(context, PSError(pb.DEADLINE, f"rank {req.rank} waited "
                                    f"{self.init_timeout_s:.0f} s for rank 0's initial values"))
        reply.data_port, reply.metrics_port = self.data_port, max(self.metrics_port, 0)
        if req.value_digests:
            keys, versions = self.core.current_copies(req)
            reply.current_keys.extend(keys)
            reply.current_versions.extend(versions)
        return reply

    def Heartbeat(self, request, context):
        self._check_token(request.token, context)
        core = self.core
        with core.lock:
            if not core.clocks.is_registered(request.rank):
                _abort(context, PSError(pb.NOT_REGISTERED, f"rank {request.rank} is not "
                                        f"registered with shard {core.cfg.shard_id}"))
            core.clocks.seen(request.rank)
            return pb.HeartbeatReply(min_clock=core.clocks.min_clock(), live=core.clocks.live())

    def Status(self, request, context):
        self._check_token(request.token, context)
        core = self.core
        reasons = core.held_reasons()
        with core.lock:
            now, live = core.now(), set(core.clocks.live())
            held: dict[int, int] = {}
            for h in core.held:
                held[h.header.worker] = held.get(h.header.worker, 0) + 1
            workers = [pb.WorkerStatus(rank=w.rank, clock=w.clock, live=w.rank in live,
                                       seconds_since_seen=now - w.last_seen,
                                       pending_pulls=held.get(w.rank, 0),
                                       waiting_for=reasons.get(w.rank, ""))
                       for w in sorted(core.clocks.workers.values(), key=lambda w: w.rank)]
            return pb.StatusReply(
                shard_id=core.cfg.shard_id, mode=core.cfg.mode, staleness=core.cfg.staleness,
                min_clock=core.clocks.min_clock(), workers=workers, num_keys=len(core.slots),
                num_elements=sum(s.length for s in core.slots.values()),
                updates_applied=core.updates_applied, initialized=core.initialized.is_set(),
                signature=core.signature)

    def OptimizerState(self, request, context):
        self._check_token(request.token, context)
        try:
            states = self.core.optimizer_state(request.rank)
        except PSError as err:
            _abort(context, err)
        yield from states

    def Leave(self, request, context):
        self._check_token(request.token, context)
        self.core.leave(request.rank)
        return pb.LeaveReply()
