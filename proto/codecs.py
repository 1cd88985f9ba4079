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

Each codec is one :class:`CodecKind` subclass added with :func:`register` (a new codec needs
nothing else); :class:`Codec` is one codec with its parameters; :class:`Compressor` is one key's
sender state (the error-feedback residual and a reusable output buffer); error feedback wraps
every codec the same way: ``u = grad + residual``, send ``encode(u)``, keep
``residual = u - decode(...)``.

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

from bitps.native import all_finite, casts, sign1, sign1_publish_delta, sparse
from bitps.proto import bitps_pb2 as pb
from bitps.proto.registry import Names
from bitps.proto.sendbuffer import Buffer
from bitps.proto.wire import PSError

__all__ = ["CODECS", "CODEC_NAMES", "RAW", "Codec", "CodecConfig", "CodecKind", "Compressor",
           "MEAN_ABS", "SPARSE_BF16", "chunk_problem", "register"]

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


class CodecKind:
    """One codec's layout: its name and wire id, the payload size of a key, the checks of an
    untrusted payload, decoding, and the encoder with error feedback fused in (``u = grad *
    scale + residual``; the payload is ``code(u)``; ``residual = u - decode(payload)``, in one
    pass). Stateless: the codec's parameters (:class:`Codec`: chunk, flags) come with every
    call. A new codec is a subclass passed to :func:`register`; nothing else dispatches on ids.
    """

    name: str
    id: int
    chunked = False
    """Whether ``codec_chunk`` is one of this codec's parameters (then checked on receipt)."""
    payload_finite = False
    """Whether :meth:`all_finite` reads the payload alone (never ``decoded``): then a push of
    this codec may reach the update rule undecoded (``ps.pushcode``)."""
    is_raw = False

    def max_bytes(self, codec: Codec, n: int) -> int:
        """The largest payload for a key of ``n`` elements (exact unless overridden)."""
        raise NotImplementedError

    def size_of(self, codec: Codec, buf: np.ndarray, n: int) -> int | None:
        """The size of the payload at the start of ``buf`` (codes published back to back), or
        ``None`` when unreadable; fixed-size codecs answer :meth:`max_bytes`."""
        return self.max_bytes(codec, n)

    def check(self, codec: Codec, payload, n: int) -> str | None:
        """What is wrong with an untrusted payload for a key of ``n`` elements, or ``None``
        (fixed-size codecs: only its length can be wrong)."""
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        expected = self.max_bytes(codec, n)
        if size != expected:
            return (f"{self.name} payload is {size} bytes; expected {expected} for {n} "
                    f"elements{self._size_note(codec)}")
        return None

    def _size_note(self, codec: Codec) -> str:
        return ""

    def decode_add(self, codec: Codec, payload, n: int, acc: np.ndarray) -> None:
        """``acc[:n] += decode(payload)``; the payload passed :meth:`check`."""
        raise NotImplementedError

    def decode(self, codec: Codec, payload, n: int, out: np.ndarray) -> np.ndarray:
        """``out[:n] = decode(payload)``, returned; by default zeros and :meth:`decode_add`
        (a codec whose decoder can write override it: one pass instead of two)."""
        out = out[:n]
        out.fill(0.0)
        self.decode_add(codec, payload, n, out)
        return out

    def add_decoded(self, codec: Codec, payload, n: int, acc: np.ndarray) -> None:
        """``acc[:n] += decode(payload)``, bit for bit adding :meth:`decode`'s values (a sync
        step's sum of pushed codes, ``ps.pushcode``); by default through a temporary array (a
        codec whose pushes a rule takes as codes overrides it: one pass)."""
        acc[:n] += self.decode(codec, payload, n, np.empty(n, np.float32))

    def all_finite(self, codec: Codec, payload, n: int, decoded: np.ndarray) -> bool:
        """Whether every decoded value is finite; ``decoded`` is :meth:`decode`'s result (a
        codec that can tell from the payload alone overrides it)."""
        return bool(all_finite(decoded))

    def publish(self, codec: Codec, new: np.ndarray, param: np.ndarray,
                residual: np.ndarray, out: np.ndarray, scratch: np.ndarray | None,
                seed: int) -> int:
        """Encode the update ``new - param`` with error feedback into ``out`` and add the
        code's decode to ``param`` (a shard publishing an update, ``ps.publish``); returns the
        payload size. ``new`` may be overwritten. By default subtract, :meth:`encode`,
        :meth:`decode_add`; a codec with a fused kernel overrides it, with the same bits."""
        np.subtract(new, param, out=new)
        size = self.encode(codec, new, residual, out, scratch, seed, 1.0)
        self.decode_add(codec, out[:size], param.shape[0], param)
        return size

    def scratch(self, codec: Codec, n: int) -> np.ndarray | None:
        """A reusable work buffer the encoder needs for a key of ``n`` elements, if any."""
        return None

    def encode(self, codec: Codec, grad: np.ndarray, residual: np.ndarray, out: np.ndarray,
               scratch: np.ndarray | None, seed: int, scale: float) -> int:
        """Encode ``grad * scale + residual`` into ``out`` (uint8 of :meth:`max_bytes`),
        update ``residual`` in place; returns the payload size."""
        raise NotImplementedError


CODECS: dict[str, int] = {}
"""Every registered codec: name -> wire id (``DataHeader.codec``)."""
_KINDS: dict[int, CodecKind] = {}
_BY_NAME: dict[str, CodecKind] = {}
CODEC_NAMES = Names(_BY_NAME)
"""The registered codecs' names, a live view (``CodecConfig.name``'s choices: a codec a
plug-in registers later is a valid ``--push-codec``)."""


def register(kind: type[CodecKind]) -> type[CodecKind]:
    """Add a codec to the registry (a class decorator); its name and id must be new (a
    plug-in's id: one that ``bitps.proto`` does not define, 100 and up)."""
    if not isinstance(kind.id, int) or not 0 <= kind.id < 1 << 31:
        raise ValueError(f"codec {kind.name!r}: id {kind.id!r}; expected an integer in "
                         f"[0, 2**31) (DataHeader.codec is an open proto3 enum, an int32)")
    if kind.id in _KINDS or kind.name in _BY_NAME:
        taken = _KINDS.get(kind.id) or _BY_NAME[kind.name]
        raise ValueError(f"codec {kind.name!r} (id {kind.id}) is already registered: "
                         f"{taken.name!r} has id {taken.id}")
    _KINDS[kind.id] = _BY_NAME[kind.name] = kind()
    CODECS[kind.name] = kind.id
    return kind


@register
class RawKind(CodecKind):
    """Little-endian float32 values, 4n bytes. With error feedback only clipping under overlap
    leaves a residual (see :class:`Compressor`)."""

    name, id, is_raw = "raw", pb.CODEC_RAW, True

    def max_bytes(self, codec, n):
        return 4 * n

    def decode_add(self, codec, payload, n, acc):
        np.add(acc[:n], np.frombuffer(payload, np.float32, count=n), out=acc[:n])

    def encode(self, codec, grad, residual, out, scratch, seed, scale):
        return casts.raw_encode(grad, residual, out.view(np.float32), scale=scale)


class _HalfKind(CodecKind):
    """A 16-bit float cast, 2n bytes; the subclasses name the cast's kernels."""

    cast_decode_add = cast_encode = None  # staticmethods: numba kernels of native/casts.py

    def max_bytes(self, codec, n):
        return 2 * n

    def decode_add(self, codec, payload, n, acc):
        self.cast_decode_add(payload, n, acc)

    def encode(self, codec, grad, residual, out, scratch, seed, scale):
        return self.cast_encode(grad, residual, out.view(np.uint16), scale=scale)


@register
class Bf16Kind(_HalfKind):
    """bfloat16, 2n bytes, round to nearest even (``native/casts.py``)."""

    name, id = "bf16", pb.CODEC_BF16
    cast_decode_add, cast_encode = staticmethod(casts.bf16_decode_add), \
        staticmethod(casts.bf16_encode)


@register
class Fp16Kind(_HalfKind):
    """IEEE binary16, 2n bytes (``native/casts.py``)."""

    name, id = "fp16", pb.CODEC_FP16
    cast_decode_add, cast_encode = staticmethod(casts.fp16_decode_add), \
        staticmethod(casts.fp16_encode)


@register
class Sign1Kind(CodecKind):
    """One sign bit per element and one float32 scale per chunk (``native/sign1.py``); flag
    :data:`MEAN_ABS` picks the mean-|u| scale over RMS."""

    name, id, chunked = "sign1", pb.CODEC_SIGN1, True
    payload_finite = True

    def max_bytes(self, codec, n):
        return sign1.payload_bytes(n, codec.chunk)

    def _size_note(self, codec):
        return f" (chunk {codec.chunk})"

    def decode_add(self, codec, payload, n, acc):
        sign1.decode_add(payload, n, acc, chunk=codec.chunk)

    def decode(self, codec, payload, n, out):
        return sign1.decode(payload, n, out, chunk=codec.chunk)

    def add_decoded(self, codec, payload, n, acc):
        sign1.add_decoded(payload, n, acc, chunk=codec.chunk)

    def publish(self, codec, new, param, residual, out, scratch, seed):
        scales, bits, size = sign1.payload_views(out, param.shape[0], codec.chunk)
        sign1_publish_delta(new, param, residual, scales, bits, np.int64(codec.chunk),
                            bool(codec.flags & MEAN_ABS))
        return size

    def all_finite(self, codec, payload, n, decoded):
        return sign1.scales_finite(payload, n, chunk=codec.chunk)

    def encode(self, codec, grad, residual, out, scratch, seed, scale):
        return sign1.encode(grad, residual, out, chunk=codec.chunk,
                            mean_abs=bool(codec.flags & MEAN_ABS), scale=scale)


@register
class SparseKind(CodecKind):
    """Elements above a sampled threshold, data-dependent size (``native/sparse.py``); flag
    :data:`SPARSE_BF16` picks bf16 values over 8-bit sign + exponent."""

    name, id, chunked = "sparse", pb.CODEC_SPARSE, True

    @staticmethod
    def _values(codec: Codec) -> int:
        return sparse.BF16 if codec.flags & SPARSE_BF16 else sparse.NATEXP8

    def max_bytes(self, codec, n):
        return sparse.max_payload_bytes(n, codec.chunk, self._values(codec))

    def size_of(self, codec, buf, n):
        return sparse.size_of(buf, n, codec.chunk)

    def check(self, codec, payload, n):
        return sparse.check(np.frombuffer(payload, np.uint8), n, codec.chunk)

    def decode_add(self, codec, payload, n, acc):
        sparse.decode_add(np.frombuffer(payload, np.uint8), n, codec.chunk, acc)

    def scratch(self, codec, n):
        return np.empty(sparse.sample_size(n), np.float32)

    def encode(self, codec, grad, residual, out, scratch, seed, scale):
        return sparse.encode(grad, residual, out, scratch, np.uint64(seed), codec.chunk,
                             self._values(codec), scale)


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How one direction of traffic is compressed (a setting; the codec table is in
    docs/design.md)."""

    name: str = field(default="raw", metadata={"choices": CODEC_NAMES})
    """A registered codec: ``raw``, ``bf16``, ``fp16``, ``sign1``, ``sparse`` or one added with
    :func:`register` (the choices are the live registry)."""
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
    """One codec and its parameters, as a header carries them: encode, check and decode payload
    frames through the registered :class:`CodecKind` of ``id``."""

    id: int
    chunk: int = sign1.DEFAULT_CHUNK
    flags: int = 0

    def __post_init__(self) -> None:
        if self.id not in _KINDS:
            raise ValueError(f"codec id {self.id} is not registered; expected one of "
                             f"{sorted(_KINDS)}")

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
        kind = _KINDS.get(codec)
        if kind is None:
            raise PSError(pb.BAD_DTYPE, f"codec {codec} is unknown; expected one of "
                          f"{sorted(_KINDS)} ({', '.join(CODECS)}); a plug-in's codec needs "
                          f"its --plugin on both sides")
        if kind.chunked and (problem := chunk_problem(chunk)):
            raise PSError(pb.BAD_DTYPE, f"{kind.name} {problem}")
        if flags & ~(MEAN_ABS | SPARSE_BF16):
            raise PSError(pb.BAD_DTYPE, f"codec flags {flags:#x}; only bits 0 and 1 are defined")
        return cls(codec, chunk or sign1.DEFAULT_CHUNK, flags)

    @property
    def kind(self) -> CodecKind:
        return _KINDS[self.id]

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def is_raw(self) -> bool:
        return self.kind.is_raw

    def wire_fields(self) -> tuple[int, int, int]:
        """``(codec, codec_chunk, codec_flags)`` for a ``DataHeader``."""
        return self.id, self.chunk, self.flags

    def max_bytes(self, n: int) -> int:
        """The largest payload for a key of ``n`` elements (exact for all but sparse)."""
        return self.kind.max_bytes(self, n)

    def check(self, payload, n: int) -> str | None:
        """What is wrong with an untrusted frame for a key of ``n`` elements, or ``None``."""
        return self.kind.check(self, payload, n)

    def split(self, frame, n: int) -> list[np.ndarray] | str:
        """The payloads concatenated in ``frame`` (the codes a shard published for a key of
        ``n`` elements, oldest first), each checked; or what is wrong with the frame."""
        buf = np.frombuffer(frame, np.uint8)
        kind, parts, pos = self.kind, [], 0
        while pos < buf.shape[0]:
            size = kind.size_of(self, buf[pos:], n)
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
        self.kind.decode_add(self, payload, n, acc)

    def decode(self, payload, n: int, out: np.ndarray) -> np.ndarray:
        """The float32 values of ``payload`` written to ``out[:n]`` (raw: a view, no copy)."""
        if self.is_raw:
            return np.frombuffer(payload, np.float32, count=n)
        return self.kind.decode(self, payload, n, out)

    def add_decoded(self, payload, n: int, acc: np.ndarray) -> None:
        """``acc[:n] += decode(payload)``, the same bits as adding :meth:`decode`'s values."""
        self.kind.add_decoded(self, payload, n, acc)

    def all_finite(self, payload, n: int, decoded: np.ndarray) -> bool:
        """Whether every value of ``decoded`` (:meth:`decode` of ``payload``) is finite, read
        from the payload where the codec allows (sign1: its scales)."""
        if self.is_raw:
            return bool(all_finite(decoded))
        return self.kind.all_finite(self, payload, n, decoded)


class Compressor:
    """One key's sender side: the codec, its error-feedback residual (the state to save and
    restore) and a reusable output buffer. Not thread-safe; one per key and direction.

    A raw compressor sends ``grad * scale + residual`` as float32 and keeps a zero residual:
    only clipping under overlap (``worker.training.clip``) adds to it, once the step's exact clip
    factor is known, so that what a raw key missed arrives with its next push."""

    def __init__(self, codec: Codec, n: int) -> None:
        self.codec, self.n = codec, n
        self.residual = np.zeros(n, np.float32)
        self._out = Buffer(np.empty(codec.max_bytes(n), np.uint8))
        self._scratch = codec.kind.scratch(codec, n)

    def encode(self, grad: np.ndarray, *, seed: int = 0, scale: float = 1.0) -> memoryview:
        """The payload for ``grad * scale`` (plus the residual); valid until the next call.
        ``seed`` drives sparse's sampling and stochastic rounding (vary it per step); ``scale``
        is the clip factor."""
        if grad.shape != (self.n,):
            raise ValueError(f"gradient has shape {grad.shape}; this key has ({self.n},)")
        codec, out = self.codec, self.buffer
        size = codec.kind.encode(codec, grad, self.residual, out, self._scratch, seed, scale)
        return memoryview(out)[:size]

    def publish(self, new: np.ndarray, param: np.ndarray, *, seed: int = 0) -> memoryview:
        """The payload for the update ``new - param`` (plus the residual), its decode added
        to ``param`` in place (``CodecKind.publish``); ``new`` may be overwritten. Valid until
        the next call."""
        if new.shape != (self.n,) or param.shape != (self.n,):
            raise ValueError(f"arrays of shapes {new.shape}, {param.shape}; this key has "
                             f"({self.n},)")
        codec, out = self.codec, self.buffer
        size = codec.kind.publish(codec, new, param, self.residual, out, self._scratch, seed)
        return memoryview(out)[:size]

    @property
    def buffer(self) -> np.ndarray:
        """The output buffer (uint8 of ``codec.max_bytes(n)``) the next payload is written
        into, which :meth:`encode` returns views of: where a fused kernel writes its payload
        too (``native.publish``). The same buffer every time, unless a send still reads it
        (:meth:`hold`): then a new one, and the old one is left to that send."""
        if self._out.in_flight():
            self._out = Buffer(np.empty_like(self._out.array))
        return self._out.array

    def owns(self, payload: memoryview | np.ndarray) -> bool:
        """Whether ``payload`` is a view of the buffer the last payload was written into (what
        :meth:`hold` protects)."""
        base = payload.obj if isinstance(payload, memoryview) else payload.base
        return base is self._out.array

    def hold(self, payload: memoryview | np.ndarray, released) -> None:
        """A transport sends ``payload`` without copying it (ZeroMQ's zero-copy send, read by
        its I/O thread after ``send`` returns, or later when a peer connects): while
        ``released.done`` is false (pyzmq's ``MessageTracker``), no payload is written into
        its buffer. Copying instead cost the worker 11.5 ms per 32 MiB of payload on this
        machine's EPYC, mostly page faults in ZeroMQ's fresh messages, against 0.2 ms. A
        payload that is not a view of the current buffer needs no hold: nothing writes the
        old ones."""
        if self.owns(payload):
            self._out.track(released)

    def residual_norm(self) -> float:
        """L2 norm of the residual, for metrics."""
        return float(np.sqrt(np.dot(self.residual, self.residual)))


RAW = Codec(pb.CODEC_RAW)
"""Raw float32 values: what a header without codec fields means."""
