"""The key store: each key's parameters, optimizer state, version and published snapshots.

Snapshots exist because replies are sent zero-copy: a frame handed to ZeroMQ must not change
until ZeroMQ is done with it, but the key's parameters change on the next update. So a pull is
answered from an immutable snapshot of the key at its current version; retired snapshots are
reused once every message that carried them has left (``zmq.MessageTracker.done``), so steady
state allocates nothing. Keys under :data:`SNAPSHOT_MIN_BYTES` are copied into the reply instead
(ZeroMQ copies such small frames anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import native
from proto import bitps_pb2 as pb
from ps.rules import KeyState, UpdateRule

__all__ = ["SNAPSHOT_MIN_BYTES", "Slot", "Snapshot"]

SNAPSHOT_MIN_BYTES = 64 << 10
_NO_OUT = np.empty(0, dtype=np.float32)
_MAX_SPARE = 4


@dataclass
class Snapshot:
    """An immutable copy of a key at ``version``; ``trackers`` are the sends still using it."""

    array: np.ndarray
    version: int
    trackers: list = field(default_factory=list)

    def in_flight(self) -> bool:
        return any(not t.done for t in self.trackers)


@dataclass
class Slot:
    """One key on a shard."""

    spec: pb.KeySpec
    param: np.ndarray
    state: KeyState
    version: int = 0
    acc: np.ndarray = field(default_factory=lambda: _NO_OUT)
    """Sync mode: sum of the pushes of the current step."""
    pushed: set[int] = field(default_factory=set)
    """Sync mode: ranks whose push is in ``acc``."""
    snapshot: Snapshot | None = None
    spare: list[Snapshot] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.param.shape[0]

    @property
    def nbytes(self) -> int:
        return self.param.nbytes

    def uses_snapshots(self) -> bool:
        return self.param.nbytes >= SNAPSHOT_MIN_BYTES

    # -- updates ------------------------------------------------------------------------------
    def apply(self, rule: UpdateRule, grad: np.ndarray, *, grad_scale: float = 1.0,
              lr_scale: float = 1.0, publish: bool = False) -> None:
        """One optimizer step; ``publish`` writes the new snapshot in the same pass."""
        out = self._fresh_buffer() if publish and self.uses_snapshots() else _NO_OUT
        rule.apply(self.param, grad, self.state, grad_scale=grad_scale, lr_scale=lr_scale,
                   out=out)
        self.version += 1
        if out is not _NO_OUT:
            self._install(out)

    def accumulate(self, rank: int, grad: np.ndarray) -> None:
        """Sync mode: add ``rank``'s push for the current step."""
        if self.acc is _NO_OUT:
            self.acc = np.empty_like(self.param)
        native.accumulate(self.acc, grad, not self.pushed)
        self.pushed.add(rank)

    def apply_aggregate(self, rule: UpdateRule, *, publish: bool) -> None:
        """Sync mode: apply the mean of the accumulated pushes."""
        n = len(self.pushed)
        self.apply(rule, self.acc, grad_scale=1.0 / n, publish=publish)
        self.pushed.clear()

    # -- snapshots ----------------------------------------------------------------------------
    def reply_frame(self) -> tuple[object, Snapshot | None]:
        """The payload to send for this key now, and the snapshot it comes from (add the send's
        tracker to ``snapshot.trackers``). Small keys come as a ``bytes`` copy and no snapshot."""
        if not self.uses_snapshots():
            return self.param.tobytes(), None
        snap = self.snapshot
        if snap is None or snap.version != self.version:
            out = self._fresh_buffer()
            native.copy_into(out, self.param)
            snap = self._install(out)
        return snap.array, snap

    def _fresh_buffer(self) -> np.ndarray:
        for i, snap in enumerate(self.spare):
            if not snap.in_flight():
                return self.spare.pop(i).array
        return np.empty_like(self.param)

    def _install(self, array: np.ndarray) -> Snapshot:
        old = self.snapshot
        if old is not None:
            old.trackers = [t for t in old.trackers if not t.done]
            self.spare.append(old)
            if len(self.spare) > _MAX_SPARE:
                # ZeroMQ keeps its own reference to buffers still being sent; dropping ours is safe.
                self.spare.pop(0)
        self.snapshot = Snapshot(array=array, version=self.version)
        return self.snapshot
