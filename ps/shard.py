"""The shard's request handler: validation, updates, clocks and held pulls, without sockets.

:class:`ShardCore` turns one data-plane request (a list of frames) into zero or more replies and
keeps the pulls the consistency policy holds back. The ZeroMQ loop (``ps.data``) and the gRPC
servicer (``ps.control``) call it under :attr:`ShardCore.lock`; tests call it directly.

A request is validated completely before anything changes: a bad request gets one ``ERROR`` reply
naming what was wrong, and the shard's parameters, state and clocks are as before. Parameters are
written only from the data loop's thread (``handle`` and ``tick``), which also sends the replies,
so a buffer cannot change between building a reply and handing it to ZeroMQ.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.keyplan import DIGEST_BYTES, value_digest
from bitps.proto.wire import PROTOCOL, PSError, error_name, parse_header
from bitps.ps import checks, publish
from bitps.ps.clocks import ClockTable
from bitps.ps.config import ServerConfig
from bitps.ps.consistency import key_pushers, make_consistency
from bitps.ps.held import HeldPulls
from bitps.ps.metrics import ClockSnapshot, ShardMetrics
from bitps.ps.publish import Publisher
from bitps.ps.rules import make_rule
from bitps.ps.store import Slot

__all__ = ["Admission", "Reply", "ShardCore"]


@dataclass
class Reply:
    """One outgoing message: the routing id, the header and payload arrays. ``buffers`` is aligned
    with ``payload``: the parameter buffer a part reads when it goes zero-copy (the sender adds
    its ``zmq.MessageTracker`` so the buffer is not overwritten while being sent), or ``None``
    for a part sent by copy."""

    ident: bytes
    header: pb.DataHeader
    payload: list
    buffers: list


class Admission(NamedTuple):
    """A pull handed parameters: who, for which step, the min live clock then, and how long it
    was held. The SSP guarantee is ``clock - min_clock <= staleness`` for every record."""

    worker: int
    clock: int
    min_clock: int
    waited_s: float


class ShardCore:
    """State and logic of one shard."""

    def __init__(self, cfg: ServerConfig, *, metrics: ShardMetrics | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.now = now
        self.lock = threading.RLock()
        self.metrics = metrics or ShardMetrics()
        self.metrics.watch_clocks(self.clock_snapshot)
        self.rule = make_rule(cfg.optimizer, cfg)
        self.consistency = make_consistency(cfg)
        self.clocks = ClockTable(timeout_s=cfg.heartbeat_timeout_s, now=now)
        self.slots: dict[int, Slot] = {}
        self.signature = ""
        self.model_keys = 0
        """Keys of the whole model's plan, as registrations name it (0: not named)."""
        self.partial = False
        """Whether some registered worker does not push every key here (partial plans:
        pipeline stages), so SSP admission is no longer ordered by clock alone."""
        self.initialized = threading.Event()
        """Set while every key held has its initial values (``Slot.initialized``)."""
        self._init_changed = threading.Condition()  # a key's initial values landed
        self.held = HeldPulls(limit=cfg.max_held_pulls)
        self.admissions: deque[Admission] = deque(maxlen=100_000)
        self.updates_applied = 0
        self._changes = 0  # pushes taken and membership changes: versions may have moved
        self._applied_ids: dict[int, tuple[deque, set]] = {}  # worker -> its last pushes
        self._membership_changed = False
        self._changed_ranks: set[int] | None = set()  # whose change; None: unknown
        self.pull_codec: Codec | None = self.rule.published_codec()
        """What this shard publishes for compressed pulls (``ps.publish``): the rule's own
        codes (1-bit Adam's sign1), else fixed by the first registration; ``RAW`` = parameters
        only."""

    # -- registration (gRPC) ------------------------------------------------------------------
    def check_registration(self, req: pb.RegisterRequest) -> None:
        """Everything about a registration that its values are not needed for: token,
        protocol, shard, world, the shard's limits, signature. Raises :class:`PSError`; the
        control service calls it before it reads a single value."""
        cfg = self.cfg
        if not checks.token_ok(cfg.token, req.token):
            raise PSError(pb.UNAUTHENTICATED, f"rank {req.rank}: token missing or wrong")
        if req.protocol != PROTOCOL:
            raise PSError(pb.PROTOCOL, f"worker speaks protocol {req.protocol}, shard {PROTOCOL}")
        if req.num_shards != cfg.num_shards or req.shard_id != cfg.shard_id:
            raise PSError(pb.BAD_HEADER, f"worker's plan is for shard {req.shard_id} of "
                          f"{req.num_shards}; this is shard {cfg.shard_id} of {cfg.num_shards}")
        if not req.world_size or req.rank >= req.world_size:
            raise PSError(pb.BAD_HEADER, f"rank {req.rank} outside world size {req.world_size}")
        if not req.signature:
            raise PSError(pb.BAD_HEADER, f"rank {req.rank} sent no model signature")
        with self.lock:
            self._check_limits(req)
            if self.signature and req.signature != self.signature:
                raise PSError(pb.BAD_HEADER, f"rank {req.rank} registered model signature "
                              f"{req.signature!r}; this shard holds {self.signature!r}")
            if req.model_keys and self.model_keys and req.model_keys != self.model_keys:
                raise PSError(pb.BAD_HEADER, f"rank {req.rank}'s plan is of a model of "
                              f"{req.model_keys} keys; this shard's workers have "
                              f"{self.model_keys}")
            if self.clocks.world_size and req.world_size != self.clocks.world_size:
                raise PSError(pb.BAD_HEADER, f"rank {req.rank} registered world size "
                              f"{req.world_size}; this shard's workers have "
                              f"{self.clocks.world_size}")

    def _check_limits(self, req: pb.RegisterRequest) -> None:
        """The shard's limits over the union of the plans registered so far and ``req``'s
        (partial plans add keys)."""
        cfg = self.cfg
        if req.world_size > cfg.max_workers:
            raise PSError(pb.LIMIT, f"rank {req.rank} registered world size {req.world_size}; "
                          f"this shard takes at most max_workers {cfg.max_workers}")
        new = [spec for spec in req.keys if spec.key not in self.slots]
        if len(req.keys) > cfg.max_plan_keys or len(self.slots) + len(new) > cfg.max_plan_keys:
            raise PSError(pb.LIMIT, f"rank {req.rank}'s plan gives this shard {len(req.keys)} "
                          f"keys ({len(self.slots) + len(new)} with those it holds); it takes "
                          f"at most max_plan_keys {cfg.max_plan_keys}")
        nbytes = max(sum(spec.length for spec in req.keys),
                     sum(spec.length for spec in new)
                     + sum(s.length for s in self.slots.values())) * 4
        if nbytes > cfg.max_plan_bytes:
            raise PSError(pb.LIMIT, f"rank {req.rank}'s plan gives this shard {nbytes} bytes "
                          f"of parameters; it takes at most max_plan_bytes {cfg.max_plan_bytes}")

    def register(self, req: pb.RegisterRequest, values: dict[int, bytes]) -> pb.RegisterReply:
        """Admit a worker with its plan for this shard: the first registration fixes the
        signature; the shard's keys are the union of the registered plans (a pipeline stage
        registers only its own keys), each key's spec the same in every plan, and each key
        counts as pushers the ranks whose plan has it. ``values`` initialize the keys not
        initialized yet. Raises :class:`PSError` (nothing changed) when the request disagrees
        with the shard."""
        cfg = self.cfg
        with self.lock:  # the same lock over the checks and the changes
            self.check_registration(req)
            # Check everything before keeping anything: a refused first registration leaves
            # the shard as empty as it was.
            pull = self.pull_codec or self._pull_codec(req)
            if self.rule.published_codec() is None:  # else the rule's codes, for every key
                self._check_pulls(req, pull)
            slots = {**self.slots, **self._new_slots(req, pull)}
            if req.sends_values:
                self._check_values(req, slots, values)
            if req.value_digests and (len(req.value_digests) != len(req.keys) or any(
                    len(d) != DIGEST_BYTES for d in req.value_digests)):
                raise PSError(pb.BAD_HEADER, f"rank {req.rank} sent {len(req.value_digests)} "
                              f"value digests of {sorted({len(d) for d in req.value_digests})} "
                              f"bytes; expected none or {len(req.keys)} of {DIGEST_BYTES}")
            self.slots, self.signature, self.pull_codec = slots, req.signature, pull
            self.model_keys = self.model_keys or req.model_keys
            self._take_pushers(req.rank, {spec.key for spec in req.keys})
            if req.sends_values:
                # A restarted initializer must not reset trained parameters.
                for key, data in values.items():
                    if not slots[key].initialized:
                        slots[key].set_values(data)
                        slots[key].initialized = True
            self.clocks.register(req.rank, req.world_size, self.clocks.min_clock())
            self._check_partial()
            self.check_initialized()
            start = self.clocks.workers[req.rank].clock
        return pb.RegisterReply(shard_id=cfg.shard_id, num_shards=cfg.num_shards, mode=cfg.mode,
                                staleness=cfg.staleness, start_clock=start,
                                max_frame_bytes=cfg.max_frame_bytes,
                                onebit=self.rule.register_params(),
                                holds_pulls=self.consistency.holds_pulls(req.world_size))

    def _take_pushers(self, rank: int, keys: set[int]) -> None:
        """``rank``'s plan has ``keys`` of this shard (and no other): it pushes them. Where it
        stops counting for a key (a partial plan, or a rank counted before its plan was
        known), the next :meth:`tick` finishes what waited for it."""
        unknown = not self.clocks.is_registered(rank)
        for key, slot in self.slots.items():
            if key in keys:
                slot.pushers.add(rank)
            elif rank in slot.pushers or unknown:
                slot.pushers.discard(rank)
                # once registered, the rank no longer looks like one a key waits for: look
                # at every key again
                self._mark_changed(None)

    def _check_partial(self) -> None:
        """Whether some registered worker does not push some key (:attr:`partial`)."""
        registered = {r for r, w in self.clocks.workers.items() if w.registered}
        self.partial = any(not s.pushers >= registered for s in self.slots.values())

    def _mark_changed(self, rank: int | None) -> None:
        """The live set or a plan changed for ``rank`` (``None``: unknown); the next
        :meth:`tick` finishes what waited for it."""
        self._membership_changed = True
        if rank is None or self._changed_ranks is None:
            self._changed_ranks = None
        else:
            self._changed_ranks.add(rank)

    def check_initialized(self) -> None:
        """Set :attr:`initialized` from the keys' flags and wake the registrations waiting for
        their keys' values (:meth:`wait_initialized`)."""
        if self.slots and all(s.initialized for s in self.slots.values()):
            self.initialized.set()
        else:
            self.initialized.clear()
        with self._init_changed:
            self._init_changed.notify_all()

    def keys_initialized(self, keys) -> bool:
        """Whether every key of ``keys`` held here has its initial values."""
        slots = self.slots  # replaced whole by register: one read is consistent
        return all(slots[k].initialized for k in keys if k in slots)

    def uninitialized_keys(self) -> int:
        """Keys held whose initial values have not landed."""
        with self.lock:
            return sum(not s.initialized for s in self.slots.values())

    def wait_initialized(self, keys, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every key of ``keys`` has its initial values (the
        registration of a worker that does not initialize them). Takes no core lock: a
        registration notifies while it holds it."""
        keys = list(keys)
        with self._init_changed:
            return self._init_changed.wait_for(lambda: self.keys_initialized(keys), timeout_s)

    def current_copies(self, req: pb.RegisterRequest) -> tuple[list[int], list[int]]:
        """The keys (and their versions) whose values equal the ``value_digests`` a registering
        worker sent: its copies of them are current and need no initial pull. Hashed under the
        lock, so no update lands between the values and the version."""
        keys, versions = [], []
        with self.lock:
            for spec, digest in zip(req.keys, req.value_digests):
                slot = self.slots.get(spec.key)
                if slot is not None and value_digest(slot.param) == digest:
                    keys.append(spec.key)
                    versions.append(slot.version)
        return keys, versions

    def optimizer_state(self, rank: int) -> list[pb.KeyOptimizerState]:
        """sync 1-bit Adam: every key's momentum and frozen v, for a worker at the freeze.
        Raises :class:`PSError` before the freeze or for another rule."""
        with self.lock:
            if not self.clocks.is_registered(rank):
                raise PSError(pb.NOT_REGISTERED, f"rank {rank} is not registered with shard "
                              f"{self.cfg.shard_id}")
            # a partial plan's worker gets the state of its own keys only
            return self.rule.optimizer_state({k: s for k, s in self.slots.items()
                                              if rank in s.pushers})

    def codec_state(self) -> dict[int, np.ndarray]:
        """The shard's error-feedback residuals by key (copies; keys that publish codes: 1-bit
        Adam, compressed pulls): the codec state a checkpoint saves beside parameters and
        optimizer state."""
        with self.lock:
            return {k: s.publisher.server.residual.copy() for k, s in self.slots.items()
                    if s.publisher is not None}

    def load_codec_state(self, residuals: dict[int, np.ndarray]) -> None:
        """Restore :meth:`codec_state`; raises :class:`PSError` (nothing changed) when a key or
        a length does not match."""
        with self.lock:
            for key, r in residuals.items():
                slot = self.slots.get(key)
                if slot is None or slot.publisher is None:
                    raise PSError(pb.UNKNOWN_KEY, f"key {key} has no codec state on shard "
                                  f"{self.cfg.shard_id}")
                if r.shape != (slot.length,):
                    raise PSError(pb.BAD_LENGTH, f"key {key}: residual of shape {r.shape}; "
                                  f"expected ({slot.length},)")
            for key, r in residuals.items():
                np.copyto(self.slots[key].publisher.server.residual, r, casting="same_kind")

    @staticmethod
    def _pull_codec(req: pb.RegisterRequest) -> Codec:
        """The pull codec a registration asks for (``BAD_DTYPE`` when it is not one)."""
        try:
            return Codec.from_header(pb.DataHeader(codec=req.pull_codec,
                                                   codec_chunk=req.pull_codec_chunk,
                                                   codec_flags=req.pull_codec_flags))
        except PSError as err:
            raise PSError(pb.BAD_DTYPE, f"rank {req.rank} pull codec: {err.message}") from None

    def _check_pulls(self, req: pb.RegisterRequest, pull: Codec) -> None:
        """Every worker must pull as the first did: the shard's parameters follow the codes
        it publishes, one stream per key (a key held already must be compressed alike)."""
        asked = self._pull_codec(req)
        held = [(spec, self.slots[spec.key]) for spec in req.keys if spec.key in self.slots]
        compressed = sum(spec.compressed_pull for spec, _ in held)
        published = sum(slot.publisher is not None for _, slot in held)
        if asked != pull or any(spec.compressed_pull != (slot.publisher is not None)
                                for spec, slot in held):
            raise PSError(pb.BAD_DTYPE, f"rank {req.rank} pulls {asked.name} for "
                          f"{compressed} of its {len(held)} keys held here; this shard "
                          f"publishes {pull.name} for {published} of them (every worker needs "
                          f"the same pull codec and compress_min_bytes)")

    def _new_slots(self, req: pb.RegisterRequest, pull: Codec) -> dict[int, Slot]:
        """Slots for ``req``'s keys this shard does not hold yet, once every key it does hold
        has the same spec in ``req`` (else ``BAD_HEADER`` naming the key and both specs)."""
        slots, seen = {}, set()
        model_keys = self.model_keys or req.model_keys
        for spec in req.keys:
            if spec.dtype != pb.FLOAT32:
                raise PSError(pb.BAD_DTYPE, f"key {spec.key} has dtype "
                              f"{pb.DType.Name(spec.dtype)}; this shard stores FLOAT32")
            if spec.key in seen or not spec.length:
                raise PSError(pb.BAD_HEADER, f"key {spec.key} duplicated or empty in the plan")
            seen.add(spec.key)
            if model_keys and spec.key >= model_keys:
                raise PSError(pb.UNKNOWN_KEY, f"key {spec.key} is outside the model's plan of "
                              f"{model_keys} keys")
            held = self.slots.get(spec.key)
            if held is not None:
                if (mine := _spec_text(held.spec)) != (theirs := _spec_text(spec)) \
                        and not _shapeless_match(held.spec, spec):
                    raise PSError(pb.BAD_HEADER, f"key {spec.key}: rank {req.rank}'s plan has "
                                  f"{theirs}; this shard holds it as {mine} (every plan must "
                                  f"cut the model alike)")
                continue
            if spec.length * 4 > self.cfg.max_frame_bytes:
                raise PSError(pb.TOO_LARGE, f"key {spec.key} is {spec.length * 4} bytes; frames "
                              f"are limited to {self.cfg.max_frame_bytes}")
            slots[spec.key] = slot = Slot.zeros(spec, self.rule.new_state(spec.length))
            self.rule.setup(slot)
            if slot.publisher is not None:
                continue  # the rule publishes its own codes (1-bit Adam)
            if spec.compressed_pull and not pull.is_raw:
                slot.publisher = Publisher(pull, spec.length,
                                           history=self.cfg.optimizer.delta_history)
            elif self.consistency.looks_ahead:
                slot.last_delta = np.zeros(spec.length, np.float32)
        return slots

    @staticmethod
    def _check_values(req: pb.RegisterRequest, slots: dict[int, Slot],
                      values: dict[int, bytes]) -> None:
        mine = {spec.key for spec in req.keys}
        if set(values) != mine:
            missing = sorted(mine - set(values))[:5]
            extra = sorted(set(values) - mine)[:5]
            raise PSError(pb.UNKNOWN_KEY, f"initial values must cover exactly the worker's keys "
                          f"of this shard; missing {missing}, unknown {extra}")
        for key, data in values.items():
            if len(data) != slots[key].nbytes:
                raise PSError(pb.BAD_LENGTH, f"initial value of key {key} is {len(data)} bytes; "
                              f"expected {slots[key].nbytes}")

    def leave(self, rank: int) -> None:
        """``rank`` left cleanly: it stops counting for sync aggregates and SSP bounds. Called
        from gRPC threads, so it only marks the change: parameters are written by the data loop
        alone, whose next :meth:`tick` applies the aggregates and answers the pulls this frees."""
        with self.lock:
            self.clocks.leave(rank)
            self._mark_changed(rank)

    # -- data plane ---------------------------------------------------------------------------
    def handle(self, ident: bytes, frames: list) -> list[Reply]:
        """Handle one request; returns the replies ready now (held pulls come later)."""
        t0 = self.now()
        try:
            header = parse_header(frames[0])
        except PSError as err:
            return [self._error(ident, pb.DataHeader(), err)]
        try:
            with self.lock:
                return self._dispatch(ident, header, frames[1:], t0)
        except PSError as err:
            return [self._error(ident, header, err)]

    def _dispatch(self, ident: bytes, header: pb.DataHeader, payload: list, t0: float):
        slots, grads, codec, pull_clock = self._validate(header, payload)
        op, worker = header.op, header.worker
        self.metrics.requests.labels(checks.OPS[op]).inc()
        self.clocks.seen(worker, pull_clock)
        min_clock = self.clocks.min_clock()
        replies = []
        if grads is not None:  # none for a pull, or for a push this shard has applied already
            self._push(header, payload, grads, codec, slots, min_clock)
            self._remember(header)
            self._changes += 1
            self.metrics.push_latency.observe(self.now() - t0)
        # This request moved a clock or a version: pulls held earlier may go now.
        replies += self._release_held(min_clock)
        if op == pb.PUSH:
            replies.append(self._ack(ident, header, min_clock))
        else:
            replies += self._pull(ident, header, pull_clock, slots, t0, min_clock)
        return replies

    def _validate(self, header: pb.DataHeader, payload: list):
        """The request's slots, decoded gradients (``None`` for a pull and for a replayed push),
        codec and the clock it is for; raises :class:`PSError` before anything changes
        (``ps.checks``)."""
        cfg = self.cfg
        slots = checks.request_slots(cfg, header, payload, self.slots,
                                     registered=self.clocks.is_registered(header.worker))
        clock = checks.check_clock(cfg, header, self.clocks.workers[header.worker].clock)
        replay = header.op != pb.PULL and self._is_replay(header)
        if header.op != pb.PUSH and self.held.full(header.worker):
            raise PSError(pb.LIMIT, f"worker {header.worker} has {self.held.count(header.worker)}"
                          f" pulls held on shard {cfg.shard_id}; it may have at most "
                          f"max_held_pulls {cfg.max_held_pulls}")
        if header.op == pb.PULL or replay:
            return slots, None, None, clock
        grads, codec = checks.decode_push(cfg, header, payload, slots)
        self.consistency.check_push(header, slots)
        return slots, grads, codec, clock

    def _is_replay(self, header: pb.DataHeader) -> bool:
        """Whether this push (worker, incarnation, request id) has been applied already."""
        seen = self._applied_ids.get(header.worker)
        return bool(header.incarnation) and seen is not None and (
            header.incarnation, header.request_id) in seen[1]

    def _remember(self, header: pb.DataHeader) -> None:
        """Keep an applied push's id, the last ``dedup_window`` of each worker."""
        if not header.incarnation or not self.cfg.dedup_window:
            return
        order, ids = self._applied_ids.setdefault(header.worker, (deque(), set()))
        order.append(pid := (header.incarnation, header.request_id))
        ids.add(pid)
        if len(order) > self.cfg.dedup_window:
            ids.discard(order.popleft())

    def dedup_state(self) -> dict[int, list[tuple[int, int]]]:
        """The exactly-once window (``dedup_window``): per worker, the ``(incarnation, request
        id)`` of its last applied pushes, oldest first, as a checkpoint saves it. Nothing else
        is needed to answer a replay: a push gets an ack, a push_pull the current parameters."""
        with self.lock:
            return {w: list(order) for w, (order, _) in self._applied_ids.items()}

    def load_dedup_state(self, window: dict[int, list[tuple[int, int]]]) -> None:
        """Replace the exactly-once window with :meth:`dedup_state`'s ``window``; a worker's
        oldest ids beyond this shard's ``dedup_window`` are dropped (all of them at 0)."""
        keep = self.cfg.dedup_window
        with self.lock:
            self._applied_ids = {}
            for worker, ids in window.items():
                order = deque((int(inc), int(rid)) for inc, rid in ids[max(len(ids) - keep, 0):]) \
                    if keep else deque()
                if order:
                    self._applied_ids[int(worker)] = (order, set(order))

    def _push(self, header: pb.DataHeader, payload: list, grads: list[np.ndarray],
              codec: Codec, slots: list[Slot], min_clock: int):
        m = self.metrics
        nbytes = sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in payload)
        if not codec.is_raw:
            m.codec_wire_bytes.labels(codec.name).inc(nbytes)
            m.codec_decoded_bytes.labels(codec.name).inc(sum(s.nbytes for s in slots))
        self.consistency.push(self, header, slots, grads, self.clocks.live(), min_clock)
        m.push_bytes.inc(nbytes)

    def apply_arrived(self, slot: Slot, grad: np.ndarray, clock: int, lr_scale: float) -> None:
        """Apply one push on arrival (async/ssp) at ``lr_scale`` times the learning rate."""
        self.rule.arrived(slot, clock)
        self.rule.update(slot, grad, clock=clock, lr_scale=lr_scale)

    def try_aggregate(self, slot: Slot, live: list[int]) -> bool:
        """sync: apply the mean of ``slot``'s pushes once every one of ``live`` (the key's live
        pushers, ``ps.consistency.key_pushers``) is in."""
        if not slot.pushed or not slot.pushed.issuperset(live):
            return False
        # the step being applied is clock slot.version
        slot.apply_aggregate(self.rule, lr_scale=self.cfg.optimizer.schedule.factor(slot.version))
        self.applied(0, 0)
        self.rule.aggregated(slot)
        return True

    def applied(self, clock_gap: int, version_gap: int) -> None:
        """Count one applied update and the staleness it was applied with."""
        self.updates_applied += 1
        self.metrics.updates.inc()
        self.metrics.clock_gap.observe(max(clock_gap, 0))
        self.metrics.version_gap.observe(max(version_gap, 0))

    def _admits(self, clock: int, slots: list[Slot]) -> bool:
        return self.consistency.admits(self.clocks, clock, slots)

    def _pull(self, ident, header, clock, slots, t0, min_clock) -> list[Reply]:
        if self._admits(clock, slots):
            return [self._answer(ident, header, clock, slots, t0, min_clock)]
        deadline = min(header.deadline_s or self.cfg.pull_deadline_s,
                       self.cfg.max_pull_deadline_s)
        self.held.hold(ident, header, clock, slots, t0, t0 + deadline)
        return []

    def _answer(self, ident, header, clock, slots, since, min_clock) -> Reply:
        now, m = self.now(), self.metrics
        if self.partial:  # the slowest of those the keys wait for (SSP's bound), not of all
            min_clock = self.clocks.min_clock_of(key_pushers(self.clocks, slots))
        frame_codecs = []
        publishes = self.pull_codec is not None and not self.pull_codec.is_raw
        # async/ssp: by the time this worker's next push lands, the key's other live pushers'
        # pushes have probably been applied: hand out the parameters that far ahead
        if publishes:
            frames, frame_codecs = publish.reply_frames(header, slots)
        elif self.consistency.looks_ahead:
            frames = []
            for s in slots:
                ahead = len(key_pushers(self.clocks, (s,))) - 1
                frames.append(s.lookahead(ahead) if ahead > 0 and s.last_delta is not None
                              else s.reply_frame())
        else:
            frames = [s.reply_frame() for s in slots]
        m.pull_bytes.inc(sum(f.nbytes if isinstance(f, np.ndarray) else len(f)
                             for f, _ in frames))
        m.pull_latency.observe(now - since)
        self.consistency.observe_admission(m, clock, min_clock)
        self.admissions.append(Admission(header.worker, clock, min_clock, now - since))
        out = pb.DataHeader(op=pb.REPLY, protocol=PROTOCOL, worker=header.worker,
                            request_id=header.request_id, clock=clock, keys=header.keys,
                            versions=[s.version for s in slots], dtype=pb.FLOAT32,
                            min_clock=min_clock, frame_codecs=frame_codecs)
        if publishes:
            _, out.codec_chunk, out.codec_flags = self.pull_codec.wire_fields()
        return Reply(ident, out, [f for f, _ in frames], [buf for _, buf in frames])

    def _ack(self, ident: bytes, header: pb.DataHeader, min_clock: int) -> Reply:
        out = pb.DataHeader(op=pb.REPLY, protocol=PROTOCOL, worker=header.worker,
                            request_id=header.request_id, clock=header.clock,
                            min_clock=min_clock)
        return Reply(ident, out, [], [])

    def _error(self, ident: bytes, header: pb.DataHeader, err: PSError) -> Reply:
        self.metrics.errors.labels(error_name(err.code)).inc()
        out = pb.DataHeader(op=pb.ERROR, protocol=PROTOCOL, worker=header.worker,
                            request_id=header.request_id, clock=header.clock, error=err.code,
                            message=err.message)
        return Reply(ident, out, [], [])

    # -- time passing -------------------------------------------------------------------------
    def tick(self) -> list[Reply]:
        """Expire silent workers, complete sync aggregates they were blocking, answer or time out
        held pulls. Called by the data loop on a timer (requests release what they unblock
        themselves, in :meth:`handle`)."""
        with self.lock:
            for rank in self.clocks.expire():
                self._mark_changed(rank)
            if self._membership_changed:
                ranks, self._changed_ranks = self._changed_ranks, set()
                self._membership_changed = False
                self._changes += 1
                self.consistency.membership_changed(self, self.clocks.live(), ranks)
            return self._release_held(self.clocks.min_clock())

    def shut_down(self) -> list[Reply]:
        """The shard is stopping: every held pull, removed, as a ``SHUTTING_DOWN`` error reply,
        so its worker learns it now instead of at its deadline. For the data loop's thread,
        after its last request."""
        with self.lock:
            # admitted by nothing, and every deadline passed: release hands back all of them
            _, held = self.held.release(lambda h: False, state=object(), now=math.inf,
                                        ordered=False)
            return [self._error(h.ident, h.header, PSError(
                pb.SHUTTING_DOWN, f"shard {self.cfg.shard_id} is shutting down; the pull for "
                f"clock {h.clock} of worker {h.header.worker} was not answered (pull again "
                f"once the shard is back)")) for h in held]

    def clock_snapshot(self) -> ClockSnapshot:
        """Clocks for the metrics endpoint (read at scrape time)."""
        with self.lock:
            c = self.clocks
            states = [s.onebit for s in self.slots.values() if s.onebit is not None]
            keys = self.rule.compressing_keys(self.slots)
            clocks = {r: w.clock for r, w in c.workers.items()}
            min_clock, live, held = c.min_clock(), len(c.live()), len(self.held)
        # A pass over every residual: outside the lock, so the data loop never waits for a
        # scrape (a residual updated meanwhile only moves the reading).
        norm = float(np.sqrt(sum(o.server.residual_norm() ** 2 for o in states)))
        return ClockSnapshot(clocks=clocks, min_clock=min_clock, live=live, held=held,
                             onebit_keys=keys, onebit_residual_norm=norm)

    def _release_held(self, min_clock: int) -> list[Reply]:
        """Answer held pulls that are admitted now, fail those past their deadline (looked at
        only when a clock, the live set or a version may have moved: ``ps.held``)."""
        now = self.now()
        # partial plans: a pull's admission depends on its keys' pushers, not its clock alone
        admitted, expired = self.held.release(
            lambda h: self._admits(h.clock, h.slots), state=(self.clocks.generation,
                                                             self._changes),
            now=now, ordered=self.consistency.ordered and not self.partial)
        replies = []
        for h in admitted:
            self.metrics.pull_wait.observe(now - h.since)
            replies.append(self._answer(h.ident, h.header, h.clock, h.slots, h.since,
                                        min_clock))
        for h in expired:
            replies.append(self._error(h.ident, h.header, PSError(
                pb.DEADLINE, self._waiting_for(h.header.worker, h.clock, h.slots))))
        return replies

    def _waiting_for(self, worker: int, clock: int, slots: list[Slot]) -> str:
        return self.consistency.waiting_for(self.clocks, worker, clock, slots)

    def held_reasons(self) -> dict[int, str]:
        """What each worker's held pull waits for (for Status)."""
        with self.lock:
            return {h.header.worker: self._waiting_for(h.header.worker, h.clock, h.slots)
                    for h in self.held}



def _spec_text(spec: pb.KeySpec) -> str:
    """What two plans must agree on for a key, in words."""
    shape = list(spec.shape.dims) if spec.HasField("shape") else None
    return (f"{spec.name}[{spec.offset}:{spec.offset + spec.length}] "
            f"{pb.DType.Name(spec.dtype)} shape {shape} "
            f"{'compressed' if spec.compressed_pull else 'raw'} pulls")


def _shapeless_match(a: pb.KeySpec, b: pb.KeySpec) -> bool:
    """The same key but for a shape one side does not send (a worker that predates
    ``KeySpec.shape``)."""
    if a.HasField("shape") and b.HasField("shape"):
        return False
    strip = [pb.KeySpec(), pb.KeySpec()]
    for out, spec in zip(strip, (a, b)):
        out.CopyFrom(spec)
        out.ClearField("shape")
    return _spec_text(strip[0]) == _spec_text(strip[1])
