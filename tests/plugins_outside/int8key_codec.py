"""A codec plug-in: ``int8key``, int8 values with one float32 scale per key.

Payload of a key of n elements: the scale ``s = max |u| / 127`` (float32, little-endian), then
n int8 values ``q = rint(u / s)``; decoding is ``q * s``. ``u`` is the gradient plus the error
feedback residual, which keeps ``u - q * s`` (``proto.codecs.Compressor`` does the feedback
around any codec). Load it on the workers (they encode) and on the shards (they decode)::

    bitps-server --plugin int8key_codec.py ...
    bitps-worker --plugin int8key_codec.py --push-codec int8key --compress-min-bytes 0 ...
"""

from __future__ import annotations

import numpy as np

from bitps.proto.codecs import CodecKind, register

WIRE_ID = 120
"""Its ``DataHeader.codec``: not one bitps defines (they are below 100)."""


@register
class Int8KeyKind(CodecKind):
    """int8 with one scale per key, 4 + n bytes."""

    name, id = "int8key", WIRE_ID

    def max_bytes(self, codec, n):
        return 4 + n

    def decode_add(self, codec, payload, n, acc):
        buf = np.frombuffer(payload, np.uint8, count=4 + n)
        scale = buf[:4].view("<f4")[0]
        acc[:n] += buf[4:].view(np.int8).astype(np.float32) * scale

    def encode(self, codec, grad, residual, out, scratch, seed, scale):
        u = grad * np.float32(scale) + residual
        peak = np.float32(np.abs(u).max()) if u.size else np.float32(0)
        s = np.float32(peak / np.float32(127))
        q = np.zeros(u.shape, np.int8) if s == 0 else np.clip(
            np.rint(u / s), -127, 127).astype(np.int8)
        out[:4].view("<f4")[0] = s
        out[4:4 + u.size].view(np.int8)[:] = q
        np.subtract(u, q.astype(np.float32) * s, out=residual)
        return 4 + u.size
