"""``sparse`` gradient codec: threshold sparsifier with error feedback, as numba kernels plus a
plain NumPy reference (``encode_reference``/``decode_reference``) that the tests hold them to,
bit for bit.

Encoding a key of ``n`` float32 elements with chunk size ``C`` (a multiple of 64), a u64 ``seed``
and a value mode:

1. ``u = grad * scale + residual`` (``scale``, the clip factor, is 1 by default).
2. ``tau = 2 * lower median of |u|`` over a sample: every element when ``n <= 4096``,
   else positions ``s, s+100, s+200, ... < n`` with ``s = rand(seed, 0) % 100``. The lower median
   of ``m`` values is element ``(m-1)//2`` of their ascending sort.
3. Element ``j`` is kept iff ``|u_j| > tau``; ``k`` are kept (an all-zero ``u`` keeps none).
4. Values of the kept elements, ascending by index: ``BF16`` rounds to nearest even bfloat16;
   ``NATEXP8`` keeps sign and a power-of-two exponent ``e``, rounded up with probability
   ``mantissa / 2**23`` (``rand(seed, j + 1) >> 41 < mantissa``, so the decoded value is unbiased)
   but never above 127 (so an infinite ``u`` counts as ``2**127``), and stored as an offset
   below its chunk's largest exponent. A kept zero/subnormal, or an offset of 127 or more, gets
   offset ``127`` and decodes to ``+0.0``.
5. ``residual = u - decoded`` for kept elements, ``u`` for the others (in place).

``rand(seed, i)`` is the splitmix64 finalizer of ``seed + (i + 1) * 0x9E3779B97F4A7C15``
(arithmetic mod 2**64).

Payload layout (multi-byte fields little-endian, no alignment assumed)::

    offset 0: u32 k (kept elements)
    offset 4: u8 index_mode (0 bitmap, 1 u32 list)
    offset 5: u8 value_mode (0 bf16, 1 natexp8)
    offset 6: u16 reserved, 0
    offset 8: index block (bitmap ceil(n/8) bytes, or 4k bytes of u32 indices)
    then:     value block (bf16: 2k bytes; natexp8: ceil(n/C) bytes of i8 chunk_max, then k
              bytes of codes)

The bitmap (used iff ``32*k > n``) sets bit ``j & 7`` of byte ``j >> 3`` for a kept ``j``; the
spare high bits of its last byte are 0. The list holds the kept indices ascending. A bf16 value
is the top half of the float's bits; a natexp8 code is ``sign << 7 | off``, decoded as
``+0.0`` if ``off == 127``, else ``+-2**(chunk_max - off)``, or ``+-0.0`` where that biased
exponent ``chunk_max - off + 127`` falls outside 1..254 (never in what ``encode`` writes).
``chunk_max`` is -128 in a chunk without a kept normal float.

Buffer ownership: the caller owns every array and kernels never allocate. ``grad`` is read only
(it may be a read-only view of a received frame); ``residual`` is updated in place; ``out`` must
hold ``max_payload_bytes`` even though the payload written is usually much shorter, because the
values are written where a bitmap payload wants them and moved once ``k`` is known (list mode),
using ``out``'s tail to stage the index list; ``scratch`` (``sample_size(n)`` float32) holds the
sample and a histogram. ``decode_add`` trusts its payload: run ``check`` on anything received.
A payload costs at least ``n/8`` bytes (or ``4k``): on keys of a few thousand elements the codec
saves little over sending the floats.

Speed: one pass over ``grad``/``residual`` in blocks of 64 elements: a loop that vectorizes
forms ``u``, stores it in ``residual`` and builds the block's keep mask, then only that block's
kept elements are visited (count trailing zeros of the mask) while they are in L1. natexp8
writes codes against the largest exponent seen so far in the chunk and shifts the chunk's
earlier codes when a larger one turns up (a few times per chunk). The median comes from a radix
select over the sample's bit patterns (non-negative floats order like their bits). On 16M
gaussian elements (18% kept) one encode took 2.5-3.5x (bf16) and 4-5.5x (natexp8) the time of
one ``np.copyto`` of the gradient, decode_add 1.3-1.6x (one thread, noisy 2-core VM).
"""

from __future__ import annotations

import struct

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

__all__ = ["BF16", "BITMAP", "DEFAULT_CHUNK", "HEADER_BYTES", "LIST", "NATEXP8",
           "SAMPLE_ALL_BELOW", "SAMPLE_STRIDE", "check", "decode_add", "decode_reference", "encode",
           "encode_reference", "max_payload_bytes", "sample_size", "size_of"]

HEADER_BYTES = 8
SAMPLE_STRIDE = 100
SAMPLE_ALL_BELOW = 4097
BF16 = 0
NATEXP8 = 1
BITMAP = 0
LIST = 1
DEFAULT_CHUNK = 2048
MAX_ELEMENTS = 2**32 - 1

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)
_ZERO_CODE = 127
_HIST = 2048

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


@intrinsic
def _llvm_cttz(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return x(x), codegen


if numba.config.DISABLE_JIT:
    def _ctz(x):
        """Pure-Python twin of ``llvm.cttz`` for ``NUMBA_DISABLE_JIT=1``."""
        x = int(x)
        return np.uint64((x & -x).bit_length() - 1)

    def _rand(seed, i):
        """Python-int twin of the jitted hash (NumPy scalars warn on wrap-around)."""
        m = 2**64 - 1
        z = (int(seed) + (int(i) + 1) * int(_GOLDEN)) & m
        z = ((z ^ (z >> 30)) * int(_MIX1)) & m
        z = ((z ^ (z >> 27)) * int(_MIX2)) & m
        return np.uint64(z ^ (z >> 31))
else:
    _ctz = _llvm_cttz

    @_jit
    def _rand(seed, i):
        """``rand(seed, i)`` for a u64 ``i``. Every operand is a u64: numba has typed int64 mixed
        with uint64 as float64 (NumPy 1 rules) or as int64, depending on its version."""
        z = seed + (i + _ONE) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def max_payload_bytes(n: int, chunk: int, value_mode: int) -> int:
    """Size ``out`` for ``encode``: list mode is only chosen when ``4k <= n/8``."""
    values = 2 * n if value_mode == BF16 else -(-n // chunk) + n
    return HEADER_BYTES + -(-n // 8) + values


def sample_size(n: int) -> int:
    """Length of the float32 ``scratch`` that ``encode`` needs for a key of ``n`` elements: the
    sample, then a histogram for the median."""
    return (n if n < SAMPLE_ALL_BELOW else -(-n // SAMPLE_STRIDE)) + _HIST


# ---------------------------------------------------------------- kernels
# Hot loops index with u64 values: numba wraps negative signed indices around, and for an index
# of unknown sign that turned every vector load into a gather (4x slower). Helpers called per
# element or block are small and loop-free, which LLVM inlines; it did not inline helpers with
# loops (a call per block cost 2x), and numba's inline="always" adds atomic reference-count
# updates for each array argument.


@_jit
def _get_u32(buf, p):
    return (np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16)
            | (np.int64(buf[p + 3]) << 24))


@_jit
def _put_u32(buf, p, v):
    for t in range(4):
        buf[p + t] = (v >> (8 * t)) & 0xFF


@_jit
def _get_bits(buf, p, nbytes):
    """Up to 8 bitmap bytes as one little-endian u64."""
    w = np.uint64(0)
    for t in range(nbytes):
        w |= np.uint64(buf[p + t]) << np.uint64(8 * t)
    return w


@_jit
def _radix_select(a, kth, hist):
    """The ``kth`` smallest of ``a`` (u32 values below 2**31), fixing 11, 11 and 9 bits per pass
    with a histogram of those bits over the values that match the bits fixed so far: three
    linear passes whatever the data (a quickselect mispredicts every other comparison)."""
    prefix, known = np.uint32(0), np.uint32(0)
    for shift, width in ((20, 11), (9, 11), (0, 9)):
        digits = np.uint32((1 << width) - 1)
        hist[:digits + 1] = 0
        for i in range(a.shape[0]):
            if a[i] & known == prefix:
                hist[(a[i] >> np.uint32(shift)) & digits] += 1
        d = 0
        while kth >= hist[d]:
            kth -= hist[d]
            d += 1
        prefix |= np.uint32(d << shift)
        known |= digits << np.uint32(shift)
    return prefix


@_jit
def _threshold(grad, residual, scratch, seed, gscale):
    n = grad.shape[0]
    start, step = 0, 1
    if n >= SAMPLE_ALL_BELOW:
        start = np.int64(_rand(seed, np.uint64(0)) % np.uint64(SAMPLE_STRIDE))
        step = SAMPLE_STRIDE
    m = 0
    for p in range(start, n, step):
        scratch[m] = abs(grad[p] * gscale + residual[p])
        m += 1
    if m == 0:
        return np.float32(0)
    median = _radix_select(scratch[:m].view(np.uint32), (m - 1) // 2,
                           scratch[m:m + _HIST].view(np.uint32))
    return np.uint32(median).view(np.float32) * np.float32(2)


@_jit
def _rounded_biased(b, seed, j):
    """Biased exponent of element ``j`` (float bits ``b``) after stochastic rounding, at most
    254; 0 for zero/subnormal."""
    biased = np.int64((b >> np.uint32(23)) & np.uint32(0xFF))
    if biased != 0:
        up = (_rand(seed, j + _ONE) >> np.uint64(41)) < np.uint64(b & np.uint32(0x7FFFFF))
        biased = min(biased + np.int64(up), 254)
    return biased


@_jit
def _natexp8_code(b, biased, cmax):
    """(code, offset) of an element against chunk exponent ``cmax``; offset >= 127 means the
    element goes out as zero."""
    off = cmax + 127 - biased if biased != 0 else _ZERO_CODE
    return (np.int64(b >> np.uint32(31)) << 7) | min(off, _ZERO_CODE), off


@_jit
def _pow2(b, biased):
    """The decoded ``+-2**e``. ``u - pow2`` is exact (Sterbenz: ``u`` and ``+-2**e`` are within
    a factor of two), so ``residual + pow2`` gives ``u`` back bit for bit."""
    return np.uint32((b & np.uint32(0x80000000)) | np.uint32(biased << 23)).view(np.float32)


@_jit
def _encode_chunk(grad, residual, out, tau, seed, c0, c1, vpos, value_mode, gscale):
    """Elements ``c0 <= j < c1``: ``residual = u`` and the bitmap, 64 at a time in a loop that
    vectorizes, then the values of that block's kept elements from ``out[vpos]`` on, while it
    is in L1; every kept element is visited once (count trailing zeros of the block's mask).
    natexp8 codes are written against the chunk exponent seen so far and shifted when a larger
    one turns up (``_raise_cmax``; a few times per chunk). Returns (chunk exponent, -128 if no
    kept element is a normal float; new ``vpos``)."""
    bits = residual.view(np.uint32)
    cmax, start, vpos = -128, vpos, np.uint64(vpos)
    for b0 in range(c0, c1, 64):
        lo, hi = np.uint64(b0), np.uint64(min(b0 + 64, c1))
        mask = np.uint64(0)
        for j in range(lo, hi):
            u = grad[j] * gscale + residual[j]
            residual[j] = u
            mask |= np.uint64(abs(u) > tau) << (j - lo)
        p = HEADER_BYTES + (b0 >> 3)
        for t in range((min(b0 + 64, c1) - b0 + 7) >> 3):
            out[p + t] = (mask >> np.uint64(8 * t)) & np.uint64(0xFF)
        while value_mode == BF16 and mask:
            j = lo + _ctz(mask)
            mask &= mask - _ONE
            b = np.uint64(bits[j])
            q = ((b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & _ONE))
                 & np.uint64(0xFFFFFFFF)) >> np.uint64(16)
            out[vpos] = q & np.uint64(0xFF)
            out[vpos + _ONE] = q >> np.uint64(8)
            vpos += np.uint64(2)
            residual[j] = residual[j] - np.uint32(q << np.uint64(16)).view(np.float32)
        while mask:
            j = lo + _ctz(mask)
            mask &= mask - _ONE
            b = bits[j]
            biased = _rounded_biased(b, seed, j)
            if biased != 0 and biased - 127 > cmax:
                if cmax != -128:
                    _raise_cmax(residual, out, c0, start, np.int64(vpos), cmax,
                                biased - 127 - cmax)
                cmax = biased - 127
            code, off = _natexp8_code(b, biased, cmax)
            out[vpos] = code
            if off < _ZERO_CODE:
                residual[j] = residual[j] - _pow2(b, biased)
            vpos += _ONE
    return cmax, np.int64(vpos)


@_jit
def _raise_cmax(residual, out, c0, start, end, cmax, delta):
    """The chunk exponent grows by ``delta``: codes ``out[start:end]`` already written for the
    chunk's elements from ``c0`` on are shifted. Codes pushed to offset 127 or more (rare: a
    chunk spanning 127 binades) now mean zero, so their residual gets ``u`` back."""
    codes = out[start:end]
    worst = 0
    for q in range(codes.shape[0]):
        low = np.int64(codes[q] & 127)
        worst = max(worst, low if low != _ZERO_CODE else 0)
    if worst + delta < _ZERO_CODE:
        for q in range(codes.shape[0]):
            codes[q] += np.uint8(delta if codes[q] & 127 != _ZERO_CODE else 0)
        return
    nb = (residual.shape[0] + 7) >> 3
    q, w = 0, c0
    while q < codes.shape[0]:
        mask = _get_bits(out, HEADER_BYTES + (w >> 3), min(8, nb - (w >> 3)))
        while mask and q < codes.shape[0]:
            j = np.uint64(w) + _ctz(mask)
            mask &= mask - _ONE
            low = np.int64(codes[q] & 127)
            if low != _ZERO_CODE and low + delta >= _ZERO_CODE:
                sign = np.int64(codes[q] >> 7) << 31  # not residual's: u - d may differ in sign
                d = np.uint32(sign | ((cmax - low + 127) << 23)).view(np.float32)
                residual[j] = residual[j] + d
                codes[q] |= np.uint8(_ZERO_CODE)
            elif low != _ZERO_CODE:
                codes[q] += np.uint8(delta)
            q += 1
        w += 64


@_jit
def _to_list(out, n, k, v0, vbytes):
    """Bitmap at offset 8 -> u32 list there, value block moved down behind it. The list is built
    in ``out``'s tail first because it would overwrite bitmap bytes not yet read."""
    nb = (n + 7) >> 3
    tail = v0 + vbytes
    p = tail
    for w in range(0, nb, 8):
        mask = _get_bits(out, HEADER_BYTES + w, min(8, nb - w))
        while mask:
            _put_u32(out, p, 8 * w + np.int64(_ctz(mask)))
            mask &= mask - _ONE
            p += 4
    for i in range(4 * k):
        out[HEADER_BYTES + i] = out[tail + i]
    for i in range(vbytes):  # forward copy: the destination lies below the source
        out[HEADER_BYTES + 4 * k + i] = out[v0 + i]


@_jit
def _encode(grad, residual, out, scratch, seed, chunk, value_mode, gscale):
    """The whole payload into ``out``; returns its length."""
    n = grad.shape[0]
    tau = _threshold(grad, residual, scratch, seed, gscale)
    v0 = HEADER_BYTES + ((n + 7) >> 3)
    nch = (n + chunk - 1) // chunk
    vbase = v0 if value_mode == BF16 else v0 + nch
    vpos = vbase
    for c in range(nch):
        c0 = c * chunk
        c1 = min(c0 + chunk, n)
        cmax, vpos = _encode_chunk(grad, residual, out, tau, seed, c0, c1, vpos, value_mode,
                                   gscale)
        if value_mode == NATEXP8:
            out[v0 + c] = cmax & 0xFF
    k = (vpos - vbase) >> 1 if value_mode == BF16 else vpos - vbase
    mode = BITMAP if 32 * k > n else LIST
    if mode == LIST:
        _to_list(out, n, k, v0, vpos - v0)
    _put_u32(out, 0, k)
    out[4], out[5], out[6], out[7] = mode, value_mode, 0, 0
    return vpos if mode == BITMAP else vpos - v0 + HEADER_BYTES + 4 * k


@_jit
def _decode_add(payload, n, chunk, acc):
    """``acc[j] += decoded_j`` for the elements a checked payload carries."""
    k = _get_u32(payload, 0)
    index_mode, value_mode = payload[4], payload[5]
    nb = (n + 7) >> 3
    v0 = HEADER_BYTES + (nb if index_mode == BITMAP else 4 * k)
    vbase = np.uint64(v0 if value_mode == BF16 else v0 + (n + chunk - 1) // chunk)
    natexp8 = value_mode == NATEXP8
    if index_mode == LIST:
        for i in range(k):
            j = _get_u32(payload, HEADER_BYTES + 4 * i)
            cmax = np.int64(np.int8(payload[v0 + j // chunk])) if natexp8 else 0
            acc[j] += _value_at(payload, value_mode, vbase, np.uint64(i), cmax)
        return
    i = np.uint64(0)
    for b0 in range(0, n, 64):
        mask = np.uint64(0)
        for t in range(min(8, nb - (b0 >> 3))):
            mask |= np.uint64(payload[HEADER_BYTES + (b0 >> 3) + t]) << np.uint64(8 * t)
        # blocks of 64 never straddle chunks
        cmax = np.int64(np.int8(payload[v0 + b0 // chunk])) if natexp8 else 0
        while mask:
            j = np.uint64(b0) + _ctz(mask)
            mask &= mask - _ONE
            acc[j] += _value_at(payload, value_mode, vbase, i, cmax)
            i += _ONE


@_jit
def _value_at(payload, value_mode, vbase, i, cmax):
    """Decoded value of the ``i``-th element sent (values start at ``vbase``)."""
    if value_mode == BF16:
        q = np.uint32(payload[vbase + 2 * i]) | (np.uint32(payload[vbase + 2 * i + _ONE]) << 8)
        return np.uint32(q << 16).view(np.float32)
    code = np.int64(payload[vbase + i])
    low = code & 127
    if low == _ZERO_CODE:
        return np.float32(0)
    biased = cmax - low + 127
    bits = (code >> 7) << 31
    if 1 <= biased <= 254:
        bits |= biased << 23
    return np.uint32(bits).view(np.float32)


@_jit
def _first_bad_index(payload, k, n):
    """Position, value and predecessor of the first list entry that is not ascending or not
    below ``n``; position -1 when the list is fine."""
    prev = -1
    for i in range(k):
        j = _get_u32(payload, HEADER_BYTES + 4 * i)
        if j <= prev or j >= n:
            return i, j, prev
        prev = j
    return -1, 0, 0


@_jit
def _popcount8(b):
    b = np.int64(b)
    b = b - ((b >> 1) & 0x55)
    b = (b & 0x33) + ((b >> 2) & 0x33)
    return (b + (b >> 4)) & 0x0F


@_jit
def _bitmap_popcount(payload, nb):
    total = 0
    for p in range(HEADER_BYTES, HEADER_BYTES + nb):
        total += _popcount8(payload[p])
    return total


# ---------------------------------------------------------------- Python entry points


def _vector(name, a, dtype, n=None, writable=False):
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 \
            or not a.flags.c_contiguous:
        got = f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a)
        raise ValueError(f"{name} is a {got}, expected a flat C-contiguous {np.dtype(dtype)} array")
    if n is not None and a.shape[0] < n:
        raise ValueError(f"{name} has {a.shape[0]} elements, expected at least {n}")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only, expected a writable array")
    return a.shape[0]


def _key(n, chunk):
    if not 0 <= n <= MAX_ELEMENTS:
        raise ValueError(f"key has {n} elements, expected 0..{MAX_ELEMENTS} (u32 indices)")
    if chunk <= 0 or chunk % 64:
        raise ValueError(f"chunk is {chunk}, expected a positive multiple of 64")


def encode(grad, residual, out, scratch, seed, chunk, value_mode, scale=1.0) -> int:
    """Encode ``grad * scale`` plus the error-feedback ``residual`` into ``out[:nbytes]`` and
    return ``nbytes``; ``residual`` becomes what was not sent. Size ``out`` with
    ``max_payload_bytes`` and ``scratch`` (float32) with ``sample_size``.

    >>> n = 10_000; res = np.zeros(n, np.float32)
    >>> out = np.empty(max_payload_bytes(n, 2048, BF16), np.uint8)
    >>> nbytes = encode(np.ones(n, np.float32), res, out, np.empty(sample_size(n), np.float32),
    ...                 7, 2048, BF16)
    """
    n = _vector("grad", grad, np.float32)
    _key(n, chunk)
    if value_mode not in (BF16, NATEXP8):
        raise ValueError(f"value_mode is {value_mode!r}, expected {BF16} (bf16) or "
                         f"{NATEXP8} (natexp8)")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed is {seed}, expected 0..2**64-1")
    if _vector("residual", residual, np.float32, n, writable=True) != n:
        raise ValueError(f"residual has {residual.shape[0]} elements, expected {n} like grad")
    _vector("out", out, np.uint8, max_payload_bytes(n, chunk, value_mode), writable=True)
    _vector("scratch", scratch, np.float32, sample_size(n), writable=True)
    for a, b in ((residual, grad), (residual, out), (residual, scratch), (out, scratch),
                 (out, grad), (scratch, grad)):
        if np.may_share_memory(a, b):
            raise ValueError("grad, residual, out and scratch overlap, expected separate buffers")
    return int(_encode(grad, residual, out, scratch, np.uint64(seed), np.int64(chunk),
                       np.int64(value_mode), np.float32(scale)))


def decode_add(payload, n, chunk, acc) -> None:
    """``acc[j] += decoded_j`` (float32 adds) for every element ``j < n`` the payload carries;
    other elements of ``acc`` (which may be longer) are left alone. ``payload`` (uint8 array or
    bytes) must have passed ``check``."""
    _key(n, chunk)
    if not isinstance(payload, np.ndarray):
        payload = np.frombuffer(payload, np.uint8)
    _vector("payload", payload, np.uint8, HEADER_BYTES)
    _vector("acc", acc, np.float32, n, writable=True)
    _decode_add(payload, np.int64(n), np.int64(chunk), acc[:n])


def _payload_bytes(n, chunk, k, index_mode, value_mode):
    index = -(-n // 8) if index_mode == BITMAP else 4 * k
    values = 2 * k if value_mode == BF16 else -(-n // chunk) + k
    return HEADER_BYTES + index + values


def size_of(payload, n, chunk) -> int | None:
    """The length of the payload that starts ``payload`` (a uint8 array that may hold more
    after it), read from its header; ``None`` when the header is unreadable. Published codes
    travel concatenated, so a receiver splits them by this, then ``check``s each."""
    buf = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
    if buf.shape[0] < HEADER_BYTES:
        return None
    k, index_mode, value_mode, _ = struct.unpack("<IBBH", bytes(buf[:HEADER_BYTES]))
    if index_mode not in (BITMAP, LIST) or value_mode not in (BF16, NATEXP8) or k > n:
        return None
    return _payload_bytes(n, chunk, k, index_mode, value_mode)


def check(payload, n, chunk) -> str | None:
    """None when ``payload`` (an untrusted uint8 array or bytes) is a well-formed payload for a
    key of ``n`` elements and chunk size ``chunk``, else what is wrong with it. The index mode
    must be the one ``encode`` picks for ``k`` (bitmap iff ``32*k > n``)."""
    _key(n, chunk)
    buf = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
    _vector("payload", buf, np.uint8)
    if buf.shape[0] < HEADER_BYTES:
        return f"payload has {buf.shape[0]} bytes, expected at least {HEADER_BYTES} (header)"
    k, index_mode, value_mode, reserved = struct.unpack("<IBBH", bytes(buf[:HEADER_BYTES]))
    if value_mode not in (BF16, NATEXP8):
        return f"value_mode is {value_mode}, expected {BF16} (bf16) or {NATEXP8} (natexp8)"
    if reserved:
        return f"reserved header field is {reserved}, expected 0"
    if k > n:
        return f"k is {k}, expected at most n={n}"
    want = BITMAP if 32 * k > n else LIST
    if index_mode != want:
        name = "bitmap" if want == BITMAP else "u32 list"
        return f"index_mode is {index_mode}, expected {want} ({name}) for k={k}, n={n}"
    size = _payload_bytes(n, chunk, k, index_mode, value_mode)
    if buf.shape[0] != size:
        return (f"payload has {buf.shape[0]} bytes, expected {size} for k={k}, "
                f"index_mode={index_mode}, value_mode={value_mode}, n={n}, chunk={chunk}")
    if index_mode == LIST:
        i, j, prev = _first_bad_index(buf, np.int64(k), np.int64(n))
        if i >= 0 and j >= n:
            return f"index {i} of the list is {j}, expected below n={n}"
        if i >= 0:
            return f"index {i} of the list is {j} after {prev}, expected strictly ascending"
        return None
    nb = -(-n // 8)
    spare = int(buf[HEADER_BYTES + nb - 1]) >> (n - 8 * (nb - 1)) if nb else 0
    if spare:
        return f"bitmap's last byte is {buf[HEADER_BYTES + nb - 1]:#04x}, expected no bits " \
               f"set at or beyond n={n}"
    ones = int(_bitmap_popcount(buf, np.int64(nb)))
    if ones != k:
        return f"bitmap has {ones} bits set, expected k={k}"
    return None


# ---------------------------------------------------------------- NumPy reference


def _rand_np(seed, i):
    """``rand`` over a uint64 array (array arithmetic wraps without warnings)."""
    z = np.uint64(seed) + (i + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _natexp8_np(codes, cmax):
    low = codes & 127
    biased = cmax - low + 127
    mag = np.where((biased >= 1) & (biased <= 254), biased << 23, 0)
    bits = np.where(low == _ZERO_CODE, 0, ((codes >> 7) << 31) | mag)
    return bits.astype(np.uint32).view(np.float32)


def _natexp8_encode_np(kept, idx, seed, chunk, n):
    b = kept.view(np.uint32)
    biased = ((b >> 23) & 0xFF).astype(np.int64)
    up = (_rand_np(seed, idx.astype(np.uint64) + np.uint64(1)) >> np.uint64(41)) \
        < (b & 0x7FFFFF)
    e = np.minimum(biased - 127 + up, 127)
    nonzero = biased != 0
    of = idx // chunk
    cmax = np.full(-(-n // chunk), -128, np.int64)
    np.maximum.at(cmax, of[nonzero], e[nonzero])
    off = cmax[of] - e
    codes = ((b >> 31).astype(np.int64) << 7) | np.where(nonzero & (off < 127), off, 127)
    block = cmax.astype(np.int8).tobytes() + codes.astype(np.uint8).tobytes()
    return block, _natexp8_np(codes, cmax[of])


def encode_reference(grad, residual, seed, chunk, value_mode,
                     scale=1.0) -> tuple[bytes, np.ndarray]:
    """The codec spelled out in NumPy: ``(payload, new residual)``; inputs are not modified."""
    u = np.asarray(grad, np.float32) * np.float32(scale) + np.asarray(residual, np.float32)
    n = u.shape[0]
    mag = np.abs(u)
    if n >= SAMPLE_ALL_BELOW:
        start = int(_rand_np(seed, np.zeros(1, np.uint64))[0] % np.uint64(SAMPLE_STRIDE))
        mag_sample = mag[start::SAMPLE_STRIDE]
    else:
        mag_sample = mag
    m = mag_sample.shape[0]
    with np.errstate(over="ignore"):
        tau = np.sort(mag_sample)[(m - 1) // 2] * np.float32(2) if m else np.float32(0)
    keep = mag > tau
    idx = np.flatnonzero(keep)
    k = idx.shape[0]
    if 32 * k > n:
        index_mode, index = BITMAP, np.packbits(keep, bitorder="little").tobytes()
    else:
        index_mode, index = LIST, idx.astype("<u4").tobytes()
    kept = u[idx]
    if value_mode == BF16:
        b = kept.view(np.uint32)
        q = (b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16
        values, decoded = q.astype("<u2").tobytes(), (q << 16).view(np.float32)
    else:
        values, decoded = _natexp8_encode_np(kept, idx, seed, chunk, n)
    new_residual = u.copy()
    new_residual[idx] = kept - decoded
    header = struct.pack("<IBBH", k, index_mode, value_mode, 0)
    return header + index + values, new_residual


def decode_reference(payload, n, chunk) -> np.ndarray:
    """The dense float32 gradient a (checked) payload carries; zeros where nothing was sent."""
    buf = np.frombuffer(bytes(payload), np.uint8)
    k, index_mode, value_mode, _ = struct.unpack_from("<IBBH", buf)
    nb = -(-n // 8)
    if index_mode == BITMAP:
        idx = np.flatnonzero(np.unpackbits(buf[8:8 + nb], bitorder="little")[:n])
        v0 = 8 + nb
    else:
        idx = np.frombuffer(buf, "<u4", k, 8).astype(np.int64)
        v0 = 8 + 4 * k
    if value_mode == BF16:
        q = np.frombuffer(buf, "<u2", k, v0).astype(np.uint32)
        values = (q << 16).view(np.float32)
    else:
        nch = -(-n // chunk)
        cmax = np.frombuffer(buf, np.int8, nch, v0).astype(np.int64)
        codes = np.frombuffer(buf, np.uint8, k, v0 + nch).astype(np.int64)
        values = _natexp8_np(codes, cmax[idx // chunk])
    dense = np.zeros(n, np.float32)
    dense[idx] = values
    return dense
