"""1-bit Adam on a shard (async/SSP and sync): the shard owns the momentum, workers push
error-feedback-compressed gradients, and the shard publishes compressed parameter updates.

Per key, after the warmup (``freeze_step`` clocks of full Adam on bf16 pushes), ``async`` and
``ssp`` (the shard owns the momentum)::

    g       = decode(push)                       (sync: the mean of the live workers' pushes)
    m       = lerp(m, g, 1 - beta1)              v frozen at the switch
    delta   = -lr * (m / (sqrt(v)/bc2 + eps) + wd * x)
    payload = sign1(delta + server residual)     residual = what the payload did not carry
    x      += decode(payload)                    version += 1; payload kept in the history

``sync`` reproduces DeepSpeed's compressed allreduce: each worker pushes
``sign1(lerp(m, g_i, 1 - beta1) + worker residual)``; the shard averages the decoded pushes,
publishes ``payload = sign1(mean + server residual)`` and sets ``m = decode(payload)``; the shard
and every worker then apply ``x -= lr * (m / (sqrt(v)/bc2 + eps) + wd * x)`` with the same
kernel and the same frozen v (workers fetch m and v once, with the OptimizerState RPC).

A worker whose copy of the key is at version ``b`` gets, in its pull reply, the payloads of
versions ``b+1 .. now`` (``frame_codecs`` = CODEC_SIGN1) and adds each to its copy exactly as the
shard did, so worker and shard hold bit-identical parameters; a worker further behind than the
history (or behind a warmup update, which has no payload) gets the float32 parameters instead
(CODEC_RAW). Both directions carry about one bit per element. reference/compression.md section 8
derives both. Coordinates whose frozen v is 0 never move (``native.onebit_adam_delta``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from native import sign1
from proto import bitps_pb2 as pb
from proto.codecs import MEAN_ABS, Codec, Compressor

__all__ = ["OneBitState"]


class OneBitState:
    """One key's 1-bit Adam state beyond the Adam moments (which live in ``KeyState``)."""

    def __init__(self, n: int, *, chunk: int, history: int, mean_abs: bool,
                 sync: bool) -> None:
        self.n = n
        self.codec = Codec(pb.CODEC_SIGN1, chunk, MEAN_ABS if mean_abs else 0)
        self.sync = sync
        """Momentum lives on the workers (DeepSpeed's math): pushes are worker momenta, the
        published codes are the averaged momentum, every replica applies it."""
        self.compressing = False
        """False during warmup; True from the first compressed push on (v is frozen then)."""
        self.bias_correction2_sqrt = 1.0
        self.server = Compressor(self.codec, n)  # its residual is the server error feedback
        self.delta = np.empty(n, np.float32)
        self.history: deque[tuple[int, bytes]] = deque(maxlen=history)
        self.payload_bytes = sign1.payload_bytes(n, chunk)

    def freeze(self, bias_correction2_sqrt: float) -> None:
        """Enter the compression stage: v and its bias correction stop changing."""
        self.compressing = True
        self.bias_correction2_sqrt = bias_correction2_sqrt

    def publish(self, version: int, payload: memoryview) -> None:
        """Keep the payload that took the key to ``version``."""
        self.history.append((version, bytes(payload)))

    def forget(self) -> None:
        """A warmup update has no payload: workers behind it need the full parameters."""
        self.history.clear()

    def reply_frame(self, base: int, version: int) -> tuple[int, bytes | None]:
        """What a worker at ``base`` gets for a key at ``version``: ``(CODEC_SIGN1, the
        concatenated payloads of base+1 .. version)`` when the history covers them, else
        ``(CODEC_RAW, None)`` (send the parameters)."""
        if base == version and self.compressing:
            return pb.CODEC_SIGN1, b""
        if not self.history or base >= version or self.history[0][0] > base + 1 \
                or self.history[-1][0] != version:
            return pb.CODEC_RAW, None
        return pb.CODEC_SIGN1, b"".join(p for v, p in self.history if v > base)
