"""Point-to-point transfers between neighbouring stages: activations forward, their gradients
backward, through ``torch.distributed`` (gloo on CPU, NCCL on CUDA) as posted pairs.

    link = StageLink(peers, device=device, timeout_s=30)
    link.begin()                                     # once per run_step
    link.expect(Direction.FROM_PREV, [0, 1, 2, 3])  # post the first receive now
    link.send(Direction.TO_NEXT, mb, output)         # isend: returns at once
    x = link.recv(Direction.FROM_PREV, mb)           # waits, at most timeout_s
    link.finish()                                    # wait for every send still in flight

**Shapes travel in a header, once per run.** The micro-batch size may change between steps
(dynamic micro-batching) and a stage past the first cannot know it in advance, so the first
transfer of each direction in a run (one ``run_step``) is preceded by a fixed header (int64[10]:
dtype code, ndim, the sizes), instead of deriving shapes from a dry run per micro-batch size.
Every later micro-batch of the run has that shape and dtype (the sender checks it: within a
step all micro-batches have one size), so it travels as the tensor alone.

**Posted receives.** Each direction is a chain: at the start of a run the header's receive is
posted (``irecv``); once it has arrived, the tensor receives of the next 8 expected
micro-batches are posted into buffers of the announced shape and dtype, and one more each time
one is taken. The chain posts in the order the sender sends, which NCCL needs (it matches by
order, not by tag); on gloo every message is also tagged with its micro-batch. Sends are
``isend``; their ``Work`` and the tensors they read are kept until :meth:`StageLink.finish` (or
until the queue of sends in flight is long), so no two blocking sends ever face each other.

**Chunks** (V-shaped plans, ``zb-v``): a rank with two model chunks talks to each neighbour
for both. Every chain, header and tag is then per (direction, chunk): ``peers`` is keyed by
``(Direction, chunk)`` (a plain ``Direction`` means chunk 0) and ``expect``/``recv``/``send``
take ``chunk``. Directions stay in the chunk's own terms: ``TO_NEXT`` is the next *virtual*
stage, which for chunk 1 is rank ``r - 1``. The tag of micro-batch ``mb``'s header is
``4 mb + 2 chunk`` and of its tensor ``4 mb + 2 chunk + 1`` (a V sends at most two streams
each way between two ranks: chunk 0's and chunk 1's). A local hand-off never reaches the link.
On NCCL, which ignores tags and matches by posting order, two chunks' streams between one pair
would need a communicator each: not provided yet (the runtime refuses 2 chunks on CUDA).

**Deadlines.** Every wait is bounded by ``timeout_s`` (gloo ``Work.wait(timeout)``; NCCL's
watchdog enforces the process group's ``timeout``, which the launcher sets to the same value).
A transfer that fails or times out raises :class:`StageFailedError` naming the peer stage, its
replica and global rank, and what was awaited. Measured on torch 2.13 gloo: a peer that dies
(``kill -9``) fails the waits on it within milliseconds ("Connection closed by peer"); a peer
that is stopped (``SIGSTOP``) or hangs fails them after the timeout ("Timed out waiting").
"""

from __future__ import annotations

import datetime
import enum
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Direction", "Peer", "StageFailedError", "StageLink", "direction_groups"]

_HEADER_LEN = 10  # dtype code, ndim, up to 8 sizes
_MAX_DIMS = _HEADER_LEN - 2
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.bool)
_SENDS_IN_FLIGHT = 64  # waited oldest first beyond this: bounds the tensors kept alive
_RECVS_AHEAD = 8  # tensor receives posted ahead per direction: bounds the buffers held


class StageFailedError(RuntimeError):
    """A transfer with another stage failed or found no answer before its deadline.

    ``stage``, ``replica`` and ``rank`` name the peer; ``what`` says what was awaited (for
    example ``"RECV_F of micro-batch 3"``); ``reason`` is the transport's message or
    ``"no answer within 30 s"``."""

    def __init__(self, *, stage: int, replica: int, rank: int, what: str, reason: str) -> None:
        self.stage, self.replica, self.rank, self.what, self.reason = (stage, replica, rank,
                                                                       what, reason)
        super().__init__(f"{what} from/to stage {stage} (replica {replica}, rank {rank}) "
                         f"failed: {reason}")


class Direction(enum.Enum):
    """Which neighbour a transfer goes to or comes from, and what it carries."""

    TO_NEXT = "SEND_F"      # activations to stage s + 1
    FROM_PREV = "RECV_F"    # activations from stage s - 1
    TO_PREV = "SEND_B"      # input gradients to stage s - 1
    FROM_NEXT = "RECV_B"    # output gradients from stage s + 1


@dataclass(frozen=True, kw_only=True)
class Peer:
    """A neighbouring stage: its index, replica and global rank (``torch.distributed``'s p2p
    calls take the global rank whatever the group)."""

    stage: int
    replica: int
    rank: int


def _reason(exc: BaseException, timeout_s: float) -> str:
    text = str(exc)
    if "Timed out" in text or "timeout" in text.lower():
        return f"no answer within {timeout_s:g} s ({text.splitlines()[0][:200]})"
    if "closed by peer" in text or "Connection reset" in text:
        return f"peer closed the connection ({text.splitlines()[0][:200]})"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _tag(mb: int, chunk: int, data: bool) -> int:
    """The gloo tag of micro-batch ``mb``'s header (``data`` False) or tensor of ``chunk``."""
    return 4 * mb + 2 * chunk + int(data)


Key = tuple[Direction, int]
"""(direction, chunk): one chain of transfers."""


def _what(direction: Direction, chunk: int, mb: int) -> str:
    return f"{direction.value} of micro-batch {mb}" + (f" (chunk {chunk})" if chunk else "")


class _Inbox:
    """The receive chain from one peer: the micro-batches expected, in order; the header of the
    first one (until the run's shape is known); the tensor receives posted ahead."""

    def __init__(self, link: StageLink, direction: Direction, peer: Peer, chunk: int = 0
                 ) -> None:
        self.link, self.direction, self.peer, self.chunk = link, direction, peer, chunk
        self.expected: deque[int] = deque()
        self.layout: tuple[tuple[int, ...], torch.dtype] | None = None
        self.header: tuple[int, torch.Tensor, dist.Work] | None = None
        self.posted: dict[int, tuple[torch.Tensor, dist.Work]] = {}

    def begin(self) -> None:
        if self.expected or self.posted:
            raise ValueError(f"{self.direction.value}: micro-batches {list(self.expected)} "
                             f"{sorted(self.posted)} of the last run were never received")
        self.layout, self.header = None, None

    def expect(self, mbs: Iterable[int]) -> None:
        self.expected.extend(mbs)
        self.advance()

    def advance(self, *, block: bool = False) -> None:
        """Post what can be posted: the first header of the run, then, once the shape is
        known, the tensor receives of the next ``_RECVS_AHEAD`` micro-batches. ``block``: wait
        (bounded) for the header."""
        if self.layout is None:
            if not self.expected:
                return
            if self.header is None:
                mb = self.expected[0]
                buf = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.link.device)
                self.header = (mb, buf, self.link._irecv(buf, self,
                                                         tag=_tag(mb, self.chunk, False)))
            mb, buf, work = self.header
            if not block and not work.is_completed():
                return
            # waiting on a completed Work is instant, and raises if it failed
            self.link._wait(work, self.peer, _what(self.direction, self.chunk, mb))
            h = buf.tolist()
            self.layout = tuple(h[2:2 + h[1]]), _DTYPES[h[0]]
            self.header = None
            self.link.bytes_received += buf.nbytes
        shape, dtype = self.layout
        while self.expected and len(self.posted) < _RECVS_AHEAD:
            mb = self.expected.popleft()
            data = torch.empty(shape, dtype=dtype, device=self.link.device)
            self.posted[mb] = (data, self.link._irecv(data, self,
                                                      tag=_tag(mb, self.chunk, True)))


class StageLink:
    """The transfers of one stage with its two neighbours (``peers[direction]``; a first or
    last stage has no peer on one side). One per stage process; not thread-safe."""

    def __init__(self, peers: Mapping[Direction | Key, Peer], *, device: torch.device,
                 timeout_s: float, group: dist.ProcessGroup | None = None,
                 groups: Mapping[Direction, dist.ProcessGroup] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.peers: dict[Key, Peer] = {(k, 0) if isinstance(k, Direction) else k: p
                                       for k, p in peers.items()}
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.group = group
        self.groups = dict(groups or {})
        """A group per direction (:func:`direction_groups`), where ``group`` is not enough."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self._inboxes = {(d, c): _Inbox(self, d, p, c) for (d, c), p in self.peers.items()
                         if d in (Direction.FROM_PREV, Direction.FROM_NEXT)}
        self._sends: deque[tuple[dist.Work, Peer, str, tuple[torch.Tensor, ...]]] = deque()
        self._layouts: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}

    def begin(self) -> None:
        """Start a run (one ``run_step``): the first transfer of each direction carries the
        shape header again, so the micro-batch size may change from the last run."""
        for inbox in self._inboxes.values():
            inbox.begin()
        self._layouts.clear()

    # -- receiving ----------------------------------------------------------------------------
    def expect(self, direction: Direction, mbs: Iterable[int], chunk: int = 0) -> None:
        """Micro-batches ``mbs`` will arrive from ``direction`` (for ``chunk``), in this order:
        post the first receive now."""
        self._inbox(direction, chunk).expect(mbs)

    def poll(self) -> None:
        """Post the tensor receives whose headers have arrived (cheap; call between actions)."""
        for inbox in self._inboxes.values():
            inbox.advance()

    def recv(self, direction: Direction, mb: int, chunk: int = 0) -> torch.Tensor:
        """Wait for micro-batch ``mb``'s tensor from ``direction`` (for ``chunk``; announced by
        :meth:`expect`); raises :class:`StageFailedError` past the deadline."""
        inbox = self._inbox(direction, chunk)
        inbox.advance()
        if mb not in inbox.posted:
            nxt = inbox.expected[0] if inbox.expected else None
            if nxt != mb or inbox.layout is not None:
                raise ValueError(f"{_what(direction, chunk, mb)} was not expected next (next "
                                 f"expected: {nxt})")
            inbox.advance(block=True)
        data, work = inbox.posted.pop(mb)
        self._wait(work, inbox.peer, _what(direction, chunk, mb))
        self.bytes_received += data.nbytes
        inbox.advance()
        return data

    # -- sending ------------------------------------------------------------------------------
    def send(self, direction: Direction, mb: int, tensor: torch.Tensor, chunk: int = 0) -> None:
        """Post the send of ``tensor`` as micro-batch ``mb`` of ``chunk`` (header, then data);
        returns at once. ``tensor`` must not be changed until :meth:`finish` (the runtime never
        does)."""
        if direction not in (Direction.TO_NEXT, Direction.TO_PREV):
            raise ValueError(f"send goes TO_NEXT or TO_PREV, got {direction}")
        key = (direction, chunk)
        if key not in self.peers:
            raise ValueError(f"this stage has no peer for {_what(direction, chunk, mb)} (peers: "
                             f"{sorted((d.value, c) for d, c in self.peers)})")
        peer = self.peers[key]
        what = _what(direction, chunk, mb)
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"{what}: a tensor of at most {_MAX_DIMS} dims and dtype in "
                             f"{_DTYPES} was expected, got {tuple(tensor.shape)} {tensor.dtype}")
        data = tensor.detach().contiguous()
        layout = tuple(data.shape), data.dtype
        bufs = [(data, _tag(mb, chunk, True))]
        if key not in self._layouts:  # the run's first transfer this way: the header
            self._layouts[key] = layout
            h = [_DTYPES.index(data.dtype), data.dim(), *data.shape]
            header = torch.tensor(h + [0] * (_HEADER_LEN - len(h)), dtype=torch.int64,
                                  device=self.device)
            bufs.insert(0, (header, _tag(mb, chunk, False)))
        elif layout != self._layouts[key]:
            raise ValueError(f"{what}: every micro-batch of one run has the shape and dtype of "
                             f"the first, {self._layouts[key]}; got {layout}")
        for buf, tag in bufs:
            work = self._call(dist.isend, buf, key, tag, what)
            self._sends.append((work, peer, what, (buf,)))
            self.bytes_sent += buf.nbytes
        while len(self._sends) > _SENDS_IN_FLIGHT:
            self._wait_send()

    def finish(self) -> None:
        """Wait (bounded) for every send still in flight; their buffers are then free."""
        while self._sends:
            self._wait_send()

    # -- internals ----------------------------------------------------------------------------
    def _inbox(self, direction: Direction, chunk: int = 0) -> _Inbox:
        try:
            return self._inboxes[direction, chunk]
        except KeyError:
            names = sorted(d.value if not c else f"{d.value} (chunk {c})"
                           for d, c in self._inboxes)
            raise ValueError(f"this stage has no peer for {direction.value}"
                             f"{f' (chunk {chunk})' if chunk else ''} (peers: {names})"
                             ) from None

    def _wait_send(self) -> None:
        work, peer, what, _ = self._sends.popleft()
        self._wait(work, peer, what)

    def _irecv(self, buf: torch.Tensor, inbox: _Inbox, tag: int) -> dist.Work:
        return self._call(dist.irecv, buf, (inbox.direction, inbox.chunk), tag,
                          f"{inbox.direction.value} (posting the receive)")

    def _call(self, fn, buf: torch.Tensor, key: Key, tag: int, what: str) -> dist.Work:
        peer = self.peers[key]
        # per-direction groups are chunk 0's (NCCL); a second chunk's chains use ``group``
        group = self.groups.get(key[0], self.group) if key[1] == 0 else self.group
        try:
            # NCCL ignores tags (it matches by order, which the chain keeps)
            return fn(buf, peer.rank, group=group, tag=tag)
        except RuntimeError as exc:
            raise StageFailedError(stage=peer.stage, replica=peer.replica, rank=peer.rank,
                                   what=what, reason=_reason(exc, self.timeout_s)) from exc

    def _wait(self, work: dist.Work, peer: Peer, what: str) -> None:
        t0 = time.monotonic()
        try:
            if self.device.type == "cuda":
                work.wait()  # stream-ordered; NCCL's watchdog enforces the group's timeout
            elif not work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
                raise RuntimeError(f"Timed out after {time.monotonic() - t0:.1f} s")
        except RuntimeError as exc:
            raise StageFailedError(stage=peer.stage, replica=peer.replica, rank=peer.rank,
                                   what=what, reason=_reason(exc, self.timeout_s)) from exc


def direction_groups(*, stage: int, num_stages: int, replica: int, world_size: int
                     ) -> dict[Direction, dist.ProcessGroup]:
    """One process group per neighbouring pair and direction, for NCCL: there every p2p op of a
    pair shares one communicator and one stream, which runs them in the order posted, so a
    receive posted early (the gradient of micro-batch 0) would hold back the send posted after
    it (activation 0) that the peer needs first: a deadlock. With a group per direction a stream
    only carries one side's sends and the other's receives, in the same order on both.

    Collective: every rank of the world calls it with its own place, in the launcher's
    numbering (rank ``replica * num_stages + stage``); it creates every pair's groups in one
    order. Returns this stage's (``TO_NEXT``/``FROM_NEXT`` with stage + 1, ``FROM_PREV``/
    ``TO_PREV`` with stage - 1)."""
    if world_size % num_stages:
        raise ValueError(f"world_size {world_size} is not a multiple of num_stages "
                         f"{num_stages} (rank = replica * num_stages + stage)")
    mine: dict[Direction, dist.ProcessGroup] = {}
    for r in range(world_size // num_stages):
        for s in range(num_stages - 1):
            pair = [r * num_stages + s, r * num_stages + s + 1]
            forward, backward = dist.new_group(pair), dist.new_group(pair)
            if r != replica:
                continue
            if s == stage:
                mine[Direction.TO_NEXT], mine[Direction.FROM_NEXT] = forward, backward
            if s + 1 == stage:
                mine[Direction.FROM_PREV], mine[Direction.TO_PREV] = forward, backward
    return mine
