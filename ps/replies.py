"""What a shard sends back: the reply messages and the frames of a pull's answer.

A pull is answered with each key's parameters (a tracked zero-copy frame for keys of
``ZERO_COPY_MIN_BYTES`` and more) or, for keys whose pulls are compressed, with the codes the
shard published since the version the request names (``ps.publish``). :class:`Admission`
records who got parameters for which step, for the SSP guarantee's tests and diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from bitps.proto import bitps_pb2 as pb
from bitps.ps.store import Slot

__all__ = ["Admission", "Reply", "reply_frames"]


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


def reply_frames(header: pb.DataHeader, slots: list[Slot]) -> tuple[list, list[int]]:
    """Per key of a pull: ``(frame, buffer to track)`` and its frame codec: the codes since the
    version the request names, or the parameters (also for keys that publish nothing)."""
    bases = header.versions if len(header.versions) == len(slots) else [-1] * len(slots)
    frames, codecs = [], []
    for base, slot in zip(bases, slots):
        codec, data = (pb.CODEC_RAW, None) if slot.publisher is None or base < 0 else \
            slot.publisher.reply_frame(int(base), slot.version)
        frames.append(slot.reply_frame() if data is None else (data, None))
        codecs.append(codec)
    return frames, codecs
