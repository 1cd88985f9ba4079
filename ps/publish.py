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
(``ps.replies``). Both are ``proto.state.Stateful``: a publisher's state is its residual and
history, :class:`PublishedCodes` is every key's (what a checkpoint saves). This module imports
nothing else of the shard.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec, Compressor
from bitps.proto.wire import PSError

__all__ = ["PublishedCodes", "Publisher"]


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

    def recode(self, codec: Codec) -> None:
        """Publish in ``codec`` from the next update on (1-bit Adam's first compressed update
        after bf16 warmup codes, a restore). The history, in the old codec, is dropped:
        workers behind it pull the parameters. The residual carries over (the same units:
        parameter changes). Nothing changes when ``codec`` is the current one."""
        if codec is self.codec or codec == self.codec:
            return  # every compressed update asks (OneBitAdam.update): the identity first
        residual = self.server.residual
        self.codec, self.server = codec, Compressor(codec, residual.size)
        self.server.residual[:] = residual
        self.forget()

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

    def state_dict(self) -> dict:
        """The codec state, layout version 1: ``{"version": 1, "codec": [id, chunk, flags] (of
        the history's payloads), "residual": float32[n] (the shard's error feedback),
        "history": [[version, payload bytes], ...] (oldest first)}`` (copies). A state without
        ``codec`` (written before it was saved) is in the publisher's configured codec."""
        return {"version": 1, "codec": list(self.codec.wire_fields()),
                "residual": self.server.residual.copy(),
                "history": [[v, p] for v, p in self.history]}

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse (:class:`PSError`) a state dict :meth:`load_state_dict` cannot take."""
        n = self._raw_bytes // 4
        if state.get("version") != 1 or set(state) - {"codec"} != {"version", "residual",
                                                                  "history"}:
            raise PSError(pb.BAD_HEADER, f"published-codes state of version "
                          f"{state.get('version')!r} with {sorted(state)}; expected version 1 "
                          f"with history, residual and perhaps codec")
        if "codec" in state:
            self._codec_of(state)
        if np.shape(state["residual"]) != (n,):
            raise PSError(pb.BAD_LENGTH, f"residual of shape {np.shape(state['residual'])}; "
                          f"expected ({n},)")
        versions = [v for v, _ in state["history"]]
        if versions != sorted(set(versions)) or not all(
                isinstance(p, (bytes, bytearray, memoryview)) for _, p in state["history"]):
            raise PSError(pb.BAD_HEADER, f"history of versions {versions}; expected ascending "
                          f"versions, each with its payload bytes")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (nothing changed when it is refused)."""
        self.check_state(state)
        if "codec" in state:
            self.recode(self._codec_of(state))
        np.copyto(self.server.residual, state["residual"], casting="same_kind")
        self.forget()
        # republishing the kept payloads in order rebuilds the same history: they fit its
        # limits when saved, and so does every prefix
        for version, payload in state["history"]:
            self.publish(int(version), memoryview(bytes(payload)))

    @staticmethod
    def _codec_of(state: Mapping[str, Any]) -> Codec:
        try:
            return Codec.from_header(pb.DataHeader(codec=int(state["codec"][0]),
                                                   codec_chunk=int(state["codec"][1]),
                                                   codec_flags=int(state["codec"][2])))
        except (TypeError, ValueError, IndexError):
            raise PSError(pb.BAD_HEADER, f"published codes' codec {state['codec']!r}; expected "
                          f"[id, chunk, flags]") from None


class PublishedCodes:
    """Every key's published codes on a shard, as one ``proto.state.Stateful``: ``slots()``
    gives the shard's keys (objects with a ``publisher``, ``None`` for keys that publish
    nothing), ``lock`` the lock their updates hold. Layout version 1: ``{"version": 1, "keys":
    {key: Publisher.state_dict()}}`` for the keys that publish."""

    def __init__(self, slots: Callable[[], Mapping[int, Any]], lock: threading.RLock) -> None:
        self._slots, self._lock = slots, lock

    def state_dict(self) -> dict:
        with self._lock:
            return {"version": 1, "keys": {k: s.publisher.state_dict()
                                           for k, s in self._slots().items()
                                           if s.publisher is not None}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: every key of it must publish here; checked whole
        (:class:`PSError`, nothing changed) before any key is loaded."""
        with self._lock:
            slots = self._slots()
            if state.get("version") != 1:
                raise PSError(pb.BAD_HEADER, f"published codes of layout version "
                              f"{state.get('version')!r}; expected 1")
            for key, one in state["keys"].items():
                slot = slots.get(key)
                if slot is None or slot.publisher is None:
                    raise PSError(pb.UNKNOWN_KEY, f"key {key} publishes no codes here")
                try:
                    slot.publisher.check_state(one)
                except PSError as err:
                    raise PSError(err.code, f"key {key}: {err.message}") from None
            for key, one in state["keys"].items():
                slots[key].publisher.load_state_dict(one)
