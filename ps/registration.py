"""Registration: how a shard takes a worker's key plan (the gRPC ``Register`` half of
:class:`~bitps.ps.shard.ShardCore`).

A registration is checked whole before anything is kept: token, protocol, shard, world, the
shard's limits, signature, each key's spec against the keys held (partial plans: the shard's
keys are the union of the registered plans, and a key in two plans must have the same spec),
the pull codec, and the initial values. Then the new keys get their slots (the update rule
makes each key's state, ``UpdateRule.setup``), the rank counts as a pusher of its keys, and
the values of keys not initialized yet land. Everything runs under the core's lock.

:class:`Registration` is a part of ``ShardCore`` (a base class it inherits), not an object of
its own: it reads and sets the core's slots, signature, clocks and pull codec.
"""

from __future__ import annotations

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.keyplan import DIGEST_BYTES, value_digest
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps import checks
from bitps.ps.publish import Publisher
from bitps.ps.store import Slot

__all__ = ["Registration"]


class Registration:
    """The registration methods of ``ShardCore`` (see the module docstring)."""

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
            # the live ranks went on without it: dropped, or dropped and heard from again
            # since (a pull or a heartbeat makes it live at its old clock)
            skipped = self.clocks.was_dropped(req.rank)
            self.clocks.register(req.rank, req.world_size, self.clocks.min_clock())
            self._check_partial()
            self.check_initialized()
            step = self.consistency.rejoin_step([slots[s.key] for s in req.keys]) \
                if skipped else 0
            if step:
                self.clocks.seen(req.rank, step)  # its next push is for that step
            start = self.consistency.start_clock(req.rank, [slots[s.key] for s in req.keys],
                                                 self.clocks.workers[req.rank].clock)
        reply = pb.RegisterReply(shard_id=cfg.shard_id, num_shards=cfg.num_shards, mode=cfg.mode,
                                 staleness=cfg.staleness, start_clock=start,
                                 max_frame_bytes=cfg.max_frame_bytes, rule=self.rule.name,
                                 holds_pulls=self.consistency.holds_pulls(req.world_size),
                                 incarnation=self.incarnation, step=step)
        # the shard moves float32 pulls ahead itself (core._answer), but its codes must reach
        # the worker's exact copy: with a publishing pull codec the worker looks ahead
        reply.worker_lookahead = self.consistency.looks_ahead and self.pull_codec is not None \
            and not self.pull_codec.is_raw
        params = self.rule.rule_params()
        if params is not None:
            reply.rule_params.Pack(params)
        return reply

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
            slots[spec.key] = slot = Slot.zeros(spec)
            self.rule.setup(slot)
            if slot.publisher is not None:
                continue  # the rule publishes codes of its own
            if spec.compressed_pull and not pull.is_raw:
                slot.publisher = Publisher(pull, spec.length,
                                           history=self.cfg.optimizer.delta_history)
            elif self.consistency.looks_ahead:
                slot.track_updates()
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

