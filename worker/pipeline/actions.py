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
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["COMPUTE", "Action", "Op"]


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

    def __str__(self) -> str:
        return self.op.value + ("" if self.mb is None else str(self.mb))
