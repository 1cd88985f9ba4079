"""``Buffer``: an array that zero-copy sends may still be reading.

ZeroMQ's zero-copy send hands the array to its I/O thread, which reads it after ``send``
returns (or later still, when a peer that is not connected yet connects). Whoever writes the
array next must first know those sends are done: a ``Buffer`` keeps their trackers (pyzmq's
``MessageTracker``, anything with a ``done`` attribute). A shard's key parameters live in one
(``ps.store``: an update writes a spare while a pull reply is in flight), and so does each
encoder's output (``proto.codecs.Compressor``: the next payload goes to a new buffer while a
push is in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["ZERO_COPY_MIN_BYTES", "Buffer"]

ZERO_COPY_MIN_BYTES = 1 << 20
"""Frames below this go by ZeroMQ's copying send: its one copy is cheaper than tracking a frame
that small."""


@dataclass
class Buffer:
    """One array and the ZeroMQ sends still reading it."""

    array: np.ndarray
    trackers: list = field(default_factory=list)

    def in_flight(self) -> bool:
        if self.trackers:
            self.trackers = [t for t in self.trackers if not t.done]
        return bool(self.trackers)

    def track(self, tracker) -> None:
        """Record a send reading this buffer (finished sends are dropped, so a buffer that is
        sent over and over does not collect trackers)."""
        self.in_flight()
        self.trackers.append(tracker)
