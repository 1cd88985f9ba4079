"""``PSClient``: a worker's connection to every shard; it moves bytes.

``push``, ``pull`` and ``push_pull`` send at once from the calling thread and return a
:class:`~bitps.worker.transport.channel.Handle`; ``Handle.wait()`` blocks until every shard
involved has answered, with a deadline. Each submitting thread sends on its own channel
(``worker.transport.channels``), so no thread hand-off sits on the latency path. The control
plane is :attr:`PSClient.control` (``worker.transport.control``)::

    client = PSClient(ClientConfig(servers=("127.0.0.1:50051",), rank=0, world_size=1))
    client.register(plan, values)                       # rank 0 sends initial values
    client.push_pull(keys, grads, outs, clock=0).wait()  # float32 gradients, as they are
    client.close()

What a push carries is decided above the transport: float32 arrays, or an ``Encoded`` push
(``worker.training.encoder``); codes in pull replies are added through :attr:`PSClient.codes`.
Payloads go out zero-copy (unchanged until the handle completes); pulled values are copied
from the received frame into ``outs``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import RAW, Codec
from bitps.proto.keyplan import KeyPlan
from bitps.proto.wire import PROTOCOL, PSError
from bitps.worker.config import ClientConfig
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport.channel import (
    CodeApplier,
    Handle,
    PSTimeoutError,
    Request,
    ShardLostError,
)
from bitps.worker.transport.channels import Channels
from bitps.worker.transport.control import ControlClient, Registration
from bitps.worker.transport.messages import Encoded, messages

__all__ = ["Encoded", "Handle", "PSClient", "PSTimeoutError", "RECOVERABLE", "ShardLostError"]

log = logging.getLogger(__name__)
_F32 = np.dtype("<f4")
RECOVERABLE = frozenset({pb.DEADLINE, pb.NOT_REGISTERED, pb.NOT_INITIALIZED, pb.BAD_CLOCK,
                         pb.SHUTTING_DOWN})
"""Failures of one shard that :meth:`PSClient.complete` recovers from: no answer in time (it died,
or the connection dropped), a shard that does not know this worker or is not initialized (it
restarted), a clock it does not take (restored from an older checkpoint, or it went on without
this worker), a graceful stop (SIGTERM: it comes back from its final checkpoint)."""


class PSClient:
    """One worker rank's client for all shards of a cluster."""

    def __init__(self, cfg: ClientConfig, *, metrics: WorkerMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or WorkerMetrics()
        self.num_shards = len(cfg.servers)
        self.control = ControlClient(cfg, metrics=self.metrics)
        """Register, Heartbeat, Status, Leave, rule state (``worker.transport.control``)."""
        self.on_slow_wait: Callable[[int, float], object] | None = None
        """``on_slow_wait(shard, waited_s)``, from ``Handle.wait`` on the waiting thread, once per
        shard owing an answer at half the wait's limit; quick; what it raises is logged."""
        self.plan: KeyPlan | None = None
        self._registration = Registration()
        self.versions: dict[int, int] = {}
        self.start_clock = 0
        self.clock = 0
        """This worker's step: heartbeats carry it (its trainer sets it)."""
        self.holds_pulls = False
        """Set at registration: the shards may hold a pull until other workers push the same
        keys (sync, W > 1): it must never hold back this worker's own pushes (``comm``)."""
        self.shift = [0] * self.num_shards
        """Per shard: its clock less this worker's (requests for step ``c`` carry ``c +
        shift[s]``): nonzero once it came back behind or went on without this worker."""
        self._rejoins = [0] * self.num_shards  # per shard: re-registrations (:meth:`_rejoin`)
        self.hyperparameters: Callable[[Sequence[int], int], tuple] | None = None
        """``(keys, clock) -> (lrs, weight_decays)`` per push: ``DataHeader.lr`` and so on."""
        self._ids = itertools.count(1)
        self.incarnation = secrets.randbits(63) | 1
        """This client's life on the wire: with the request id, a push is applied once."""
        self.channels = Channels(servers=cfg.servers, metrics=self.metrics, versions=self.versions,
                                 curve=self.control.curve, heard=self.control.heard_from)
        """The data connections, one per submitting thread (``worker.transport.channels``)."""
        self._closing = threading.Event()

    @property
    def initializes(self) -> bool:
        """Whether this worker sends the initial values of its keys at registration (and to a
        shard that came back empty): ``ClientConfig.initializes``, by default rank 0's job."""
        init = self.cfg.initializes
        return self.cfg.rank == 0 if init is None else init

    @property
    def codes(self) -> CodeApplier:
        """How a pulled code is added to this worker's copy (set by the encoder)."""
        return self.channels.codes

    @codes.setter
    def codes(self, applier: CodeApplier) -> None:
        self.channels.codes = applier

    # -- control plane ------------------------------------------------------------------------
    def register(self, plan: KeyPlan, values: Mapping[int, np.ndarray] | None = None, *,
                 copies: Mapping[int, np.ndarray] | None = None, pull_codec: Codec = RAW,
                 compressed_pulls: frozenset[int] = frozenset()) -> list[pb.RegisterReply]:
        """Join every shard with ``plan``; ``values`` (:attr:`initializes`: rank 0, or in a
        pipeline replica 0 of each stage) are the initial parameters by key. Other ranks block
        until the values of their keys have landed. Returns each shard's reply (what its
        rule and mode call for: the encoder reads them). ``plan`` may be partial
        (``KeyPlan.subset``: a pipeline stage's keys): the shards then count this worker, per
        key, only for the keys it registered.

        ``copies`` (any rank, every key): the values this worker holds now. Their digests go
        with the registration, and keys whose shard values match count as received
        (:attr:`versions`), so the first pull can skip them. ``pull_codec``: how the shards
        publish updates of ``compressed_pulls`` for this worker (the encoder's choice)."""
        reg = Registration(values=values, copies=copies, pull_codec=pull_codec,
                           compressed_pulls=frozenset(compressed_pulls))
        reg.check(plan, self.cfg, initializes=self.initializes)
        self.plan, self._registration = plan, reg
        endpoints, current, replies = [], {}, []
        for shard in range(self.num_shards):
            reply = self.control.register(shard, plan, self._registration)
            current.update(zip(reply.current_keys, reply.current_versions))
            if reply.shard_id != shard:
                raise PSError(pb.BAD_HEADER, f"server {self.cfg.servers[shard]} is shard "
                              f"{reply.shard_id}; expected shard {shard} (list servers in order)")
            self.control.registered(shard, reply)
            endpoints.append(self._endpoint(shard, reply))
            self.start_clock = max(self.start_clock, reply.start_clock)
            self.holds_pulls = self.holds_pulls or reply.holds_pulls
            replies.append(reply)
        # a shard behind for this rank (restored while a predecessor ran) keeps its clock
        start = self.clock = self.start_clock
        self.shift = [r.start_clock - start for r in replies]
        # a request names versions only of received keys (codes go only against a copy sent)
        self.versions.clear()
        self.versions.update(current)
        self.channels.endpoints = endpoints
        self.control.start_heartbeat(lambda: self.clock)
        return replies

    def _endpoint(self, shard: int, reply: pb.RegisterReply) -> str:
        """The shard's data endpoint: its gRPC host, the data port it answered."""
        return f"tcp://{self.cfg.servers[shard].rsplit(':', 1)[0]}:{reply.data_port}"

    def status(self, shard: int, *, timeout_s: float = 10.0) -> pb.StatusReply:
        """The shard's view of clocks, live workers and held pulls, within ``timeout_s``."""
        return self.control.status(shard, timeout_s=timeout_s)

    # -- data plane ---------------------------------------------------------------------------
    def push(self, keys: Sequence[int], grads: Sequence[np.ndarray] | Encoded, *,
             clock: int) -> Handle:
        """Send the gradients of ``keys`` for step ``clock`` (float32 arrays, or Encoded)."""
        return self._submit(pb.PUSH, keys, grads, (), clock)

    def pull(self, keys: Sequence[int], outs: Sequence[np.ndarray], *, clock: int) -> Handle:
        """Fetch parameters of ``keys`` for step ``clock`` into ``outs``."""
        return self._submit(pb.PULL, keys, (), outs, clock)

    def push_pull(self, keys: Sequence[int], grads: Sequence[np.ndarray] | Encoded,
                  outs: Sequence[np.ndarray], *, clock: int) -> Handle:
        """Push for step ``clock`` (as :meth:`push`), pull for ``clock + 1`` into ``outs``."""
        return self._submit(pb.PUSH_PULL, keys, grads, outs, clock)

    def progress(self, timeout_s: float, *, wake_fd: int | None = None) -> None:
        """Receive replies to this thread's requests for up to ``timeout_s`` seconds, returning
        early when ``wake_fd`` is readable (``worker.training.comm.CommThread`` waits for replies
        and new buckets at once this way)."""
        self.channels.mine().progress(timeout_s, wake_fd=wake_fd)

    @property
    def min_clock(self) -> int:
        """Smallest live clock the shards last reported to this thread."""
        channel = self.channels.existing()
        return channel.min_clock if channel is not None else self.control.min_clock

    def rejoin_restarted(self, clock: int) -> None:
        """Re-register the shards a heartbeat or a reply found restarted (:meth:`recover`, at
        step ``clock``); before each request, and before a push is encoded (``Encoder``)."""
        copies = self._registration.copies
        for shard in self.control.take_restarted() if copies is not None else ():
            self.recover(shard, copies, clock=clock)

    def _submit(self, op, keys, grads, outs, clock) -> Handle:
        if self.plan is None:
            raise RuntimeError("register() before push/pull")
        if self._closing.is_set():
            raise RuntimeError("the client is closed")
        self.rejoin_restarted(clock)
        encoded = grads if isinstance(grads, Encoded) else None
        arrays = encoded.payloads if encoded is not None else grads
        if arrays and len(arrays) != len(keys) or outs and len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(arrays)} grads and {len(outs)} outs")
        if encoded is not None and len(encoded.codecs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(encoded.codecs)} codecs")
        codecs = encoded.codecs if encoded is not None else None
        channel = self.channels.mine()
        groups = messages(self.plan, keys, arrays if encoded is None else (), outs, codecs,
                          limit=self.cfg.message_bytes, reply_bytes=channel.reply_bytes)
        handle = Handle(channel, len(groups), (self.cfg.rank, op, clock, keys),
                        self.cfg.deadline_s, keep=(grads,), on_slow=self.on_slow_wait)
        handle.rejoins = tuple(self._rejoins)
        deadline = time.monotonic() + self.cfg.deadline_s
        requests = []
        for shard, codec, idx in groups:
            ks = [keys[i] for i in idx]
            header = pb.DataHeader(op=op, protocol=PROTOCOL, worker=self.cfg.rank,
                                   request_id=next(self._ids), clock=clock + self.shift[shard],
                                   keys=ks, shard_incarnation=self.control.incarnations[shard],
                                   dtype=pb.FLOAT32, deadline_s=self.cfg.deadline_s,
                                   token=self.cfg.token, incarnation=self.incarnation)
            # The versions of this worker's copies: what a gradient was computed from, and
            # where the codes a shard publishes start (none before the first reply).
            if all(k in self.versions for k in ks):
                header.versions.extend(self.versions[k] for k in ks)
            if not codec.is_raw:
                header.codec, header.codec_chunk, header.codec_flags = codec.wire_fields()
            if arrays and self.hyperparameters is not None:
                header.lr[:], header.weight_decay[:] = self.hyperparameters(ks, clock)
            payload = [arrays[i] for i in idx] if arrays else []
            nbytes = sum(self.plan.key(k).nbytes for k in ks) if arrays else 0
            requests.append(Request(shard, header.request_id, ks, header, payload,
                                    [outs[i] for i in idx] if outs else (), handle, deadline,
                                    op, nbytes,
                                    owners=[encoded.owners[i] for i in idx] if encoded else (),
                                    clock=clock))
            handle.track(shard)
        handle.requests = requests
        channel.send(requests)
        return handle

    # -- recovery -----------------------------------------------------------------------------
    @property
    def exchange_bound_s(self) -> float:
        """Longest :meth:`complete` may take: the first attempt's deadline, then up to
        ``reconnect_timeout_s`` of recovery, whose last redo may wait one more deadline."""
        return 2 * self.cfg.deadline_s + self.cfg.reconnect_timeout_s

    def complete(self, handle: Handle, copies: Mapping[int, np.ndarray]) -> Handle:
        """Wait for ``handle``; when shards were lost (:data:`RECOVERABLE` failures, or no
        answer), :meth:`recover` each and redo their part of the exchange, until it succeeds
        or ``reconnect_timeout_s`` has passed (then :class:`ShardLostError`). Returns the
        handle that completed (``handle``, or the redo's). ``copies`` (every key of the plan):
        the values this worker holds (:meth:`recover`). A redo sends the same bytes: the same
        request ids to a shard that kept this worker's clock (its exactly-once window answers
        a push it had applied with the original answer), new ids and the shard's clock to one
        that came back behind."""
        try:
            handle.wait()
            return handle
        except PSError as err:
            last: PSError = err
        since = time.monotonic()
        end = since + self.cfg.reconnect_timeout_s
        while True:
            failed = handle.failed_shards()
            if not failed or any(e is not None and e.code not in RECOVERABLE
                                 for e in failed.values()):
                raise last
            log.warning("rank %d: %s; recovering shards %s", self.cfg.rank, last,
                        sorted(failed))
            for shard in sorted(failed):
                # re-registered since this was sent (for a push in flight before this pull):
                # its clock is adopted; this exchange's clock would adopt it again, wrongly
                if handle.rejoins[shard] == self._rejoins[shard]:
                    self.recover(shard, copies, clock=handle.clock, since=since, end=end)
            handle = self._redo(handle, failed)
            try:
                handle.wait()
                return handle
            except PSError as err:
                last = err
            if time.monotonic() >= end:
                shard = last.shard if last.shard is not None else min(failed)
                raise ShardLostError(shard, self.cfg.servers[shard], time.monotonic() - since,
                                     last, rank=self.cfg.rank) from last

    def recover(self, shard: int, copies: Mapping[int, np.ndarray], *, clock: int,
                since: float | None = None, end: float | None = None) -> int:
        """Get ``shard`` back after it was lost (or a heartbeat saw it restart) while this
        worker was at step ``clock``: drop what its old connection still queues, re-register
        (the plan, digests of ``copies``: which are current; ``copies`` as values when this
        worker :attr:`initializes`, for a shard back empty) with backoff until ``end``
        (default: ``reconnect_timeout_s`` from now), then adopt what the shard says. Returns
        the steps of this shard's updates that were lost (it came back from an older one).

        Adopting: keys whose values differ from ``copies`` lose their versions (pulled whole
        next); a shard at another clock than ``clock`` (+ shift) has its clock adopted
        (:attr:`shift`): behind, it lost that many steps (``bitps_worker_lost_steps_total``);
        ahead (sync, this worker was dropped), it went on without this worker's pushes.
        Raises :class:`ShardLostError` past ``end``, other failures as they are."""
        if self.plan is None:
            raise RuntimeError("register() before recover()")
        since = time.monotonic() if since is None else since
        end = since + self.cfg.reconnect_timeout_s if end is None else end
        # queued requests would reach the restarted shard as pushes of the wrong step: drop
        self.channels.reset(shard)
        keys = self.plan.for_shard(shard)
        values = {k.key: copies[k.key] for k in keys} if self.initializes else None
        reg = dataclasses.replace(self._registration, values=values, copies=copies)
        pause, last = self.cfg.reconnect_backoff_s, None
        while True:
            try:
                left = min(end - time.monotonic(), self.cfg.deadline_s)
                reply = self.control.register_once(shard, self.plan, reg,
                                                   timeout_s=max(left, 0.1))
                return self._rejoin(shard, reply, clock)
            except PSError as err:
                if err.code not in RECOVERABLE:
                    raise
                last = err
            if time.monotonic() + pause > end:
                raise ShardLostError(shard, self.cfg.servers[shard], time.monotonic() - since,
                                     last, rank=self.cfg.rank)
            time.sleep(pause)
            pause = min(2 * pause, self.cfg.reconnect_backoff_max_s)

    def _rejoin(self, shard: int, reply: pb.RegisterReply, clock: int) -> int:
        """Take a re-registration's answer (:meth:`recover`); returns the steps lost."""
        if reply.shard_id != shard:
            raise PSError(pb.BAD_HEADER, f"server {self.cfg.servers[shard]} is now shard "
                          f"{reply.shard_id}; expected shard {shard}", shard=shard)
        self.control.registered(shard, reply)
        self._rejoins[shard] += 1
        endpoint = self._endpoint(shard, reply)
        if endpoint != self.channels.endpoints[shard]:  # restarted on another data port
            self.channels.reset(shard, endpoint)
        for k in self.plan.for_shard(shard):  # what the digests did not match: pulled whole
            self.versions.pop(k.key, None)
        self.versions.update(zip(reply.current_keys, reply.current_versions))
        expected = clock + self.shift[shard]
        skipped = reply.step > expected  # named only to a skipped worker (start_clock moot)
        lost = 0 if skipped else max(expected - reply.start_clock, 0)  # the shard is behind
        now = reply.step if skipped else reply.start_clock if lost else expected
        self.shift[shard] = now - clock  # its clock adopted
        why = f": {lost} steps of updates lost" if lost else ": it went on without this " \
            "(dropped) worker's pushes" if skipped else ""
        log.log(logging.WARNING if why else logging.INFO, "rank %d: shard %d (%s) is back at "
                "clock %d, this worker at %d%s", self.cfg.rank, shard, self.cfg.servers[shard],
                now, expected, why)
        with self.metrics.lock:
            self.metrics.recoveries.inc()
            self.metrics.lost_steps.inc(lost)
        return lost

    def _redo(self, handle: Handle, failed: Mapping[int, PSError | None]) -> Handle:
        """Send ``handle``'s parts for the ``failed`` shards again, from this thread."""
        channel = self.channels.mine()
        old = [r for r in handle.requests if r.shard in failed]
        redo = Handle(channel, len(old), handle._what, self.cfg.deadline_s,
                      on_slow=self.on_slow_wait)
        redo.rejoins = tuple(self._rejoins)
        deadline = time.monotonic() + self.cfg.deadline_s
        for r in old:
            header = pb.DataHeader()
            header.CopyFrom(r.header)
            header.shard_incarnation = self.control.incarnations[r.shard]  # re-registered
            clock = r.clock + self.shift[r.shard]
            if header.clock != clock:
                # The shard came back behind: this is a push of another step there, and the
                # shard's exactly-once window does not know it.
                header.clock, header.request_id = clock, next(self._ids)
            del header.versions[:]
            if all(k in self.versions for k in r.keys):
                header.versions.extend(self.versions[k] for k in r.keys)
            redo.requests.append(dataclasses.replace(r, request_id=header.request_id,
                                                     header=header, handle=redo,
                                                     deadline=deadline))
            redo.track(r.shard)
        channel.send(redo.requests)
        return redo

    # -- lifetime -----------------------------------------------------------------------------
    def close(self, leave: bool = True) -> None:
        """Leave every shard (so peers stop waiting for this rank) and stop the threads."""
        if self._closing.is_set():
            return
        if leave and self.plan is not None:
            self.control.leave()
        self._closing.set()
        self.control.close()
        self.channels.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
