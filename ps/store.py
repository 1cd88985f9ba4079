"""The key store: each key's parameters, update-rule state and version, copy-on-write.

Replies are sent zero-copy: a parameter buffer handed to ZeroMQ must not change until ZeroMQ is
done with it. So a key's parameters live in a ``Buffer`` (``proto.sendbuffer``) that records
the sends still using it (``zmq.MessageTracker``). An update writes in place when nothing is in
flight (the common case: a worker's next push arrives a round trip after its last pull was
sent) and otherwise on a copy in a spare buffer, which then becomes the key's parameters;
retired buffers are reused once their sends complete, so steady state allocates nothing and a
pull never copies in Python. Keys under :data:`ZERO_COPY_MIN_BYTES` are sent by a copying
send instead (ZeroMQ's one copy is cheaper than tracking a frame that small).

The store knows no update rule: a key's rule state (``Slot.rule_state``) is whatever the rule's
``setup`` put there, and only the rule looks inside (``ps.rules``, which imports this module,
not the other way round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bitps import native
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.sendbuffer import ZERO_COPY_MIN_BYTES, Buffer
from bitps.ps.publish import Publisher
from bitps.ps.pushcode import PushCode, PushCodes

__all__ = ["ZERO_COPY_MIN_BYTES", "Buffer", "Slot"]

_MAX_SPARE = 4
_EMPTY = np.empty(0, dtype=np.float32)


@dataclass
class Slot:
    """One key on a shard."""

    spec: pb.KeySpec
    buffer: Buffer
    rule_state: Any = None
    """The update rule's state of this key, opaque to the store and the core: what the rule's
    ``setup`` made (``ps.rules.KeyState`` for the rules of ``ps.rules``)."""
    version: int = 0
    pushers: set[int] = field(default_factory=set)
    """Ranks whose registered plan has this key (a pipeline stage's workers register only
    their stage's keys): sync waits for, and async splits the learning rate over, the live ones
    (``ClockTable.key_pushers``)."""
    initialized: bool = False
    """Whether the key's initial values have landed (from the worker that initializes it)."""
    acc: np.ndarray = field(default_factory=lambda: _EMPTY)
    """Sync mode: sum of the pushes of the current step (:meth:`step_total` while only one is
    in)."""
    first: np.ndarray | PushCode | PushCodes | None = None
    """Sync mode: the step's first push while it is the only one, kept as received (a raw
    push's view of its frame, which the view keeps alive, or a code the rule reads,
    ``ps.pushcode``) instead of copied into :attr:`acc`: the second push is added to it into
    ``acc`` (in one pass where both are arrays), and a step of one push is applied from it
    directly. With :attr:`sums_codes`, the step's codes while every push is one
    (``PushCodes``)."""
    sums_codes: bool = False
    """Whether the rule reads a sync step of several pushed codes as they came, summing them
    in its kernel (``ps.pushcode.PushCodes``; its ``setup`` says so): they are then kept as
    codes, not decoded into :attr:`acc` as they arrive."""
    pushed: set[int] = field(default_factory=set)
    """Sync mode: ranks that pushed for the current step (in ``acc`` or in ``held``)."""
    held: dict[int, np.ndarray | PushCode] = field(default_factory=dict)
    """Sync mode: pushes waiting for a lower live rank's before they are added."""
    folded: int = 0
    """Sync mode: pushes added to ``acc`` so far this step."""
    step_hyper: tuple[float, float] | None = None
    """Sync mode: the current step's own ``(lr, weight_decay)``, from its first push that
    carried them (``DataHeader.lr``; every push of a step must agree); ``None``: the shard's.
    Not checkpointed: a step restored with some pushes in gets it again from the next push,
    which must carry the same."""
    spare: list[Buffer] = field(default_factory=list)
    publisher: Publisher | None = None
    """The codes pull replies carry (``ps.publish``): set for keys whose pulls are compressed,
    and for every key of a rule that publishes its own (the rule's ``setup`` sets it)."""
    decoded: np.ndarray = field(default_factory=lambda: _EMPTY)
    """Where compressed pushes are decoded to (allocated on the first one)."""
    previous: np.ndarray | None = None
    """Lookahead pulls (``ServerConfig.lookahead``): the parameters before the last update,
    so that the update is ``param - previous`` (:attr:`last_delta`), kept as one copy made
    before each update instead of a copy and a subtraction; ``None`` when the shard does not
    look ahead (:meth:`track_updates` turns it on)."""
    updated: bool = False
    """Whether :attr:`previous` holds the parameters before an update (none yet: no delta)."""
    restored_delta: np.ndarray | None = None
    """A checkpoint's last update, used until the key's next update (:meth:`restore_delta`)."""
    ahead: Buffer | None = None
    """Lookahead pulls: the last parameters handed out ahead (reused once ZeroMQ is done)."""

    @classmethod
    def zeros(cls, spec: pb.KeySpec, rule_state: Any = None) -> Slot:
        return cls(spec=spec, buffer=Buffer(np.zeros(spec.length, np.float32)),
                   rule_state=rule_state)

    @property
    def state(self) -> Any:
        """Deprecated alias of :attr:`rule_state` (kept for one release, CHANGELOG.md)."""
        return self.rule_state

    @property
    def param(self) -> np.ndarray:
        """The key's current parameters (do not write: they may be in flight)."""
        return self.buffer.array

    @property
    def length(self) -> int:
        return self.buffer.array.shape[0]

    @property
    def nbytes(self) -> int:
        return self.buffer.array.nbytes

    # -- updates (the rule decides how: ``UpdateRule.update``) --------------------------------
    def track_updates(self) -> None:
        """Keep the last update from now on (lookahead pulls): :attr:`last_delta`."""
        self.previous = np.zeros(self.length, np.float32)
        self.updated, self.restored_delta = False, None

    def before_update(self, target: np.ndarray) -> None:
        """``target`` (:meth:`writable`'s array) is about to be updated in place: remember
        it when the key keeps its last update."""
        if self.previous is not None:
            np.copyto(self.previous, target)
            self.updated, self.restored_delta = True, None

    @property
    def last_delta(self) -> np.ndarray | None:
        """The last update applied to the key, ``new - old`` parameters (a new array; zeros
        before the first update); ``None`` when the shard does not look ahead."""
        if self.previous is None:
            return None
        if self.restored_delta is not None:
            return self.restored_delta.copy()
        if not self.updated:
            return np.zeros(self.length, np.float32)
        return self.param - self.previous

    def restore_delta(self, delta: np.ndarray) -> None:
        """A checkpoint's :attr:`last_delta`: the lookahead uses it until the next update."""
        if self.previous is None:
            self.track_updates()
        self.restored_delta = np.array(delta, np.float32)

    def lookahead(self, steps: float) -> tuple[np.ndarray, Buffer | None]:
        """The parameters ``steps`` more updates like the last one ahead, ``x + steps * delta``,
        as :meth:`reply_frame` gives a frame: the array and the buffer to track. The key's own
        parameters are unchanged; the array is reused by the next call once it is sent (a
        small key's frame is copied by ZeroMQ at send, which the data loop does before it
        handles the next message, as for :meth:`reply_frame`)."""
        buf = self.ahead
        if buf is None or buf.in_flight():
            # ZeroMQ keeps a buffer it is still sending alive: dropping ours frees it later
            buf = self.ahead = Buffer(np.empty_like(self.param))
        if self.previous is not None and self.updated and self.restored_delta is None \
                and steps:
            # x + steps * (x - previous): the same float32 operations as adding steps times
            # the stored difference, in one pass
            native.look_ahead(self.param, self.previous, buf.array, np.float32(steps))
        else:
            np.copyto(buf.array, self.param)
            if self.restored_delta is not None and steps:
                native.add_scaled(buf.array, self.restored_delta, np.float32(steps))
        return buf.array, (buf if buf.array.nbytes >= ZERO_COPY_MIN_BYTES else None)

    def writable(self) -> np.ndarray:
        """The parameters to update in place: the current array, or a copy of it in a spare
        buffer when ZeroMQ is still sending the current one (which then retires)."""
        current = self.buffer
        if not current.in_flight():
            return current.array
        fresh = self._spare_buffer()
        np.copyto(fresh.array, current.array)
        self.buffer = fresh
        self.spare.append(current)
        if len(self.spare) > _MAX_SPARE:
            # ZeroMQ holds its own reference to buffers it is still sending: dropping ours
            # only means the memory is freed instead of reused.
            self.spare.pop(0)
        return fresh.array

    def set_values(self, data: bytes) -> None:
        """Overwrite the parameters (initial values, or a checkpoint's); the last update is
        forgotten (a checkpoint restores its own: :meth:`restore_delta`)."""
        self.buffer = Buffer(np.frombuffer(data, np.float32).copy())
        self.updated, self.restored_delta = False, None

    def accumulate(self, rank: int, grad: np.ndarray | PushCode, live: Sequence[int]) -> None:
        """Sync mode: add ``rank``'s push for the current step (``live``: the key's live
        pushers). Pushes are added in rank order, whatever order they arrive in, so a step's
        sum (float addition does not associate) is the same on every run: a push that arrives
        before a lower live rank's is kept aside (copied when it lives in the reused decode
        buffer; a raw push is a view of its received frame, which the view keeps alive, and a
        code, ``ps.pushcode``, keeps its frame) until that one is in."""
        self.pushed.add(rank)
        if any(r < rank and r not in self.pushed for r in live):
            shares = self.decoded is not _EMPTY and isinstance(grad, np.ndarray) \
                and np.may_share_memory(grad, self.decoded)
            self.held[rank] = grad.copy() if shares else grad
            return
        self._add(grad)
        self._add_held(live)

    def _add(self, grad: np.ndarray | PushCode) -> None:
        # the same bits as copying the first push into acc and adding the others in order,
        # with a pass over the key fewer (two, where a code is added without decoding it
        # into the scratch array first)
        if self.folded == 0:
            if isinstance(grad, np.ndarray) and grad.shape == self.decoded.shape \
                    and np.may_share_memory(grad, self.decoded):
                # decoded into the scratch array: it becomes the sum, the old sum the next
                # scratch
                self.acc, self.decoded = self.decoded, self.acc
            else:
                self.first = grad
        else:
            first = self.first
            if self.sums_codes and isinstance(grad, PushCode) and _codes_of(first, grad.codec):
                # codes the rule sums in its kernel: no key-long sum written, then read
                self.first = first.then(grad) if isinstance(first, PushCodes) \
                    else PushCodes((first, grad))
            elif first is not None:
                if self.acc is _EMPTY:
                    self.acc = np.empty_like(self.param)
                self.first = None
                if isinstance(first, np.ndarray) and isinstance(grad, np.ndarray):
                    native.add_into(self.acc, first, grad)
                else:
                    _values(first, self.acc)
                    _add_to(self.acc, grad)
            else:
                _add_to(self.acc, grad)
        self.folded += 1

    def step_total(self) -> np.ndarray | PushCode | PushCodes:
        """Sync mode: the sum of the pushes added so far this step (the first push itself
        while it is the only one, an array or a code, or the step's codes, :attr:`sums_codes`:
        do not write it)."""
        return self.first if self.first is not None else self.acc

    def step_values(self) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        """Sync mode: :meth:`step_total` (``None`` while nothing is added) and :attr:`held`
        as float32 arrays of their own (a checkpoint's copy: codes decoded)."""
        total = _values(self.step_total(), np.empty_like(self.param)) if self.folded else None
        return total, {r: _values(g, np.empty_like(self.param)) for r, g in self.held.items()}

    def _add_held(self, live: Sequence[int] | None) -> None:
        """Add kept pushes in rank order while no lower live rank is missing (``None``: add
        them all, the step is complete)."""
        for rank in sorted(self.held):
            if live is not None and any(r < rank and r not in self.pushed for r in live):
                return
            self._add(self.held.pop(rank))

    def step_sum(self) -> tuple[np.ndarray | PushCode | PushCodes, int]:
        """Sync mode, the step complete: the sum of its pushes (every kept one added, in rank
        order) and how many there are; the caller applies their mean, then calls
        :meth:`end_step`."""
        self._add_held(None)
        return self.step_total(), len(self.pushed)

    def end_step(self) -> None:
        """Sync mode: the step's mean was applied; the next step starts empty."""
        self.pushed.clear()
        self.folded = 0
        self.first = None
        self.step_hyper = None

    def decode_buffer(self) -> np.ndarray:
        """A float32 scratch array of the key's length for decoding a compressed push."""
        if self.decoded is _EMPTY:
            self.decoded = np.empty(self.length, np.float32)
        return self.decoded

    # -- replies ------------------------------------------------------------------------------
    def reply_frame(self) -> tuple[np.ndarray, Buffer | None]:
        """The array to send for this key now, and the buffer to track when it goes zero-copy;
        ``None`` for small keys, which are sent by copy (cheaper than a tracked zero-copy frame
        below :data:`ZERO_COPY_MIN_BYTES`). Only the data loop writes parameters and it sends
        right away, so the array cannot change in between."""
        buf = self.buffer
        return buf.array, (buf if buf.array.nbytes >= ZERO_COPY_MIN_BYTES else None)

    def _spare_buffer(self) -> Buffer:
        for i, buf in enumerate(self.spare):
            if not buf.in_flight():
                return self.spare.pop(i)
        return Buffer(np.empty_like(self.buffer.array))


def _codes_of(push: np.ndarray | PushCode | PushCodes | None, codec: Codec) -> bool:
    """Whether ``push`` is a code, or codes, of ``codec``."""
    return isinstance(push, (PushCode, PushCodes)) and push.codec == codec


def _values(push: np.ndarray | PushCode | PushCodes, out: np.ndarray) -> np.ndarray:
    """``out`` holding ``push``'s float32 values (an array copied, codes decoded)."""
    if isinstance(push, (PushCode, PushCodes)):
        push.decoded(out)
    else:
        np.copyto(out, push)
    return out


def _add_to(acc: np.ndarray, push: np.ndarray | PushCode) -> None:
    """``acc += push``, element by element (a code's values as it decodes them)."""
    if isinstance(push, PushCode):
        push.add_to(acc)
    else:
        native.accumulate(acc, push, False)
