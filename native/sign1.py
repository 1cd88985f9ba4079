"""The ``sign1`` codec: one sign bit per element plus one float32 scale per chunk, with error
feedback fused into the encoder.

Payload of a key of ``n`` float32 elements with chunk size ``C`` (a multiple of 64)::

    offset 0              ceil(n/C) float32 scales, little-endian, one per chunk
    offset 4*ceil(n/C)    ceil(n/8) bytes of sign bits: element j is bit (j & 7) of byte j >> 3
                          (LSB first, numpy ``bitorder="little"``); 1 = negative, 0 = positive
                          or zero; unused high bits of the last byte are 0

    total = ceil(n/8) + 4*ceil(n/C) bytes; element j decodes to ``scale[j // C] * (1 - 2*bit)``.

Encoding with error feedback (``residual`` is the key's EF state, updated in place)::

    u = grad * scale + residual               (float32; ``scale`` is the clip factor, 1 by
                                               default, which leaves ``grad`` as it is)
    scale[c] = RMS of u over chunk c          (default)  or mean |u| (``mean_abs``)
    residual = u - decode(payload)            (float32)

The chunk's sum of squares (or of |u|) is taken in float64 in a fixed order, so every
implementation (this kernel, the numpy reference, the torch one) gets the same bits: 64 lanes,
lane l summing elements ``l, l+64, l+128, ...`` of the chunk sequentially, then the lanes folded
pairwise (lane l += lane l + w/2 for w = 64, 32, ..., 2). The scale is
``float32(sqrt(sum / count))`` (RMS) or ``float32(sum / count)`` (mean |u|), with ``count`` the
chunk's element count (the last chunk may be short). An all-zero chunk has scale 0 and decodes to
zeros. Squares of float32 values are exact in float64, so only the fixed-order sums round.

The sign bits are packed and decoded a byte (8 elements) at a time with LLVM vector
operations (:func:`_signs8`: a compare and its mask; :func:`_set8`, :func:`_add8`: a select from
the byte's bits), which numba's loops over the bits did not become; plain numpy twins run
under ``NUMBA_DISABLE_JIT=1``.

Buffer ownership: the caller owns every array; kernels never allocate beyond 64 float64 lanes.
``grad`` may be a read-only view of a received frame. ``payload`` arguments of the decoder are
read only.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from bitps.native.update_rules import all_finite

__all__ = ["DEFAULT_CHUNK", "LANES", "add_decoded", "add_span", "chunk_scale", "decode",
           "decode_add", "decode_reference", "decode_span", "decoded8", "encode",
           "encode_reference", "pack_signs", "payload_bytes", "payload_views", "scales_finite",
           "split"]

DEFAULT_CHUNK = 2048
LANES = 64

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


def payload_bytes(n: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Exact payload size of a key of ``n`` elements: ``ceil(n/8) + 4*ceil(n/chunk)``."""
    return (n + 7) // 8 + 4 * ((n + chunk - 1) // chunk)


def split(payload: np.ndarray, n: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The scales (float32) and sign bytes (uint8) of a ``payload`` of ``payload_bytes(n, chunk)``
    bytes; views, no copy (scales may be unaligned when the payload is)."""
    nchunks = (n + chunk - 1) // chunk
    scales = np.frombuffer(payload, np.float32, count=nchunks)
    bits = np.frombuffer(payload, np.uint8, count=(n + 7) // 8, offset=4 * nchunks)
    return scales, bits


def payload_views(out: np.ndarray, n: int, chunk: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The scales (float32) and sign bytes (uint8) sections of an output buffer ``out``
    (uint8, at least :func:`payload_bytes` long) for a key of ``n`` elements, and the payload
    size: where an encoder writes (views, no copy)."""
    _check_chunk(chunk)
    size = payload_bytes(n, chunk)
    if out.dtype != np.uint8 or out.shape[0] < size:
        raise ValueError(f"out is {out.dtype}[{out.shape[0]}]; expected uint8 of >= {size} bytes")
    nchunks = (n + chunk - 1) // chunk
    return out[:4 * nchunks].view(np.float32), out[4 * nchunks:size], size


def _check_contiguous(array: np.ndarray, name: str) -> None:
    if array.dtype != np.float32 or not array.flags.c_contiguous:
        raise ValueError(f"{name} is {array.dtype}{array.shape} with strides {array.strides}; "
                         f"expected a C-contiguous float32 array")


def _check_chunk(chunk: int) -> None:
    if chunk <= 0 or chunk % LANES:
        raise ValueError(f"sign1 chunk is {chunk}; expected a positive multiple of {LANES}")


def encode(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, *,
           chunk: int = DEFAULT_CHUNK, mean_abs: bool = False, scale: float = 1.0) -> int:
    """Compress ``grad * scale + residual`` into ``out`` (uint8, at least ``payload_bytes``
    long) and store the new residual; returns the payload size."""
    _check_chunk(chunk)
    n = grad.shape[0]
    if residual.shape != grad.shape or residual.dtype != np.float32 or grad.dtype != np.float32:
        raise ValueError(f"grad {grad.dtype}{grad.shape} and residual {residual.dtype}"
                         f"{residual.shape} must both be float32 of one length")
    size = payload_bytes(n, chunk)
    if out.dtype != np.uint8 or out.shape[0] < size:
        raise ValueError(f"out is {out.dtype}[{out.shape[0]}]; expected uint8 of >= {size} bytes")
    nchunks = (n + chunk - 1) // chunk
    _encode(grad, residual, out[:4 * nchunks].view(np.float32), out[4 * nchunks:size],
            np.int64(chunk), mean_abs, np.float32(scale))
    return size


def decode_add(payload, n: int, acc: np.ndarray, *, chunk: int = DEFAULT_CHUNK) -> None:
    """``acc += decode(payload)`` for a payload of exactly ``payload_bytes(n, chunk)`` bytes
    (the caller checks the length: it comes off the wire)."""
    _check_chunk(chunk)
    _check_contiguous(acc, "acc")
    scales, bits = split(payload, n, chunk)
    _decode_add(scales, bits, acc[:n], np.int64(chunk), False)


def add_decoded(payload, n: int, acc: np.ndarray, *, chunk: int = DEFAULT_CHUNK) -> None:
    """``acc[:n] += decode(payload)`` in one pass, bit for bit adding what :func:`decode`
    writes: a zero scale adds +0.0 for either sign (:func:`decode_add` adds -0.0 for a set
    bit, which differs where ``acc`` holds -0.0). How a shard sums a sync step's pushed codes
    without decoding each into an array first."""
    _check_chunk(chunk)
    _check_contiguous(acc, "acc")
    scales, bits = split(payload, n, chunk)
    _decode_add(scales, bits, acc[:n], np.int64(chunk), True)


def decode(payload, n: int, out: np.ndarray, *, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """``out[:n] = decode(payload)`` in one pass (no zeroing first), bit for bit what
    ``out.fill(0); decode_add(...)`` gives: a zero scale decodes to +0.0 for either sign, as
    ``0.0 + -0.0`` does. Returns ``out[:n]``."""
    _check_chunk(chunk)
    _check_contiguous(out, "out")
    scales, bits = split(payload, n, chunk)
    decode_span(scales, bits, np.int64(chunk), 0, out[:n])
    return out[:n]


def scales_finite(payload, n: int, *, chunk: int = DEFAULT_CHUNK) -> bool:
    """Whether every element of the payload decodes finite: each decodes to ``+-scale`` of its
    chunk and every chunk has an element, so exactly when every scale is finite (a read of
    ``4 * ceil(n / chunk)`` bytes instead of the decoded ``4n``)."""
    scales, _ = split(payload, n, chunk)
    return bool(all_finite(np.ascontiguousarray(scales)))


@_jit
def _encode(grad, residual, scales, bits, chunk, mean_abs, gscale):
    # Loops index chunk-local slices from 0: with absolute indices numba cannot rule out
    # negative ones, wraps each access, and the loops stop vectorizing (2-3x slower).
    n = grad.shape[0]
    lanes = np.zeros(LANES, np.float64)
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        g = grad[lo:lo + m]
        u = residual[lo:lo + m]
        for j in range(m):
            u[j] = g[j] * gscale + u[j]
        s = chunk_scale(u, lanes, mean_abs)
        _pack_signs(u, bits[lo >> 3:(lo + m + 7) >> 3])
        neg_s = -s
        for j in range(m):
            x = u[j]
            u[j] = x - (neg_s if x < 0 else s)
        scales[c] = s


@_jit
def chunk_scale(u, lanes, mean_abs):
    """The float32 scale of one chunk ``u`` (RMS, or mean |u| with ``mean_abs``) in the fixed
    summation order of the module docstring; ``lanes`` is 64 float64 of scratch. For the
    encoders here and the fused update-and-publish kernels (``native.publish``)."""
    m = u.shape[0]
    lanes[:] = 0.0
    full = m - m % LANES
    for base in range(0, full, LANES):
        x = u[base:base + LANES]
        for lane in range(LANES):
            v = np.float64(x[lane])
            lanes[lane] += abs(v) if mean_abs else v * v
    for lane in range(m - full):
        v = np.float64(u[full + lane])
        lanes[lane] += abs(v) if mean_abs else v * v
    width = LANES
    while width > 1:
        width //= 2
        for lane in range(width):
            lanes[lane] = lanes[lane] + lanes[lane + width]
    mean = lanes[0] / m
    return np.float32(mean) if mean_abs else np.float32(np.sqrt(mean))


@_jit
def pack_signs(u, out):
    """Bit ``j`` of ``out`` (LSB first) = ``u[j] < 0``: the sign bits of one chunk."""
    _pack_signs(u, out)


if numba.config.DISABLE_JIT:
    def _signs8(u, start):
        """Pure-Python twin for ``NUMBA_DISABLE_JIT=1``."""
        return np.packbits(u[start:start + 8] < 0, bitorder="little")[0]

    def _set8(out, start, bits, positive, negative):
        out[start:start + 8] = np.where(np.unpackbits(np.uint8(bits), bitorder="little")
                                        .astype(bool), negative, positive)

    def _add8(out, start, bits, positive, negative):
        out[start:start + 8] += np.where(np.unpackbits(np.uint8(bits), bitorder="little")
                                         .astype(bool), negative, positive)
else:
    _V8 = ir.VectorType(ir.FloatType(), 8)

    def _vector8(context, builder, aryty, ary, start):
        """A pointer to 8 float32 of the contiguous array ``ary`` from element ``start``."""
        array = context.make_array(aryty)(context, builder, ary)
        return builder.bitcast(builder.gep(array.data, [start]), _V8.as_pointer())

    def _selected8(builder, bits, positive, negative):
        """8 lanes: lane k is ``negative`` where bit k of ``bits`` is set, else ``positive``."""
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), 8))
        splat = [builder.insert_element(ir.Constant(_V8, ir.Undefined), x, ir.IntType(32)(0))
                 for x in (negative, positive)]
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)
        negative, positive = (builder.shuffle_vector(v, v, zeros) for v in splat)
        return builder.select(mask, negative, positive)

    def _contiguous(*arrays) -> bool:
        """Typing guard: the vector operations address memory from the data pointer, so they
        take C-contiguous arrays only (a strided one fails to compile instead of misreading)."""
        return all(isinstance(a, numba.types.Array) and a.layout == "C" for a in arrays)

    @intrinsic
    def _signs8(typingctx, u, start):
        """Bit k of the result is ``u[start + k] < 0`` (false for NaN and -0.0), k = 0..7:
        one vector compare and its mask (``vcmpltps`` + ``vmovmskps`` with AVX), where numba's
        loop over the bits ran 2.7x slower (1.69 against 0.63 ms per 16 M elements in L1)."""
        def codegen(context, builder, signature, args):
            vec = builder.load(_vector8(context, builder, signature.args[0], *args), align=4)
            less = builder.fcmp_ordered("<", vec, ir.Constant(_V8, [0.0] * 8))
            return builder.bitcast(less, ir.IntType(8))

        if _contiguous(u):
            return numba.types.uint8(u, numba.types.intp), codegen

    @intrinsic
    def _set8(typingctx, out, start, bits, positive, negative):
        """``out[start + k] = negative if bit k of bits else positive``, k = 0..7 (one select)."""
        def codegen(context, builder, signature, args):
            ptr = _vector8(context, builder, signature.args[0], args[0], args[1])
            builder.store(_selected8(builder, *args[2:]), ptr, align=4)
            return context.get_dummy_value()

        if _contiguous(out):
            return numba.types.void(out, numba.types.intp, numba.types.uint8,
                                    numba.types.float32, numba.types.float32), codegen

    @intrinsic
    def _add8(typingctx, out, start, bits, positive, negative):
        """``out[start + k] += negative if bit k of bits else positive``, k = 0..7."""
        def codegen(context, builder, signature, args):
            ptr = _vector8(context, builder, signature.args[0], args[0], args[1])
            total = builder.fadd(builder.load(ptr, align=4),
                                 _selected8(builder, *args[2:]))
            builder.store(total, ptr, align=4)
            return context.get_dummy_value()

        if _contiguous(out):
            return numba.types.void(out, numba.types.intp, numba.types.uint8,
                                    numba.types.float32, numba.types.float32), codegen


decoded8 = _set8
"""``decoded8(out, start, bits, positive, negative)``: 8 elements of a decode from one byte of
sign bits, for the kernels that decode a code chunk by chunk (``native.push``)."""


@_jit
def _pack_signs(u, out):
    m = u.shape[0]
    full = m - m % 8
    for i in range(full >> 3):
        out[i] = _signs8(u, 8 * i)
    if full < m:
        byte = np.uint8(0)
        for k in range(m - full):
            byte |= np.uint8(u[full + k] < 0) << np.uint8(k)
        out[full >> 3] = byte


@_jit
def _decode_add(scales, bits, acc, chunk, as_decoded):
    n = acc.shape[0]
    for c in range(scales.shape[0]):
        lo = c * chunk
        m = min(n, lo + chunk) - lo
        s = scales[c]
        neg_s = -s
        if as_decoded:  # what decode writes: +0.0 for either sign of a zero scale
            s = s + np.float32(0.0)
            neg_s = np.float32(0.0) - s if s == 0 else -s
        a = acc[lo:lo + m]
        b = bits[lo >> 3:(lo + m + 7) >> 3]
        full = m - m % 8
        for i in range(full >> 3):
            _add8(a, 8 * i, b[i], s, neg_s)
        for j in range(full, m):
            a[j] = a[j] + (neg_s if (b[j >> 3] >> (j & 7)) & 1 else s)


@_jit
def decode_span(code_scales, code_bits, code_chunk, lo, out):
    """``out[:]`` = elements ``lo ..`` of a sign1 code's decode: :func:`decode` (a span from
    0 over the whole key) and the kernels that decode a push block by block as they read it.
    A zero scale decodes to +0.0 for either sign, as ``0.0 + -0.0`` (``decode_add`` onto
    zeros) gives. ``lo`` and ``code_chunk`` are multiples of 8, so every byte of bits lies in
    one code chunk; the code chunks the span crosses are walked one by one (no division per
    byte)."""
    _span(code_scales, code_bits, code_chunk, lo, out, False)


@_jit
def add_span(code_scales, code_bits, code_chunk, lo, out):
    """``out[:] +=`` elements ``lo ..`` of a sign1 code's decode, bit for bit adding what
    :func:`decode_span` writes (a zero scale adds +0.0 for either sign): the kernels that sum
    several pushed codes block by block (``native.publish``)."""
    _span(code_scales, code_bits, code_chunk, lo, out, True)


@_jit
def _span(code_scales, code_bits, code_chunk, lo, out, add):
    m = out.shape[0]
    j = 0
    while j < m:
        c = (lo + j) // code_chunk
        end = min(m, (c + 1) * code_chunk - lo)
        s = code_scales[c] + np.float32(0.0)
        neg_s = np.float32(0.0) - s if s == 0 else -s
        b = code_bits[(lo + j) >> 3:(lo + end + 7) >> 3]
        o = out[j:end]
        full = (end - j) - (end - j) % 8
        if add:  # branches per code chunk, not per element
            for i in range(full >> 3):
                _add8(o, 8 * i, b[i], s, neg_s)
            for k in range(full, end - j):
                o[k] = o[k] + (neg_s if (b[k >> 3] >> (k & 7)) & 1 else s)
        else:
            for i in range(full >> 3):
                _set8(o, 8 * i, b[i], s, neg_s)
            for k in range(full, end - j):
                o[k] = neg_s if (b[k >> 3] >> (k & 7)) & 1 else s
        j = end


# -- numpy reference (the spec check; written independently of the kernels) --------------------

def encode_reference(grad: np.ndarray, residual: np.ndarray, *, chunk: int = DEFAULT_CHUNK,
                     mean_abs: bool = False, scale: float = 1.0) -> tuple[bytes, np.ndarray]:
    """The payload and the new residual, in plain numpy."""
    _check_chunk(chunk)
    n = grad.shape[0]
    u = (grad * np.float32(scale) + residual).astype(np.float32)
    nchunks = (n + chunk - 1) // chunk
    padded = np.zeros(nchunks * chunk, np.float64)
    padded[:n] = np.abs(u) if mean_abs else u.astype(np.float64) ** 2
    # lane sums: sequential down each lane (cumsum is a plain left-to-right loop), then folded
    lanes = np.cumsum(padded.reshape(nchunks, chunk // LANES, LANES), axis=1)[:, -1, :]
    width = LANES
    while width > 1:
        width //= 2
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
    counts = np.minimum(chunk, n - np.arange(nchunks) * chunk)
    mean = lanes[:, 0] / counts
    scales = (mean if mean_abs else np.sqrt(mean)).astype(np.float32)
    negative = u < 0
    per_elem = np.repeat(scales, chunk)[:n]
    decoded = np.where(negative, -per_elem, per_elem)
    payload = scales.astype("<f4").tobytes() + np.packbits(negative, bitorder="little").tobytes()
    return payload, (u - decoded).astype(np.float32)


def decode_reference(payload: bytes, n: int, *, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """The dense float32 values of a payload, in plain numpy."""
    scales, bits = split(payload, n, chunk)
    negative = np.unpackbits(bits, count=n, bitorder="little").astype(bool)
    per_elem = np.repeat(scales, chunk)[:n]
    return np.where(negative, -per_elem, per_elem).astype(np.float32)
