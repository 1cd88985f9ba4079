"""``ControlClient``: a worker's gRPC control plane to every shard.

Register (with its retry while a shard waits for initial values), Heartbeat (a thread), Status,
Leave and the rule-state call, with the token and CURVE key as call metadata and each shard's
typed error read back from the failed call's trailer. It knows the key plan only to describe a
registration; it never touches the data plane (``worker.transport.client.PSClient`` owns both
and calls this).

    control = ControlClient(ClientConfig(servers=("127.0.0.1:50051",)), metrics=metrics)
    reply = control.register(0, plan, Registration(values=values))
    control.close()

With ``tls_ca_file`` the gRPC channels take TLS; registration checks that both sides agree on
CURVE (``ps.control``), so a key configured on one side only is an ``UNAUTHENTICATED`` error
there, not a data plane that never answers (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc
from bitps.proto.codecs import RAW, Codec
from bitps.proto.keyplan import KeyPlan, value_digest
from bitps.proto.keys import load_key_pair, load_public_key, read_pem
from bitps.proto.wire import PROTOCOL, PSError
from bitps.worker.config import ClientConfig
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport.channel import CurveClient, PSTimeoutError

__all__ = ["ControlClient", "Registration", "UnreachableError", "tls_channel_credentials"]

log = logging.getLogger(__name__)
_F32 = np.dtype("<f4")
_ERROR_METADATA_KEY = "bitps-error-code"
_TOKEN_METADATA_KEY = "bitps-token"  # checked by the shard before it reads a request
_CURVE_KEY_METADATA_KEY = "bitps-curve-key"  # ps.control: what the data plane will refuse
_CURVE_SERVER_KEY_METADATA_KEY = "bitps-curve-server-key"
_REGISTER_RETRY_S = (0.02, 0.5)  # first and longest pause between Register calls
_UNREACHABLE_RETRY_S = 2.0
"""How long Register calls again while a shard cannot be reached (gRPC ``UNAVAILABLE`` with no
shard error: a connection refused or reset at start-up, seen once in 27 launches as ``tcp
handshaker shutdown`` against a shard that had served for 5 s). Bounded and short: a handshake
that fails every time (TLS on one side only) must still fail within seconds, not wait out
``register_timeout_s``; a shard that is not up yet is what the deployments' readiness waits
are for (docker/README.md)."""


class UnreachableError(PSError):
    """A call that never reached a shard's handler: gRPC ``UNAVAILABLE`` with no shard error
    code in its trailer (a connection refused or reset, a failed TLS handshake; a shard's own
    retryable answers, ``NOT_INITIALIZED``, carry a code). A ``PSError`` with code
    ``NOT_REGISTERED``, as every untyped failure of a call is."""


@dataclass(frozen=True)
class Registration:
    """What one Register call says besides the plan.

    ``values`` (the worker that initializes: every key of the plan) are sent as the initial
    parameters; ``copies`` (every key) are the values this worker holds, whose BLAKE2b digests
    let the shard say which copies are current. ``pull_codec`` is how the shards publish
    updates for this worker's pulls (``ps.publish``), for the keys in ``compressed_pulls``
    (the others pull float32)."""

    values: Mapping[int, np.ndarray] | None = None
    copies: Mapping[int, np.ndarray] | None = None
    pull_codec: Codec = RAW
    compressed_pulls: frozenset[int] = field(default_factory=frozenset)

    def check(self, plan: KeyPlan, cfg: ClientConfig, *, initializes: bool) -> None:
        """:class:`ValueError` unless ``plan`` is cut for ``cfg``'s servers, ``values`` come
        exactly from the worker that ``initializes`` and ``copies`` name every key of ``plan``."""
        if plan.num_shards != len(cfg.servers):
            raise ValueError(f"plan is cut for {plan.num_shards} shards; the client has "
                             f"{len(cfg.servers)} servers")
        if (self.values is not None) != initializes:
            raise ValueError(f"rank {cfg.rank} {'must' if initializes else 'must not'} pass "
                             f"initial values (ClientConfig.initializes {cfg.initializes})")
        if self.copies is not None and set(self.copies) != {k.key for k in plan.keys}:
            raise ValueError(f"copies name {len(self.copies)} keys; the plan has "
                             f"{len(plan.keys)}")


class ControlClient:
    """gRPC ``Control`` stubs for every shard of a cluster, with the worker's credentials."""

    def __init__(self, cfg: ClientConfig, *, metrics: WorkerMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.curve = _curve_keys(cfg)
        """This worker's CURVE keys for the data plane, or ``None``: plain ZeroMQ."""
        # gRPC's own reconnect backoff (1 s growing to 120 s by default) would hide a shard
        # that is back: bound it by the worker's reconnect backoff.
        backoff = (int(cfg.reconnect_backoff_s * 1000), int(cfg.reconnect_backoff_max_s * 1000))
        opts = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.initial_reconnect_backoff_ms", max(backoff[0], 1)),
                ("grpc.min_reconnect_backoff_ms", max(backoff[0], 1)),
                ("grpc.max_reconnect_backoff_ms", max(backoff[1], 1))]
        tls = _tls_credentials(cfg)
        self._grpc = [grpc.insecure_channel(s, options=opts) if tls is None
                      else grpc.secure_channel(s, tls, options=opts) for s in cfg.servers]
        self.stubs: tuple[pb_grpc.ControlStub, ...] = tuple(pb_grpc.ControlStub(c)
                                                            for c in self._grpc)
        """The gRPC ``Control`` stubs, by shard (calls must carry :attr:`metadata`)."""
        self.min_clock = 0
        """Smallest live clock the last heartbeat answer reported."""
        self.steps_per_s = 0.0
        """This worker's training speed, which every heartbeat reports (0: not measured; set by
        the trainer that measures it, local SGD's dynamic inner steps)."""
        self.fastest_steps_per_s = 0.0
        """The fastest live worker's speed (this one's included) the shards last answered a
        heartbeat with; 0 until one reported a speed."""
        self.samples_per_s = 0.0
        """This worker's samples per second of compute, which every heartbeat reports (0: not
        measured; set by batch balancing, ``worker.algorithms.balance``)."""
        self.speeds: dict[int, float] = {}
        """Each live worker's samples per second of compute (this one's included), by rank, as
        the shards last answered a heartbeat; a rank that reported none is absent."""
        self.incarnations = [0] * len(cfg.servers)
        """Each shard's life as its last registration answered (0: none yet)."""
        self._restarted: set[int] = set()
        self._restarted_lock = threading.Lock()
        self._closing = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def metadata(self) -> tuple | None:
        """The token as call metadata: shards check it before they read a request; and this
        worker's CURVE public key, which a CURVE shard checks at Register."""
        md = ((_TOKEN_METADATA_KEY, self.cfg.token),) if self.cfg.token else ()
        if self.curve is not None:
            md += ((_CURVE_KEY_METADATA_KEY, self.curve.public.decode()),)
        return md or None

    # -- Register -----------------------------------------------------------------------------
    def register(self, shard: int, plan: KeyPlan, reg: Registration, *,
                 timeout_s: float | None = None) -> pb.RegisterReply:
        """Register with ``shard``, calling again with backoff while it answers
        ``NOT_INITIALIZED`` (the initial values of this worker's keys have not landed: a shard
        never holds a call for them long), until ``timeout_s`` (default
        ``register_timeout_s``; then :class:`PSTimeoutError`), and while the call cannot reach
        the shard (:class:`UnreachableError`), for at most :data:`_UNREACHABLE_RETRY_S` (then
        that error)."""
        timeout = self.cfg.register_timeout_s if timeout_s is None else timeout_s
        now = time.monotonic()
        end, give_up = now + timeout, now + min(_UNREACHABLE_RETRY_S, timeout)
        pause = _REGISTER_RETRY_S[0]
        while True:
            try:
                return self.register_once(shard, plan, reg,
                                          timeout_s=max(end - time.monotonic(), 0.1))
            except UnreachableError as err:
                if time.monotonic() + pause > give_up:
                    raise
                log.warning("rank %d: Register %s; calling again in %.2f s", self.cfg.rank,
                            err, pause)
            except PSError as err:
                if err.code != pb.NOT_INITIALIZED:
                    raise
                if time.monotonic() + pause > end:
                    raise PSTimeoutError(f"rank {self.cfg.rank}: shard {shard} still waits for "
                                         f"the initial values of this worker's keys after "
                                         f"{timeout:.0f} s", shard=shard) from None
            time.sleep(pause)
            pause = min(2 * pause, _REGISTER_RETRY_S[1])

    def register_once(self, shard: int, plan: KeyPlan, reg: Registration, *,
                      timeout_s: float) -> pb.RegisterReply:
        """One Register call, and the check that the shard's data plane and this worker agree
        on CURVE (the shard refuses a worker without a key or with one it does not allow)."""
        stream = iter(self._stream(plan, shard, reg))
        try:
            reply, call = self.stubs[shard].Register.with_call(stream, timeout=timeout_s,
                                                               metadata=self.metadata)
        except grpc.RpcError as err:
            raise self.error(err, shard) from None
        said = dict(call.trailing_metadata() or ()).get(_CURVE_SERVER_KEY_METADATA_KEY, "")
        refusal = None
        if self.curve is not None and not said:
            refusal = (f"shard {shard} ({self.cfg.servers[shard]}) serves plain ZeroMQ; this "
                       f"worker has curve_server_key {self.cfg.curve_server_key} (expected "
                       f"both sides with CURVE keys, or neither)")
        elif self.curve is not None and said.encode() != self.curve.server:
            refusal = (f"shard {shard} ({self.cfg.servers[shard]})'s CURVE public key is "
                       f"{said}; curve_server_key {self.cfg.curve_server_key} holds "
                       f"{self.curve.server.decode()}")
        if refusal is not None:
            # the shard registered this rank: leave at once, so no peer waits for it
            self._leave(shard, self.stubs[shard])
            raise PSError(pb.UNAUTHENTICATED, refusal, shard=shard)
        return reply

    def _stream(self, plan: KeyPlan, shard: int, reg: Registration
                ) -> Iterator[pb.RegisterMessage]:
        keys = plan.for_shard(shard)
        pull = reg.pull_codec
        req = pb.RegisterRequest(
            protocol=PROTOCOL, rank=self.cfg.rank, world_size=self.cfg.world_size,
            signature=plan.signature, num_shards=plan.num_shards, shard_id=shard,
            model_keys=plan.model_keys,
            sends_values=reg.values is not None, token=self.cfg.token,
            keys=[pb.KeySpec(key=k.key, name=k.name, offset=k.offset, length=k.length,
                             dtype=pb.FLOAT32,
                             compressed_pull=not pull.is_raw and k.key in reg.compressed_pulls,
                             shape=pb.TensorShape(dims=k.shape))
                  for k in keys])
        if not pull.is_raw:
            req.pull_codec, req.pull_codec_chunk, req.pull_codec_flags = pull.wire_fields()
        if reg.copies is not None:
            req.value_digests.extend(
                value_digest(np.ascontiguousarray(reg.copies[k.key], dtype=_F32)) for k in keys)
        yield pb.RegisterMessage(request=req)
        if reg.values is not None:
            for k in keys:
                data = np.ascontiguousarray(reg.values[k.key], dtype=_F32).tobytes()
                yield pb.RegisterMessage(values=pb.KeyValues(key=k.key, data=data))

    # -- the other calls ----------------------------------------------------------------------
    def status(self, shard: int, *, timeout_s: float = 10.0) -> pb.StatusReply:
        """The shard's view of clocks, live workers and held pulls, within ``timeout_s``."""
        try:
            return self.stubs[shard].Status(pb.StatusRequest(token=self.cfg.token),
                                            timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as err:
            raise self.error(err, shard) from None

    def rule_state(self, keys: Sequence[int], load: Callable[[pb.KeyRuleState, int], None], *,
                   plan: KeyPlan, versions: Mapping[int, int]) -> None:
        """The rule state of ``keys``' shards (the RuleState call, one stream per shard, the
        shards' streams at once: the state is as large as the model, and one shard's transfer
        need not wait for another's): each key's message handed to ``load(state, length)``
        (from the streams' threads, a key at a time; each key once); a state of another
        version than this worker's copy (``versions``) is refused (``BAD_CLOCK``), and a
        failed call raises the shard's typed error (the lowest shard's, when several fail).
        A push policy that needs the shards' state gets this, bound to the plan and versions
        (``PushPolicy.bind``)."""
        shards = sorted({plan.key(k).shard for k in keys})
        errors: dict[int, BaseException] = {}

        def fetch(shard: int) -> None:
            stream = self.stubs[shard].RuleState(pb.RuleStateRequest(
                rank=self.cfg.rank, token=self.cfg.token), timeout=self.cfg.deadline_s,
                metadata=self.metadata)
            try:
                for state in stream:
                    if state.version != versions.get(state.key):
                        raise PSError(pb.BAD_CLOCK, f"shard {shard} key {state.key}: optimizer "
                                      f"state of version {state.version}, parameters of "
                                      f"version {versions.get(state.key)}", shard=shard)
                    load(state, plan.key(state.key).length)
            except grpc.RpcError as err:
                errors[shard] = self.error(err, shard)
                stream.cancel()
            except BaseException as err:  # a refused state, or load's own error
                errors[shard] = err
                stream.cancel()

        others = [threading.Thread(target=fetch, args=(shard,), daemon=True,
                                   name=f"bitps-rule-state-{shard}") for shard in shards[1:]]
        for thread in others:
            thread.start()
        if shards:
            fetch(shards[0])
        for thread in others:
            thread.join()
        if errors:
            raise errors[min(errors)]

    # -- shard restarts ---------------------------------------------------------------------------
    def registered(self, shard: int, reply: pb.RegisterReply) -> None:
        """``shard`` answered a registration: its incarnation is the one to expect."""
        with self._restarted_lock:
            self.incarnations[shard] = reply.incarnation
            self._restarted.discard(shard)

    def take_restarted(self) -> list[int]:
        """The shards a heartbeat found restarted since the last call (their answer named
        another incarnation than their registration's): the caller re-registers them
        (``PSClient.recover``) before its next request to them."""
        if not self._restarted:  # read without the lock: the common case costs nothing
            return []
        with self._restarted_lock:
            out, self._restarted = sorted(self._restarted), set()
        return out

    def heard_from(self, shard: int, incarnation: int) -> None:
        """``shard`` answered as life ``incarnation`` (a heartbeat's or a data reply's; 0:
        none named): another than its registration's is a restart (:meth:`take_restarted`)."""
        if not incarnation or incarnation == self.incarnations[shard]:
            return  # every reply comes here: the common case takes no lock
        with self._restarted_lock:
            known = self.incarnations[shard]
            if not known or not incarnation or incarnation == known \
                    or shard in self._restarted:
                return
            self._restarted.add(shard)
        with self.metrics.lock:
            self.metrics.shard_restarts.inc()
        log.warning("rank %d: shard %d restarted (incarnation %x, registered with %x): "
                    "re-registering before the next request to it", self.cfg.rank, shard,
                    incarnation, known)

    def start_heartbeat(self, clock: Callable[[], int]) -> None:
        """Heartbeat every shard each ``heartbeat_s`` with ``clock()`` until :meth:`close`
        (once; a second call changes nothing)."""
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(clock,),
                                               name="bitps-heartbeat", daemon=True)
            self._heartbeat.start()

    def _heartbeat_loop(self, clock: Callable[[], int]) -> None:
        while not self._closing.wait(self.cfg.heartbeat_s):
            fastest, speeds, answered = 0.0, {}, False
            for shard, stub in enumerate(self.stubs):
                try:
                    reply = stub.Heartbeat(pb.HeartbeatRequest(
                        rank=self.cfg.rank, clock=clock(), token=self.cfg.token,
                        steps_per_s=self.steps_per_s, samples_per_s=self.samples_per_s),
                        timeout=max(self.cfg.heartbeat_s, 1.0), metadata=self.metadata)
                    self.min_clock = reply.min_clock
                    fastest = max(fastest, reply.max_steps_per_s)
                    # every shard hears the same heartbeats, so their tables differ at most by
                    # a report in flight: the last shard's answer for a rank stands
                    speeds.update(reply.samples_per_s)
                    answered = True
                    self.heard_from(shard, reply.incarnation)
                except grpc.RpcError as err:
                    log.warning("heartbeat to shard %d failed: %s", shard, err.code().name)
            if fastest > 0:
                self.fastest_steps_per_s = fastest
            if answered:
                self.speeds = speeds

    def leave(self) -> None:
        """Tell every shard this rank leaves (so peers stop waiting for it); failures are
        logged, not raised: the shards expire a silent worker anyway."""
        for shard, stub in enumerate(self.stubs):
            self._leave(shard, stub)

    def _leave(self, shard: int, stub: pb_grpc.ControlStub) -> None:
        try:
            stub.Leave(pb.LeaveRequest(rank=self.cfg.rank, token=self.cfg.token), timeout=5,
                       metadata=self.metadata)
        except grpc.RpcError as err:
            log.warning("leave shard %d failed: %s", shard, err.code().name)

    def error(self, err: grpc.RpcError, shard: int) -> PSError:
        """The shard's typed error carried by a failed call (or what the failure says)."""
        code = dict(err.trailing_metadata() or ()).get(_ERROR_METADATA_KEY)
        detail = err.details() or str(err.code())
        if code is not None:
            return PSError(int(code), detail.split(": ", 1)[-1], shard=shard)
        message = f"{self.cfg.servers[shard]}: {err.code().name}: {detail}"
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            return UnreachableError(pb.NOT_REGISTERED, message, shard=shard)
        return PSError(pb.DEADLINE if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                       else pb.NOT_REGISTERED, message, shard=shard)

    def close(self) -> None:
        """Stop the heartbeat and close the channels (no Leave: :meth:`leave` first)."""
        self._closing.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        for c in self._grpc:
            c.close()


def _curve_keys(cfg: ClientConfig) -> CurveClient | None:
    if not cfg.curve_server_key:
        return None
    public, secret = load_key_pair(cfg.curve_client_key)
    return CurveClient(server=load_public_key(cfg.curve_server_key), public=public,
                       secret=secret)


def _tls_credentials(cfg: ClientConfig) -> grpc.ChannelCredentials | None:
    return tls_channel_credentials(cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file)


def tls_channel_credentials(ca_file: str, cert_file: str = "", key_file: str = ""
                            ) -> grpc.ChannelCredentials | None:
    """gRPC TLS credentials for a channel to the shards: their CA (PEM), and this side's
    certificate and key when the shards require one; ``None`` without a CA (plaintext).
    ``ClientConfig``'s ``tls_*`` fields; ``bitps-status`` takes the same files."""
    if not ca_file:
        return None
    ca = read_pem(ca_file, "CA certificates")
    key = read_pem(key_file, "a private key") if key_file else None
    chain = read_pem(cert_file, "a certificate chain") if cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=chain)
