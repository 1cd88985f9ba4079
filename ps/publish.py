"""Compressed pulls: a shard publishes each key's updates as codes, and workers apply them.

Per key, every update the shard makes (any rule, through ``ps.rules.publish_update``; a rule
may publish codes of its own) becomes::

    delta   = rule(x) - x                        what the optimizer would add
    payload = encode(delta + server residual)    residual = what the payload did not carry
    x      += decode(payload)                    version += 1; payload kept in the history

so the shard's parameters are the sum of the codes it sent, and a worker whose copy is at
version ``b`` gets, in its pull reply, the payloads of versions ``b+1 .. now`` concatenated
(``frame_codecs`` names the codec), adds each to its copy exactly as the shard did, and holds
the shard's parameters bit for bit. Error feedback on the shard keeps the optimizer's updates
whole over time, as the workers' keeps their gradients.

A worker gets the float32 parameters instead (``CODEC_RAW``) when it holds no copy yet (its
request has no versions), when it is behind the history (a warmup update without a payload,
more than ``delta_history`` versions, or codes that together outweigh the parameters: the
history keeps at most the key's float32 size in codes), or ahead of it.

The key store holds one :class:`Publisher` per key whose pulls are compressed
(``Slot.publisher``); the rules update through it and the shard's replies read it
(``ps.replies``). This module imports nothing else of the shard.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, Compressor

__all__ = ["Publisher"]


class Publisher:
    """One key's published codes: the shard's error feedback and the history of payloads."""

    def __init__(self, codec: Codec, n: int, *, history: int) -> None:
        self.codec = codec
        self.server = Compressor(codec, n)
        """Its residual is the shard's error feedback (state a checkpoint saves)."""
        self.delta = np.empty(n, np.float32)
        """Scratch for the update being published."""
        self.history: deque[tuple[int, bytes]] = deque()
        self._limit = history
        self._nbytes = 0
        self._raw_bytes = 4 * n

    def publish(self, version: int, payload: memoryview) -> None:
        """Keep the payload that took the key to ``version``; drop the oldest beyond
        ``delta_history`` codes or the key's float32 size."""
        self.history.append((version, bytes(payload)))
        self._nbytes += payload.nbytes
        while len(self.history) > self._limit or (self._nbytes > self._raw_bytes
                                                  and len(self.history) > 1):
            self._nbytes -= len(self.history.popleft()[1])

    def forget(self) -> None:
        """An update without a payload (a rule's warmup step, say): workers behind it need
        the parameters."""
        self.history.clear()
        self._nbytes = 0

    def reply_frame(self, base: int, version: int) -> tuple[int, bytes | None]:
        """What a worker at ``base`` gets for a key at ``version``: ``(codec id, the payloads of
        base+1 .. version concatenated)`` when the history covers them, else ``(CODEC_RAW,
        None)``: send the parameters."""
        if base == version:
            return self.codec.id, b""
        if not self.history or base > version or self.history[0][0] > base + 1 \
                or self.history[-1][0] != version:
            return pb.CODEC_RAW, None
        return self.codec.id, b"".join(p for v, p in self.history if v > base)
