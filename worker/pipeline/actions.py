"""What one pipeline rank does, as data: the action lists that schedules emit, the simulator
times and the stage runtime executes.

A schedule (``pipeline.schedules``) is ``list[list[Action]]``: one list per stage ``s`` in
``0 .. p-1``, executed in order by that stage's process. Stage ``s`` receives activations from
``s - 1`` and gradients from ``s + 1``; the peer of every transfer is implied by its op:

=========  =================================================================================
``F``      forward of micro-batch ``mb`` (stage ``s > 0``: its input came by ``RECV_F``)
``B``      backward for the input only (the input's gradient; ``W`` computes the weights')
``BW``     full backward: ``B`` and ``W`` fused (schedules that do not split it)
``W``      the weight gradients of micro-batch ``mb`` (after its ``B``)
``SEND_F`` post the send of ``mb``'s output activation to stage ``s + 1`` (non-blocking)
``RECV_F`` wait for ``mb``'s input activation from stage ``s - 1`` (posted earlier)
``SEND_B`` post the send of ``mb``'s input gradient to stage ``s - 1`` (non-blocking)
``RECV_B`` wait for the gradient of ``mb``'s output from stage ``s + 1``
``PULL``   get this stage's keys from the shards: weight version ``version``
``PUSH``   push this stage's gradients of step ``step`` (final: after its last W or BW)
=========  =================================================================================

Contracts every schedule keeps (``simulate.check`` verifies them):

- Sends never block: a ``SEND_*`` posts and moves on; only ``RECV_*`` waits, for the matching
  send of its peer. So no two blocking sends ever face each other, and a plan deadlocks only if
  some ``RECV`` waits for a send its peer never reaches, which the simulator detects.
- Every ``F(mb)`` on stage ``s > 0`` is preceded by ``RECV_F(mb)``, and on ``s < p - 1`` followed
  (later) by ``SEND_F(mb)``; every ``B``/``BW(mb)`` on ``s < p - 1`` is preceded by
  ``RECV_B(mb)``, and on ``s > 0`` followed by ``SEND_B(mb)``. ``W(mb)`` follows ``B(mb)``.
- ``mb`` counts micro-batches from 0 across the whole plan; micro-batch ``mb`` belongs to step
  ``mb // m``. A flushing schedule is one step (``mb < m``); a flush-free one spans several.
- ``version`` (on ``F``, ``B``, ``BW``, ``W``, ``PULL``) is the weight version the action
  computes with; flushing schedules use one version per step. ``step`` is on every action.

**Chunks (V-shaped plans, ``zb-v``).** A plan may give each rank ``C > 1`` model chunks: the
list index (and ``Action.stage``) is then the *rank* ``r``, and ``Action.chunk`` says which of
its chunks an action is for (0 in every 1-chunk plan, where everything above holds unchanged).
The ``C * p`` virtual stages zig-zag over the ranks (:func:`virtual_stage`): chunk ``c`` of rank
``r`` is virtual stage ``c * p + r`` for even ``c`` and ``c * p + p - 1 - r`` for odd ``c``, so
with ``C = 2`` rank ``r`` holds ``r`` and ``2p - 1 - r`` and rank 0 holds both the first stage
(the inputs) and the last (the loss). The rules above hold per virtual stage: "stage ``s - 1``"
is the previous *virtual* stage, wherever it lives. The peer of every transfer follows from
(rank, chunk, op) (:func:`peer`); a peer on the same rank (rank ``p - 1``'s chunk 0 handing to
its chunk 1, and their gradients back) is a *local* hand-off: the plan still holds the
``SEND``/``RECV`` pair, which the simulator and the runtime treat as immediate (no transfer).
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["COMPUTE", "Action", "Op", "chunks_of", "peer", "rank_chunk", "virtual_stage"]


class Op(enum.Enum):
    F = "F"
    B = "B"
    BW = "BW"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    PULL = "PULL"
    PUSH = "PUSH"


COMPUTE = frozenset({Op.F, Op.B, Op.BW, Op.W})
"""The ops that count as busy time (the bubble is the rest of the wall time)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Action:
    """One step of one stage's list. ``mb`` is None for ``PULL``/``PUSH``."""

    op: Op
    stage: int
    step: int = 0
    mb: int | None = None
    version: int = 0
    chunk: int = 0
    """Which of the rank's model chunks the action is for (V-shaped plans; see the module
    docstring). 0 in every 1-chunk plan."""

    def __str__(self) -> str:
        text = self.op.value + ("" if self.mb is None else str(self.mb))
        return text if not self.chunk else f"{text}.c{self.chunk}"


def chunks_of(plan) -> int:
    """Model chunks per rank of ``plan`` (a list of action lists): 1 + the largest ``chunk``."""
    return 1 + max((a.chunk for acts in plan for a in acts), default=0)


def virtual_stage(rank: int, chunk: int, p: int) -> int:
    """The virtual stage of ``chunk`` on ``rank`` in a V (zig-zag) plan over ``p`` ranks."""
    if not 0 <= rank < p or chunk < 0:
        raise ValueError(f"rank {rank} chunk {chunk}: expected 0 <= rank < p = {p}, chunk >= 0")
    return chunk * p + (rank if chunk % 2 == 0 else p - 1 - rank)


def rank_chunk(v: int, p: int) -> tuple[int, int]:
    """The (rank, chunk) holding virtual stage ``v`` (the inverse of :func:`virtual_stage`)."""
    chunk, i = divmod(v, p)
    return (i if chunk % 2 == 0 else p - 1 - i), chunk


def peer(rank: int, chunk: int, op: Op, p: int, chunks: int) -> tuple[int, int] | None:
    """The (rank, chunk) a ``SEND_*``/``RECV_*`` of (``rank``, ``chunk``) talks to, or None
    where that virtual stage has no such peer (the first has no ``RECV_F``/``SEND_B``, the last
    no ``SEND_F``/``RECV_B``). ``SEND_F``/``RECV_B`` face the next virtual stage,
    ``RECV_F``/``SEND_B`` the previous one."""
    v = virtual_stage(rank, chunk, p)
    if op in (Op.SEND_F, Op.RECV_B):
        return rank_chunk(v + 1, p) if v + 1 < chunks * p else None
    if op in (Op.RECV_F, Op.SEND_B):
        return rank_chunk(v - 1, p) if v > 0 else None
    raise ValueError(f"peer: {op.value} is not a transfer (expected SEND_F, RECV_F, SEND_B or "
                     "RECV_B)")
