"""The codec registry: how payload frames encode float32 values, named, numbered and carried in
every ``DataHeader`` (``codec``, ``codec_chunk``, ``codec_flags``), so a receiver decodes each
message by what it says, not by what it expects.

=========  ==  =================================================  =========================
name       id  payload of a key of n elements                       layout
=========  ==  =================================================  =========================
raw         0  4n bytes, float32                                    little-endian values
bf16        1  2n bytes                                             ``native/casts.py``
fp16        2  2n bytes                                             ``native/casts.py``
sign1       3  ceil(n/8) + 4 ceil(n/C) bytes                        ``native/sign1.py``
sparse      4  8 + index block + value block (data dependent)       ``native/sparse.py``
=========  ==  =================================================  =========================

:class:`Codec` is one codec with its parameters; :class:`Compressor` is one key's sender state
(the error-feedback residual and a reusable output buffer); error feedback wraps every codec the
same way: ``u = grad + residual``, send ``encode(u)``, keep ``residual = u - decode(...)``.

Example::

    codec = Codec.from_config(CodecConfig(name="sign1"))
    comp = Compressor(codec, n)
    payload = comp.encode(grad)            # memoryview into comp's buffer, valid until next call
    header.codec, header.codec_chunk, header.codec_flags = codec.wire_fields()
    ...
    codec = Codec.from_header(header)      # receiver; raises PSError(BAD_DTYPE) when unknown
    problem = codec.check(frame, n)        # None, or what is wrong with the frame
    codec.decode_add(frame, n, acc)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bitps.native import casts, sign1, sparse
from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError

__all__ = ["CODECS", "RAW", "Codec", "CodecConfig", "Compressor", "MEAN_ABS", "SPARSE_BF16",
           "chunk_problem"]

CODECS = {"raw": pb.CODEC_RAW, "bf16": pb.CODEC_BF16, "fp16": pb.CODEC_FP16,
          "sign1": pb.CODEC_SIGN1, "sparse": pb.CODEC_SPARSE}
_NAMES = {v: k for k, v in CODECS.items()}
MEAN_ABS = 1
"""``codec_flags`` bit 0: sign1 scales are mean |u| (else RMS)."""
SPARSE_BF16 = 2
"""``codec_flags`` bit 1: sparse values are bf16 (else 8-bit sign + exponent)."""
_MAX_CHUNK = 1 << 20
_SCALES = ("rms", "mean_abs")
_VALUES = ("natexp8", "bf16")


def chunk_problem(chunk: int) -> str | None:
    """What is wrong with a scale/exponent chunk size (a multiple of 64 up to 2**20), or
    ``None``: the one rule for configs, headers and the 1-bit Adam setting."""
    if 0 < chunk <= _MAX_CHUNK and chunk % sign1.LANES == 0:
        return None
    return f"chunk {chunk}; expected a multiple of {sign1.LANES} in 64 .. {_MAX_CHUNK}"


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How one direction of traffic is compressed (a setting; see the README's table)."""

    name: str = field(default="raw", metadata={"choices": tuple(CODECS)})
    """``raw``, ``bf16``, ``fp16``, ``sign1`` or ``sparse``."""
    chunk: int = sign1.DEFAULT_CHUNK
    """Elements per scale chunk (sign1) or per exponent chunk (sparse); a multiple of 64."""
    scale: str = field(default="rms", metadata={"choices": _SCALES})
    """sign1 scale rule: ``rms`` (DeepSpeed's; the default) or ``mean_abs``."""
    values: str = field(default="natexp8", metadata={"choices": _VALUES})
    """sparse value encoding: ``natexp8`` (sign + power-of-two exponent, 8 bits) or ``bf16``."""

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"codec {self.name!r}; expected one of {sorted(CODECS)}")
        if problem := chunk_problem(self.chunk):
            raise ValueError(f"codec {problem}")
        if self.scale not in _SCALES:
            raise ValueError(f"sign1 scale {self.scale!r}; expected one of {_SCALES}")
        if self.values not in _VALUES:
            raise ValueError(f"sparse values {self.values!r}; expected one of {_VALUES}")


@dataclass(frozen=True)
class Codec:
    """One codec and its parameters: encode, check and decode payload frames."""

    id: int
    chunk: int = sign1.DEFAULT_CHUNK
    flags: int = 0

    @classmethod
    def from_config(cls, cfg: CodecConfig) -> Codec:
        flags = (MEAN_ABS if cfg.scale == "mean_abs" else 0) | \
            (SPARSE_BF16 if cfg.values == "bf16" else 0)
        return cls(CODECS[cfg.name], cfg.chunk, flags)

    @classmethod
    def from_header(cls, header: pb.DataHeader) -> Codec:
        """The codec a received header names; :class:`PSError` ``BAD_DTYPE`` when this side
        cannot decode it."""
        codec, chunk, flags = header.codec, header.codec_chunk, header.codec_flags
        if not (codec or chunk or flags):
            return RAW  # every uncompressed message: no object per message
        if codec not in _NAMES:
            raise PSError(pb.BAD_DTYPE, f"codec {codec} is unknown; expected one of "
                          f"{sorted(_NAMES)} ({', '.join(CODECS)})")
        if codec in (pb.CODEC_SIGN1, pb.CODEC_SPARSE) and (problem := chunk_problem(chunk)):
            raise PSError(pb.BAD_DTYPE, f"{_NAMES[codec]} {problem}")
        if flags & ~(MEAN_ABS | SPARSE_BF16):
            raise PSError(pb.BAD_DTYPE, f"codec flags {flags:#x}; only bits 0 and 1 are defined")
        return cls(codec, chunk or sign1.DEFAULT_CHUNK, flags)

    @property
    def name(self) -> str:
        return _NAMES[self.id]

    @property
    def is_raw(self) -> bool:
        return self.id == pb.CODEC_RAW

    def wire_fields(self) -> tuple[int, int, int]:
        """``(codec, codec_chunk, codec_flags)`` for a ``DataHeader``."""
        return self.id, self.chunk, self.flags

    def max_bytes(self, n: int) -> int:
        """The largest payload for a key of ``n`` elements (exact for all but sparse)."""
        if self.id == pb.CODEC_RAW:
            return 4 * n
        if self.id in (pb.CODEC_BF16, pb.CODEC_FP16):
            return 2 * n
        if self.id == pb.CODEC_SIGN1:
            return sign1.payload_bytes(n, self.chunk)
        return sparse.max_payload_bytes(n, self.chunk, self._sparse_values)

    @property
    def _sparse_values(self) -> int:
        return sparse.BF16 if self.flags & SPARSE_BF16 else sparse.NATEXP8

    def check(self, payload, n: int) -> str | None:
        """What is wrong with an untrusted frame for a key of ``n`` elements, or ``None``."""
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        if self.id == pb.CODEC_SPARSE:
            return sparse.check(np.frombuffer(payload, np.uint8), n, self.chunk)
        expected = self.max_bytes(n)
        if size != expected:
            return (f"{self.name} payload is {size} bytes; expected {expected} for {n} "
                    f"elements" + (f" (chunk {self.chunk})" if self.id == pb.CODEC_SIGN1 else ""))
        return None

    def split(self, frame, n: int) -> list[np.ndarray] | str:
        """The payloads concatenated in ``frame`` (the codes a shard published for a key of
        ``n`` elements, oldest first), each checked; or what is wrong with the frame."""
        buf = np.frombuffer(frame, np.uint8)
        parts, pos = [], 0
        while pos < buf.shape[0]:
            size = (sparse.size_of(buf[pos:], n, self.chunk) if self.id == pb.CODEC_SPARSE
                    else self.max_bytes(n))
            if size is None or pos + size > buf.shape[0]:
                return (f"{buf.shape[0]} bytes of {self.name} codes: the one at byte {pos} "
                        f"is cut off or unreadable")
            part = buf[pos:pos + size]
            if problem := self.check(part, n):
                return f"code at byte {pos}: {problem}"
            parts.append(part)
            pos += size
        return parts

    def decode_add(self, payload, n: int, acc: np.ndarray) -> None:
        """``acc[:n] += decode(payload)``; the payload passed :meth:`check`."""
        if self.id == pb.CODEC_RAW:
            np.add(acc[:n], np.frombuffer(payload, np.float32, count=n), out=acc[:n])
        elif self.id == pb.CODEC_BF16:
            casts.bf16_decode_add(payload, n, acc)
        elif self.id == pb.CODEC_FP16:
            casts.fp16_decode_add(payload, n, acc)
        elif self.id == pb.CODEC_SIGN1:
            sign1.decode_add(payload, n, acc, chunk=self.chunk)
        else:
            sparse.decode_add(np.frombuffer(payload, np.uint8), n, self.chunk, acc)

    def decode(self, payload, n: int, out: np.ndarray) -> np.ndarray:
        """The float32 values of ``payload`` written to ``out[:n]`` (raw: a view, no copy)."""
        if self.id == pb.CODEC_RAW:
            return np.frombuffer(payload, np.float32, count=n)
        out = out[:n]
        out.fill(0.0)
        self.decode_add(payload, n, out)
        return out


class Compressor:
    """One key's sender side: the codec, its error-feedback residual (the state to save and
    restore) and a reusable output buffer. Not thread-safe; one per key and direction.

    A raw compressor sends ``grad * scale + residual`` as float32 and keeps a zero residual:
    only clipping under overlap (``worker.clip``) adds to it, once the step's exact clip factor
    is known, so that what a raw key missed arrives with its next push."""

    def __init__(self, codec: Codec, n: int) -> None:
        self.codec, self.n = codec, n
        self.residual = np.zeros(n, np.float32)
        self._out = np.empty(codec.max_bytes(n), np.uint8)
        self._scratch = (np.empty(sparse.sample_size(n), np.float32)
                         if codec.id == pb.CODEC_SPARSE else None)

    def encode(self, grad: np.ndarray, *, seed: int = 0, scale: float = 1.0) -> memoryview:
        """The payload for ``grad * scale`` (plus the residual); valid until the next call.
        ``seed`` drives sparse's sampling and stochastic rounding (vary it per step); ``scale``
        is the clip factor."""
        codec, out = self.codec, self._out
        if grad.shape != (self.n,):
            raise ValueError(f"gradient has shape {grad.shape}; this key has ({self.n},)")
        if codec.id == pb.CODEC_RAW:
            size = casts.raw_encode(grad, self.residual, out.view(np.float32), scale=scale)
        elif codec.id == pb.CODEC_BF16:
            size = casts.bf16_encode(grad, self.residual, out.view(np.uint16), scale=scale)
        elif codec.id == pb.CODEC_FP16:
            size = casts.fp16_encode(grad, self.residual, out.view(np.uint16), scale=scale)
        elif codec.id == pb.CODEC_SIGN1:
            size = sign1.encode(grad, self.residual, out, chunk=codec.chunk,
                                mean_abs=bool(codec.flags & MEAN_ABS), scale=scale)
        else:
            size = sparse.encode(grad, self.residual, out, self._scratch, np.uint64(seed),
                                 codec.chunk, codec._sparse_values, scale)
        return memoryview(out)[:size]

    def residual_norm(self) -> float:
        """L2 norm of the residual, for metrics."""
        return float(np.sqrt(np.dot(self.residual, self.residual)))


RAW = Codec(pb.CODEC_RAW)
"""Raw float32 values: what a header without codec fields means."""
