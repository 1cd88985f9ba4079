"""A push as the training loop hands it to the encoder (``worker.training.encoder``):
:class:`Payload`, the step's :class:`ClipCorrection` list, and :func:`refused_nonfinite`, the one
way a push refused for NaN or Inf is counted and reported (the encoder's host check and the
device codec's, ``worker.training.staging``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError

__all__ = ["ClipCorrection", "Payload", "refused_nonfinite"]


@dataclass(frozen=True)
class ClipCorrection:
    """``grads`` of ``keys`` went out for ``clock`` with clip factor ``used``
    (``worker.training.clip``): what :meth:`Encoder.clip_correct` is told once the step's exact
    factor is known."""

    clock: int
    keys: Sequence[int]
    grads: Sequence[np.ndarray]
    used: float


@dataclass(frozen=True)
class Payload:
    """One push's arguments, as ``worker.training.staging`` prepares them for the encoder."""

    keys: Sequence[int]
    grads: Sequence[np.ndarray]
    """Host float32 gradients, one per key (a device-encoded key's is not read)."""
    outs: Sequence[np.ndarray]
    """Where the key's parameters are pulled to."""
    encoded: Mapping[int, np.ndarray] | None = None
    """Keys already compressed where the gradients are (the device codec)."""
    scale: float | None = None
    """The clip factor of these gradients, or ``None``: no clipping."""
    corrections: Sequence[ClipCorrection] = ()
    """The step's last payload: its earlier ones' clip corrections, to make once this one is
    sent (``exact`` is their step's exact factor)."""
    exact: float = 1.0


def refused_nonfinite(metrics, key: int) -> PSError:
    """Count a push refused on this worker because ``key``'s gradient holds NaN or Inf, and
    return the error to raise (``WorkerMetrics.nonfinite``)."""
    with metrics.lock:
        metrics.nonfinite.inc()
    return PSError(pb.NON_FINITE, f"key {key}: gradient holds NaN or Inf; nothing sent, "
                   f"error feedback and moments unchanged")
