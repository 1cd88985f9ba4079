"""``Channels``: one worker's data connections, a :class:`~bitps.worker.transport.channel.Channel`
per submitting thread over the shards' data endpoints.

ZeroMQ sockets are not thread-safe, so each thread that sends gets a channel of its own, made on
first use (:meth:`Channels.mine`); the set keeps them all so that a shard's connection can be
replaced in every channel (:meth:`Channels.reset`, after the shard was lost) and so that the
code applier (how published codes are added to the worker's copy) reaches every channel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import zmq

from bitps.worker.metrics import WorkerMetrics
from bitps.worker.transport.channel import DECODE_ADD, Channel, CodeApplier, CurveClient

__all__ = ["Channels"]


class Channels:
    """The data channels of one client: ``endpoints[s]`` is shard ``s``'s ROUTER address."""

    def __init__(self, *, servers: Sequence[str], metrics: WorkerMetrics,
                 versions: dict[int, int], curve: CurveClient | None,
                 heard: Callable[[int, int], None] | None = None) -> None:
        self.context = zmq.Context()
        self.endpoints: list[str] = []
        """Each shard's data endpoint (``tcp://host:port``), set at registration."""
        self._servers, self._metrics, self._versions, self._curve = (servers, metrics, versions,
                                                                     curve)
        self._heard = heard  # every channel's replies name the shard's life (Channel.heard)
        self._local = threading.local()
        self._all: list[Channel] = []
        self._lock = threading.Lock()
        self._codes: CodeApplier = DECODE_ADD

    @property
    def codes(self) -> CodeApplier:
        """How every channel adds a published code to the worker's copy."""
        return self._codes

    @codes.setter
    def codes(self, applier: CodeApplier) -> None:
        with self._lock:
            self._codes = applier
            for channel in self._all:
                channel.codes = applier

    def mine(self) -> Channel:
        """The calling thread's channel (made on first use)."""
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = Channel(self.context, self.endpoints, servers=self._servers,
                              metrics=self._metrics, versions=self._versions,
                              codes=self._codes, curve=self._curve, heard=self._heard)
            self._local.channel = channel
            with self._lock:
                self._all.append(channel)
        return channel

    def existing(self) -> Channel | None:
        """The calling thread's channel, or ``None`` when it has sent nothing yet."""
        return getattr(self._local, "channel", None)

    def reset(self, shard: int, endpoint: str | None = None) -> None:
        """A fresh connection to ``shard`` (at ``endpoint``, if it moved) in every channel:
        what the old one still queues is dropped (``Channel.reset``)."""
        if endpoint is not None:
            self.endpoints[shard] = endpoint
        with self._lock:
            channels = list(self._all)
        for channel in channels:
            channel.reset(shard, self.endpoints[shard], self.context)

    def close(self) -> None:
        """Close every channel and the ZeroMQ context."""
        with self._lock:
            for channel in self._all:
                channel.close()
            self._all.clear()
        self.context.term()
