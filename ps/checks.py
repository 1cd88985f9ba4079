"""Validation of data-plane requests: everything is checked before anything changes.

:func:`request_slots` checks the header (token, protocol, op, registration, a push's
incarnation, keys);
:func:`decode_push` checks a push's frames against its codec and the keys, decodes compressed
ones (or leaves them codes for a rule that reads them in its kernel, ``ps.pushcode``) and
refuses non-finite gradients. Both raise :class:`PSError` naming the offending value
and what was expected; the shard turns that into one ``ERROR`` reply.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable

import numpy as np

from bitps.native.keypool import KeyPool
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps.config import RULES, ServerConfig
from bitps.ps.pushcode import PushCode
from bitps.ps.store import Slot

__all__ = ["MAX_CLOCK", "OPS", "check_clock", "check_hyperparameters", "decode_push",
           "request_slots", "token_ok", "validate"]

OPS = {pb.PUSH: "push", pb.PULL: "pull", pb.PUSH_PULL: "push_pull"}
MAX_CLOCK = (1 << 63) - 1
"""Largest clock a request may name: its ``+ 1`` (a push_pull's pull) still fits a reply's
uint64 field."""


def token_ok(expected: str, received: str) -> bool:
    """Whether ``received`` is the shard's token (always, when the shard has none); compared in
    constant time, so the answer's timing tells nothing of how much of a guess was right."""
    return not expected or hmac.compare_digest(expected.encode(), received.encode())


def validate(cfg: ServerConfig, header: pb.DataHeader, payload: list, slots: dict[int, Slot],
             *, registered: bool, own_clock: int, pool: KeyPool | None = None,
             keeps_code: Callable[[Codec], bool] | None = None
             ) -> tuple[list[Slot], int, list[np.ndarray | PushCode] | None, Codec | None]:
    """Everything a request is checked for here, in one call: ``(slots, clock, grads,
    codec)``, the slots it names (:func:`request_slots`), the clock it is for
    (:func:`check_clock`, against ``own_clock``, the worker's clock as the shard has it) and
    for a push its decoded gradients (or codes, ``keeps_code``) and codec
    (:func:`decode_push`; ``None`` for a pull)."""
    named = request_slots(cfg, header, payload, slots, registered=registered)
    clock = check_clock(cfg, header, own_clock)
    if header.op == pb.PULL:
        return named, clock, None, None
    grads, codec = decode_push(cfg, header, payload, named, pool=pool, keeps_code=keeps_code)
    return named, clock, grads, codec


def request_slots(cfg: ServerConfig, header: pb.DataHeader, payload: list,
                  slots: dict[int, Slot], *, registered: bool, initialized: bool = True
                  ) -> list[Slot]:
    """The slots a request names, once its header is acceptable: each of them initialized
    (``NOT_INITIALIZED``, retryable, naming the keys), and for a push each in the worker's
    registered plan (``Slot.pushers``). A push (or push_pull) must name the client's life
    (``DataHeader.incarnation``, nonzero) while the exactly-once window is on
    (``dedup_window > 0``); a pull need not. ``initialized`` ``False``: the shard as a whole
    is not."""
    if not token_ok(cfg.token, header.token):
        raise PSError(pb.UNAUTHENTICATED, f"worker {header.worker}: token missing or wrong")
    if header.protocol != PROTOCOL:
        raise PSError(pb.PROTOCOL, f"header protocol {header.protocol}; expected {PROTOCOL}")
    if header.op == pb.OP_UNSPECIFIED:
        raise PSError(pb.BAD_HEADER, "header has no op; expected PUSH, PULL or PUSH_PULL")
    if header.op not in OPS:
        raise PSError(pb.UNKNOWN_OP, f"op {header.op} ({_op_name(header.op)}); expected PUSH, "
                      f"PULL or PUSH_PULL")
    if not registered:
        raise PSError(pb.NOT_REGISTERED, f"worker {header.worker} has not registered with "
                      f"shard {cfg.shard_id}")
    if not math.isfinite(header.deadline_s) or header.deadline_s < 0:
        raise PSError(pb.BAD_HEADER, f"deadline_s {header.deadline_s}; expected a finite "
                      f"number of seconds >= 0 (0 = the shard's pull_deadline_s)")
    if header.op != pb.PULL and not header.incarnation and cfg.dedup_window:
        raise PSError(pb.BAD_HEADER, f"{OPS[header.op]} from worker {header.worker} (request "
                      f"{header.request_id}) carries no incarnation; expected the client's "
                      f"nonzero life id (DataHeader.incarnation): without it the shard cannot "
                      f"apply a replayed push only once (dedup_window {cfg.dedup_window})")
    keys = header.keys
    if not keys:
        raise PSError(pb.BAD_HEADER, "request names no keys")
    if len(keys) > cfg.max_message_keys:
        raise PSError(pb.LIMIT, f"request names {len(keys)} keys; this shard takes at most "
                      f"max_message_keys {cfg.max_message_keys} per message")
    try:
        named = [slots[k] for k in keys]
    except KeyError as err:
        raise PSError(pb.UNKNOWN_KEY, f"key {err.args[0]} is not on shard {cfg.shard_id} "
                      f"(it holds {len(slots)} keys)") from None
    if not initialized or not all(s.initialized for s in named):
        waiting = [s.spec.key for s in named if not s.initialized][:8]
        raise PSError(pb.NOT_INITIALIZED, f"the initial values of keys {waiting} have not "
                      f"landed yet (the worker that initializes them has not registered)")
    if len(named) > 1 and len(set(keys)) != len(named):
        raise PSError(pb.BAD_HEADER, "a key appears twice in one request")
    if header.op != pb.PULL and not all(header.worker in s.pushers for s in named):
        foreign = [s.spec.key for s in named if header.worker not in s.pushers][:8]
        raise PSError(pb.UNKNOWN_KEY, f"worker {header.worker} pushes keys {foreign}, which "
                      f"its plan registered with shard {cfg.shard_id} does not have")
    if header.op == pb.PULL and payload:
        raise PSError(pb.FRAME_COUNT, f"PULL carries {len(payload)} payload frames; expected 0")
    return named


def check_clock(cfg: ServerConfig, header: pb.DataHeader, own: int) -> int:
    """The clock a request is for (a push_pull's pull: ``clock + 1``), once it is possible: at
    most ``max_clock_lead`` ahead of ``own``, the worker's clock as the shard has it, and
    within :data:`MAX_CLOCK`. Else ``BAD_CLOCK``, before anything changes."""
    clock = header.clock + 1 if header.op == pb.PUSH_PULL else header.clock
    if header.clock > MAX_CLOCK or clock > own + cfg.max_clock_lead:
        raise PSError(pb.BAD_CLOCK, f"worker {header.worker} {OPS[header.op]} at clock "
                      f"{header.clock}; the shard has this worker at clock {own} and takes "
                      f"clocks up to {min(own + cfg.max_clock_lead, MAX_CLOCK)} "
                      f"(max_clock_lead {cfg.max_clock_lead})")
    return clock


def decode_push(cfg: ServerConfig, header: pb.DataHeader, payload: list,
                slots: list[Slot], *, pool: KeyPool | None = None,
                keeps_code: Callable[[Codec], bool] | None = None
                ) -> tuple[list[np.ndarray | PushCode], Codec]:
    """Check every frame of a push, decode compressed ones (into each slot's scratch array;
    on ``pool``'s threads when given); returns the float32 gradients and the codec. Where
    ``keeps_code(codec)`` and the codec reads finiteness from its payload
    (``CodecKind.payload_finite``), the frames stay codes (:class:`~ps.pushcode.PushCode`),
    checked alike, for a rule that decodes them in its own kernel."""
    if len(payload) != len(slots):
        raise PSError(pb.FRAME_COUNT, f"{len(payload)} payload frames for {len(slots)} keys")
    if header.dtype != pb.FLOAT32:
        raise PSError(pb.BAD_DTYPE, f"payload dtype {_dtype_name(header.dtype)}; expected "
                      f"FLOAT32 (compressed payloads name their codec instead)")
    codec = Codec.from_header(header)
    if header.versions and len(header.versions) != len(slots):
        raise PSError(pb.BAD_HEADER, f"{len(header.versions)} versions for {len(slots)} keys")
    if header.lr or header.weight_decay:
        check_hyperparameters(cfg, header, len(slots))
    for slot, frame in zip(slots, payload):
        n = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if n > cfg.max_frame_bytes:
            raise PSError(pb.TOO_LARGE, f"key {slot.spec.key}: frame of {n} bytes exceeds "
                          f"{cfg.max_frame_bytes}")
        if codec.is_raw and n != slot.nbytes:
            raise PSError(pb.BAD_LENGTH, f"key {slot.spec.key}: payload is {n} bytes; "
                          f"expected {slot.nbytes} ({slot.length} float32)")
        problem = None if codec.is_raw else codec.check(frame, slot.length)
        if problem:
            raise PSError(pb.BAD_LENGTH, f"key {slot.spec.key}: {problem}")
    grads: list = [None] * len(slots)
    finite = [True] * len(slots)
    coded = codec.kind.payload_finite and keeps_code is not None and keeps_code(codec)

    def one(i: int) -> None:  # one key: its own scratch array (native.keypool)
        slot, frame = slots[i], payload[i]
        if coded:
            grads[i] = PushCode(codec, frame, slot.length)
            decoded = None  # the codec reads finiteness from the payload
        else:
            grads[i] = decoded = codec.decode(frame, slot.length, slot.decode_buffer())
        if cfg.reject_nonfinite:
            finite[i] = codec.all_finite(frame, slot.length, decoded)

    if pool is None:
        for i in range(len(slots)):
            one(i)
    else:
        pool.map(one, range(len(slots)), sum(s.nbytes for s in slots))
    for slot, ok in zip(slots, finite):
        if not ok:
            raise PSError(pb.NON_FINITE, f"key {slot.spec.key}: gradient holds NaN or Inf"
                          + ("" if codec.is_raw else f" (decoded from {codec.name})"))
    return grads, codec


def check_hyperparameters(cfg: ServerConfig, header: pb.DataHeader, n: int) -> None:
    """A push's own learning rate and weight decay (``DataHeader.lr``, ``weight_decay``): one
    of each per key, finite, lr > 0 and weight decay >= 0, for a rule that takes them
    (``UpdateRule.takes_hyperparameters``); else ``BAD_HYPERPARAMETERS``."""
    lrs, wds = header.lr, header.weight_decay
    if len(lrs) != n or len(wds) != n:
        raise PSError(pb.BAD_HYPERPARAMETERS, f"{len(lrs)} lr and {len(wds)} weight_decay "
                      f"values for {n} keys; expected {n} of each (or none)")
    rule = RULES.lookup(cfg.optimizer.name)
    if not rule.takes_hyperparameters:
        raise PSError(pb.BAD_HYPERPARAMETERS, f"the push carries its own lr and weight decay; "
                      f"shard {cfg.shard_id}'s update rule {cfg.optimizer.name} takes none "
                      f"(its learning rate is --lr with the shard's schedule)")
    for key, lr, wd in zip(header.keys, lrs, wds):
        if not (math.isfinite(lr) and lr > 0 and math.isfinite(wd) and wd >= 0):
            raise PSError(pb.BAD_HYPERPARAMETERS, f"key {key}: lr {lr}, weight_decay {wd}; "
                          f"expected a finite lr > 0 and a finite weight_decay >= 0")


def _op_name(op: int) -> str:
    try:
        return pb.Op.Name(op)
    except ValueError:
        return "unknown"


def _dtype_name(dtype: int) -> str:
    try:
        return pb.DType.Name(dtype)
    except ValueError:
        return str(dtype)
