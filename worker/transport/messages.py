"""What one data request becomes on the wire: :class:`Encoded` pushes and the cut into messages.

A message goes to one shard and carries keys of one codec (its header names the codec for all
of them); keys going to one shard are batched up to ``ClientConfig.message_bytes`` on the wire
(the larger of what the request carries and what its reply will, per key), so small keys and
compressed ones share a message and a large one travels alone (the shard updates one key while
the next arrives).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import RAW, Codec
from bitps.proto.keyplan import KeyPlan
from bitps.proto.wire import PSError

__all__ = ["COPY", "Encoded", "PayloadOwner", "check_array", "messages"]

_F32 = np.dtype("<f4")


class PayloadOwner(Protocol):
    """What wrote a payload into a buffer it reuses and can leave that buffer alone while a
    send reads it (``proto.codecs.Compressor``)."""

    def hold(self, payload: memoryview | np.ndarray, released: Any) -> None:
        """``payload`` is sent without a copy: write nothing into its buffer until
        ``released.done`` (pyzmq's ``MessageTracker``)."""


COPY = object()
"""``Encoded.owners`` entry: a payload in a buffer its encoder reuses and cannot hold, so it is
sent by copy."""


@dataclass(frozen=True)
class Encoded:
    """One push's payloads as they go on the wire, one per key of the request, in its order.

    ``codecs[i]`` is the codec ``payloads[i]`` is in (``RAW``: float32 values, ``4 * length``
    bytes; otherwise the codec's own layout, ``proto.codecs``). Keys of one codec travel in
    messages of their own, each header naming it. ``owners[i]`` says how ``payloads[i]`` is
    sent: ``None``, zero-copy as it is (the caller's array); :data:`COPY`, by copy; a
    :class:`PayloadOwner`, zero-copy, its owner holding the buffer until ZeroMQ lets go."""

    payloads: Sequence[np.ndarray | memoryview]
    codecs: Sequence[Codec]
    owners: Sequence[PayloadOwner | object | None]


def check_array(plan: KeyPlan, key: int, array: np.ndarray | None, kind: str) -> None:
    """Refuse a key the plan lacks (``UNKNOWN_KEY``) or an ``array`` of ``kind`` ("gradient",
    "output") that is not float32 of the key's length (``ValueError``); ``None``: the key
    alone."""
    if key not in plan:
        raise PSError(pb.UNKNOWN_KEY, f"key {key} is not in the plan ({len(plan.keys)} "
                      f"of the model's {plan.model_keys} keys)")
    n = plan.key(key).length
    if array is not None and (array.dtype != _F32 or array.size != n):
        raise ValueError(f"key {key}: {kind} is {array.dtype}[{array.size}]; expected "
                         f"float32[{n}]")


def messages(plan: KeyPlan, keys: Sequence[int], grads: Sequence[np.ndarray],
             outs: Sequence[np.ndarray], codecs: Sequence[Codec] | None, *,
             limit: int, reply_bytes: Mapping[int, int] | None = None
             ) -> list[tuple[int, Codec, list[int]]]:
    """Split a request of ``keys`` into messages: per shard and codec, then at most ``limit``
    bytes each (a larger key travels alone). A key counts the larger of its payload (its
    codec's size: float32 bytes when raw) and its reply's: ``reply_bytes[key]``, the size of
    the coded reply it last had (``Channel.reply_bytes``), else its float32 bytes; a push
    has no reply payload, a pull no request payload. Returns ``(shard, codec, indices into
    keys)`` per message. ``grads`` (plain pushes) and ``outs`` are checked against the plan
    here; an :class:`Encoded` push was checked by its encoder."""
    by_shard: dict[tuple[int, Codec], list[int]] = {}
    for i, k in enumerate(keys):
        check_array(plan, k, grads[i] if grads else None, "gradient")
        if outs:
            check_array(plan, k, outs[i], "output")
        spec = plan.key(k)
        if outs and not (outs[i].flags.c_contiguous and outs[i].flags.writeable):
            raise ValueError(f"key {k}: output must be a writable contiguous array")
        # One codec per message: the header names it for every key.
        by_shard.setdefault((spec.shard, codecs[i] if codecs else RAW), []).append(i)
    replies = reply_bytes or {}
    groups = []
    for (shard, codec), idx in by_shard.items():
        batch, size = [], 0
        for i in idx:
            spec = plan.key(keys[i])
            n = max(codec.max_bytes(spec.length) if grads or codecs else 0,
                    replies.get(spec.key, spec.nbytes) if outs else 0)
            if batch and size + n > limit:
                groups.append((shard, codec, batch))
                batch, size = [], 0
            batch.append(i)
            size += n
        groups.append((shard, codec, batch))
    return groups
