"""The shard's request handler: validation, updates, clocks and held pulls, without sockets.

:class:`ShardCore` turns one data-plane request (a list of frames) into zero or more replies and
keeps the pulls the consistency policy holds back. The ZeroMQ loop (``ps.data``) and the gRPC
servicer (``ps.control``) call it under :attr:`ShardCore.lock`; tests call it directly.

A request is validated completely before anything changes: a bad request gets one ``ERROR`` reply
naming what was wrong, and the shard's parameters, state and clocks are as before. Parameters are
written only from the data loop's thread (``handle`` and ``tick``), which also sends the replies,
so a buffer cannot change between building a reply and handing it to ZeroMQ.

The core is split by noun: registration (``ps.registration``, the part of ``ShardCore`` that
takes key plans), the replies and a pull's frames (``ps.replies``), the exactly-once window
(``ps.dedup``); the consistency mode (``ps.consistency``) and the update rule (``ps.rules``)
are objects it asks, and it names neither a mode nor a rule.
"""

from __future__ import annotations

import functools
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from bitps.native.keypool import KeyPool
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.wire import PROTOCOL, PSError, error_name, parse_header
from bitps.ps import checks
from bitps.ps.clocks import ClockTable
from bitps.ps.config import ServerConfig
from bitps.ps.consistency import make_consistency
from bitps.ps.dedup import ExactlyOnce
from bitps.ps.held import HeldPulls
from bitps.ps.metrics import ClockSnapshot, ShardMetrics
from bitps.ps.publish import PublishedCodes
from bitps.ps.registration import Registration
from bitps.ps.replies import Admission, Reply, reply_frames
from bitps.ps.rules import make_rule
from bitps.ps.store import Slot
from bitps.ps.updates import Updates

__all__ = ["Admission", "Reply", "ShardCore"]


class ShardCore(Registration):
    """State and logic of one shard."""

    def __init__(self, cfg: ServerConfig, *, metrics: ShardMetrics | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.now = now
        self.incarnation = secrets.randbits(63) | 1
        """This core's life (``RegisterReply.incarnation``, ``HeartbeatReply.incarnation``):
        a restarted shard, restored from a checkpoint or not, has another one."""
        self.lock = threading.RLock()
        self.metrics = metrics or ShardMetrics()
        self.metrics.watch_clocks(self.clock_snapshot)
        self.rule = make_rule(cfg.optimizer, cfg)
        self.updates = Updates(self.rule, cfg, self.metrics)
        """Applies validated pushes through the rule (``ps.updates``), as the mode decides."""
        self.key_pool = KeyPool(cfg.threads)
        """Spreads a push's keys over ``cfg.threads`` threads (``native.keypool``); the modes
        apply a push's keys through it."""
        self.metrics.watch_rule(self._rule_metrics)
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
        self._changes = 0  # pushes taken and membership changes: versions may have moved
        self.dedup = ExactlyOnce(cfg.dedup_window)
        """The ids of each worker's last applied pushes (``ps.dedup``; a ``Stateful``)."""
        self.codecs = PublishedCodes(lambda: self.slots, self.lock)
        """Every key's published codes and their residuals (``ps.publish``; a ``Stateful``):
        the codec state a checkpoint saves beside parameters and rule state."""
        self._membership_changed = False
        self._changed_ranks: set[int] | None = set()  # whose change; None: unknown
        self.pull_codec: Codec | None = self.rule.published_codec()
        """What this shard publishes for compressed pulls (``ps.publish``): the rule's own
        codes when it publishes some, else fixed by the first registration; ``RAW`` =
        parameters only."""

    @property
    def updates_applied(self) -> int:
        """Updates made (``Updates.applied``; a checkpoint restores it)."""
        return self.updates.applied

    @updates_applied.setter
    def updates_applied(self, n: int) -> None:
        self.updates.applied = n

    @property
    def revision(self) -> tuple[int, int]:
        """Changes to what a checkpoint holds, counted: the clock table's generation (clocks,
        the live set, registrations) and the pushes and membership changes taken. Equal
        revisions, equal checkpoints (``ps.checkpoint.Checkpointer.save_final``)."""
        return self.clocks.generation, self._changes

    def key_pushers(self, slot: Slot, live: list[int]) -> list[int]:
        """``slot``'s live pushers (``ClockTable.key_pushers``); ``live``, the live ranks,
        when no plan is partial (every live rank pushes every key)."""
        return self.clocks.key_pushers((slot,), live) if self.partial else live

    def _mark_changed(self, rank: int | None) -> None:
        """The live set or a plan changed for ``rank`` (``None``: unknown); the next
        :meth:`tick` finishes what waited for it."""
        self._membership_changed = True
        if rank is None or self._changed_ranks is None:
            self._changed_ranks = None
        else:
            self._changed_ranks.add(rank)

    def rule_state(self, rank: int) -> list[pb.KeyRuleState]:
        """The update rule's state of ``rank``'s keys (the RuleState call, one message per
        key, as the rule lays it out). Raises :class:`PSError` for an unregistered rank, or
        when the rule cannot share its state now."""
        with self.lock:
            if not self.clocks.is_registered(rank):
                raise PSError(pb.NOT_REGISTERED, f"rank {rank} is not registered with shard "
                              f"{self.cfg.shard_id}")
            # a partial plan's worker gets the state of its own keys only
            return self.rule.rule_state({k: s for k, s in self.slots.items()
                                         if rank in s.pushers})

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
        # One pass: each part is asked once (checks, the exactly-once window, the clocks, the
        # mode, which applies through self.updates); what the mode refuses is taken back.
        slots, grads, codec, pull_clock = self._validate(header, payload)
        op, worker = header.op, header.worker
        seen = self.clocks.seen(worker, pull_clock)
        min_clock = self.clocks.min_clock()
        replies = []
        if grads is not None:  # none for a pull, or for a push this shard has applied already
            try:
                self._push(header, payload, grads, codec, slots, min_clock)
            except PSError:
                self.clocks.unsee(seen)
                self.dedup.forget(header)
                raise
            self._changes += 1
            self.metrics.push_latency.observe(self.now() - t0)
        self.metrics.requests.labels(checks.OPS[op]).inc()
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
        (``ps.checks``; the mode's own check of a push comes with the push, and what happened
        before it is taken back). A new push's id is kept (``ExactlyOnce.first_time``)."""
        cfg = self.cfg
        worker = self.clocks.workers.get(header.worker)
        slots, clock, grads, codec = checks.validate(
            cfg, header, payload, self.slots, registered=self.clocks.is_registered(header.worker),
            own_clock=worker.clock if worker is not None else 0, pool=self.key_pool,
            keeps_code=self.keeps_code)
        if header.shard_incarnation and header.shard_incarnation != self.incarnation:
            raise PSError(pb.NOT_REGISTERED, f"worker {header.worker}'s request (clock "
                          f"{header.clock}) is for an earlier life of shard {cfg.shard_id} "
                          f"(incarnation {header.shard_incarnation:x}, this is "
                          f"{self.incarnation:x}): register again")
        if grads is not None:
            self.rule.check_push(header, slots, codec)
        if header.op != pb.PUSH and self.held.full(header.worker):
            raise PSError(pb.LIMIT, f"worker {header.worker} has {self.held.count(header.worker)}"
                          f" pulls held on shard {cfg.shard_id}; it may have at most "
                          f"max_held_pulls {cfg.max_held_pulls}")
        if grads is not None and not self.dedup.first_time(header):
            grads = codec = None  # a replay: answered, not applied again
        return slots, grads, codec, clock

    def keeps_code(self, codec: Codec) -> bool:
        """Whether a push of ``codec`` reaches the rule undecoded (``ps.pushcode``): the mode
        reads none of its values and the rule reads the code in its kernel. Read on every
        push, so a core given ``lambda codec: False`` decodes every push first (the path
        before 2026-12-06; ``bitps-bench kernels`` times both, the tests compare them)."""
        return self.consistency.takes_codes and self.rule.takes_code(codec)

    def _push(self, header: pb.DataHeader, payload: list, grads: list[np.ndarray],
              codec: Codec, slots: list[Slot], min_clock: int):
        m = self.metrics
        nbytes = sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in payload)
        if not codec.is_raw:
            m.codec_wire_bytes.labels(codec.name).inc(nbytes)
            m.codec_decoded_bytes.labels(codec.name).inc(sum(s.nbytes for s in slots))
        self.consistency.take_push(self, header, slots, grads, self.clocks.live(), min_clock)
        m.push_bytes.inc(nbytes)

    def _pull(self, ident, header, clock, slots, t0, min_clock) -> list[Reply]:
        if self.consistency.admit(self.clocks, clock, slots, metrics=self.metrics):
            return [self._answer(ident, header, clock, slots, t0, min_clock)]
        deadline = min(header.deadline_s or self.cfg.pull_deadline_s,
                       self.cfg.max_pull_deadline_s)
        self.held.hold(ident, header, clock, slots, t0, t0 + deadline)
        return []

    def _answer(self, ident, header, clock, slots, since, min_clock) -> Reply:
        now, m = self.now(), self.metrics
        if self.partial:  # the slowest of those the keys wait for (SSP's bound), not of all
            min_clock = self.clocks.min_clock_of(self.clocks.key_pushers(slots))
        frame_codecs = []
        publishes = self.pull_codec is not None and not self.pull_codec.is_raw
        # async/ssp: by the time this worker's next push lands, the key's other live pushers'
        # pushes have probably been applied: hand out the parameters that far ahead
        if publishes:
            frames, frame_codecs = reply_frames(header, slots)
        elif self.consistency.looks_ahead:
            frames, live = [], self.clocks.live()
            for s in slots:
                ahead = len(self.key_pushers(s, live)) - 1
                frames.append(s.lookahead(ahead) if ahead > 0 and s.previous is not None
                              else s.reply_frame())
        else:
            frames = [s.reply_frame() for s in slots]
        self.consistency.answered(header.worker, slots, frames)
        m.pull_bytes.inc(sum(f.nbytes if isinstance(f, np.ndarray) else len(f)
                             for f, _ in frames))
        m.pull_latency.observe(now - since)
        self.admissions.append(Admission(header.worker, clock, min_clock, now - since))
        out = pb.DataHeader(op=pb.REPLY, protocol=PROTOCOL, worker=header.worker,
                            request_id=header.request_id, clock=clock, keys=header.keys,
                            versions=[s.version for s in slots], dtype=pb.FLOAT32,
                            min_clock=min_clock, frame_codecs=frame_codecs,
                            incarnation=self.incarnation)
        if publishes:
            _, out.codec_chunk, out.codec_flags = self.pull_codec.wire_fields()
        return Reply(ident, out, [f for f, _ in frames], [buf for _, buf in frames])

    def _ack(self, ident: bytes, header: pb.DataHeader, min_clock: int) -> Reply:
        out = pb.DataHeader(op=pb.REPLY, protocol=PROTOCOL, worker=header.worker,
                            request_id=header.request_id, clock=header.clock,
                            min_clock=min_clock, incarnation=self.incarnation)
        return Reply(ident, out, [], [])

    def _error(self, ident: bytes, header: pb.DataHeader, err: PSError) -> Reply:
        self.metrics.errors.labels(error_name(err.code)).inc()
        out = pb.DataHeader(op=pb.ERROR, protocol=PROTOCOL, worker=header.worker,
                            request_id=header.request_id, clock=header.clock, error=err.code,
                            message=err.message, incarnation=self.incarnation)
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
            _, held = self.held.release(lambda clock, slots: False, state=object(), now=math.inf,
                                        ordered=False)
            return [self._error(h.ident, h.header, PSError(
                pb.SHUTTING_DOWN, f"shard {self.cfg.shard_id} is shutting down; the pull for "
                f"clock {h.clock} of worker {h.header.worker} was not answered (pull again "
                f"once the shard is back)")) for h in held]

    def clock_snapshot(self) -> ClockSnapshot:
        """Clocks for the metrics endpoint (read at scrape time)."""
        with self.lock:
            c = self.clocks
            clocks = {r: w.clock for r, w in c.workers.items()}
            min_clock, live, held = c.min_clock(), len(c.live()), len(self.held)
        return ClockSnapshot(clocks=clocks, min_clock=min_clock, live=live, held=held)

    def _rule_metrics(self):
        """The update rule's own metric families (read at scrape time): collected outside
        the lock, so the data loop never waits for a scrape's pass over the keys."""
        with self.lock:
            slots = list(self.slots.values())
        return list(self.rule.collect(slots))

    def _release_held(self, min_clock: int) -> list[Reply]:
        """Answer held pulls that are admitted now, fail those past their deadline (looked at
        only when a clock, the live set or a version may have moved: ``ps.held``)."""
        now = self.now()
        # partial plans: a pull's admission depends on its keys' pushers, not its clock alone
        admitted, expired = self.held.release(
            functools.partial(self.consistency.admit, self.clocks, metrics=self.metrics),
            state=(self.clocks.generation, self._changes), now=now,
            ordered=self.consistency.ordered and not self.partial)
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
