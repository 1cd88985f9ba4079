"""The exactly-once window: the ids of each worker's last applied pushes.

Every data request names its worker, the client's incarnation (random per ``PSClient``) and a
request id. A shard remembers the ``(incarnation, request id)`` of each worker's last
``dedup_window`` applied pushes (``ServerConfig.dedup_window``; 0 turns it off): a push that
repeats one, from any connection, is answered and not applied again. Nothing else is needed to
answer a replay (a push gets an ack, a push_pull the current parameters). The window is part of
every checkpoint.

While the window is on, every push names its incarnation: the shard refuses one that does not
(``ps.checks.request_slots``, ``BAD_HEADER``) before it gets here, since such a push could not be
told from a replay. With the window off (0) nothing is kept and every push is new.
"""

from __future__ import annotations

from collections import deque

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError

__all__ = ["ExactlyOnce"]


class ExactlyOnce:
    """Per worker, the ids of its last ``window`` applied pushes, oldest first; a
    ``proto.state.Stateful``. The caller serializes access (the shard core's lock)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._ids: dict[int, tuple[deque, set]] = {}  # worker -> its ids, in order and as a set
        self._dropped: tuple[int, int] | None = None  # what the last first_time let go

    def is_replay(self, header: pb.DataHeader) -> bool:
        """Whether this push (worker, incarnation, request id) has been applied already
        (never, with the window off: nothing is kept)."""
        seen = self._ids.get(header.worker)
        return seen is not None and (header.incarnation, header.request_id) in seen[1]

    def first_time(self, header: pb.DataHeader) -> bool:
        r"""Whether this push is new, and if so keep its id (the last ``window`` of each
        worker) as applied: the caller applies it next, or :meth:`forget`\ s it when it is
        refused before anything changed. A replay is ``False``, and kept as it was. With the
        window on, ``header`` names its incarnation (``ps.checks`` refused it otherwise)."""
        if self.is_replay(header):
            return False
        if not self.window:
            return True
        order, ids = self._ids.setdefault(header.worker, (deque(), set()))
        order.append(pid := (header.incarnation, header.request_id))
        ids.add(pid)
        if len(order) > self.window:
            self._dropped = order.popleft()
            ids.discard(self._dropped)
        else:
            self._dropped = None
        return True

    def forget(self, header: pb.DataHeader) -> None:
        """Take back the last :meth:`first_time` (``header``'s push, refused after all)."""
        if not self.window:
            return
        order, ids = self._ids[header.worker]
        ids.discard(order.pop())
        if self._dropped is not None:
            order.appendleft(self._dropped)
            ids.add(self._dropped)
            self._dropped = None

    def state_dict(self) -> dict:
        """Layout version 1: ``{"version": 1, "ids": {worker: [(incarnation, request id),
        ...]}}``, each worker's ids oldest first (copies)."""
        return {"version": 1, "ids": {w: list(order) for w, (order, _) in self._ids.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace the window with :meth:`state_dict`'s; a worker's oldest ids beyond
        :attr:`window` are dropped (all of them at 0). ``PSError`` (nothing changed) for
        another layout."""
        if state.get("version") != 1 or not isinstance(state.get("ids"), dict):
            raise PSError(pb.BAD_HEADER, f"exactly-once window of layout version "
                          f"{state.get('version')!r}; expected 1 with ids by worker")
        keep, loaded = self.window, {}
        for worker, ids in state["ids"].items():
            order = deque((int(inc), int(rid)) for inc, rid in ids[max(len(ids) - keep, 0):]) \
                if keep else deque()
            if order:
                loaded[int(worker)] = (order, set(order))
        self._ids = loaded
