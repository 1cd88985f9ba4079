"""``sparse`` gradient codec: threshold sparsifier with error feedback, as numba kernels plus a
plain NumPy reference (``encode_reference``/``decode_reference``) that the tests hold them to,
bit for bit.

Encoding a key of ``n`` float32 elements with chunk size ``C`` (a multiple of 64), a u64 ``seed``
and a value mode:

1. ``u = grad + residual``.
2. ``tau = 2 * lower median of |u|`` over a sample: every element when ``n < SAMPLE_ALL_BELOW``,
   else positions ``s, s+100, s+200, ... < n`` with ``s = rand(seed, 0) % 100``. The lower median
   of ``m`` values is element ``(m-1)//2`` of their ascending sort.
3. Element ``j`` is kept iff ``|u_j| > tau``; ``k`` are kept (an all-zero ``u`` keeps none).
4. Values of the kept elements, ascending by index: ``BF16`` rounds to nearest even bfloat16;
   ``NATEXP8`` keeps sign and a power-of-two exponent ``e``, rounded up with probability
   ``mantissa / 2**23`` (``rand(seed, j + 1) >> 41 < mantissa``, so the decoded value is unbiased)
   but never above 127, and stored as an offset below its chunk's largest exponent. A kept
   zero/subnormal, or an offset of 127 or more, gets the code ``127`` and decodes to ``+0.0``.
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
``+-2**(chunk_max - off)`` (0.0 where the biased exponent falls outside 1..254, ``+0.0`` for
``off == 127``). ``chunk_max`` is -128 in a chunk without a non-zero kept element.

Buffer ownership: the caller owns every array and kernels never allocate. ``grad`` is read only
(it may be a read-only view of a received frame); ``residual`` is updated in place; ``out`` must
hold ``max_payload_bytes`` even though the payload written is usually much shorter, because the
values are written where a bitmap payload wants them and moved once ``k`` is known (list mode),
using ``out``'s tail to stage the index list; ``scratch`` (``sample_size(n)`` float32) holds the
sample. ``decode_add`` trusts its payload: run ``check`` on anything received first.

Speed: one pass over ``grad``/``residual`` in blocks of 64: a vectorized loop forms ``u``,
stores it in ``residual`` and builds the block's keep mask; then only the kept elements are
visited (count-trailing-zeros over the mask), so there is no data-dependent branch per element.
natexp8 revisits a chunk's kept elements once its ``chunk_max`` is known, while it is in cache.
The median comes from a quickselect over the sample's bit patterns (non-negative floats order
like their bits).
"""

from __future__ import annotations

import struct

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

__all__ = ["BF16", "DEFAULT_CHUNK", "HEADER_BYTES", "NATEXP8", "SAMPLE_ALL_BELOW",
           "SAMPLE_STRIDE", "check", "decode_add", "decode_reference", "encode",
           "encode_reference", "max_payload_bytes", "sample_size"]

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
        """``rand(seed, i)`` for a u64 ``i`` (numba computes int64 mixed with uint64 in float64,
        so every operand here is a u64)."""
        z = seed + (i + _ONE) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def max_payload_bytes(n: int, chunk: int, value_mode: int) -> int:
    """Size ``out`` for ``encode``: list mode is only chosen when ``4k <= n/8``."""
    values = 2 * n if value_mode == BF16 else -(-n // chunk) + n
    return HEADER_BYTES + -(-n // 8) + values


def sample_size(n: int) -> int:
    """Length of the float32 ``scratch`` that ``encode`` needs for a key of ``n`` elements."""
    return n if n < SAMPLE_ALL_BELOW else -(-n // SAMPLE_STRIDE)


# ---------------------------------------------------------------- kernels
# Hot loops index with u64 values: numba wraps negative signed indices around, and for an index
# of unknown sign that turned every vector load into a gather (4x slower). Helpers called per
# element take scalars only: numba does not inline calls, and inline="always" adds two atomic
# reference-count updates per call for each array argument.


@_jit
def _get_u32(buf, p):
    return (np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16)
            | (np.int64(buf[p + 3]) << 24))


@_jit
def _put_u32(buf, p, v):
    for t in range(4):
        buf[p + t] = (v >> (8 * t)) & 0xFF


@_jit
def _get_i8(buf, p):
    v = np.int64(buf[p])
    return v - 256 if v >= 128 else v


@_jit
def _get_bits(buf, p, nbytes):
    """Up to 8 bitmap bytes as one little-endian u64."""
    w = np.uint64(0)
    for t in range(nbytes):
        w |= np.uint64(buf[p + t]) << np.uint64(8 * t)
    return w


@_jit
def _select(a, kth):
    """In-place quickselect: the ``kth`` smallest of ``a``. Median-of-three pivots, and a sort
    of what is left after 64 rounds so adversarial data cannot make it quadratic."""
    lo, hi = 0, a.shape[0] - 1
    for _ in range(64):
        if lo >= hi:
            return a[kth]
        x, y, z = a[lo], a[(lo + hi) >> 1], a[hi]
        pivot = max(min(x, y), min(max(x, y), z))
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            return a[kth]
    a[lo:hi + 1].sort()
    return a[kth]


@_jit
def _threshold(grad, residual, scratch, seed):
    n = grad.shape[0]
    start, step = 0, 1
    if n >= SAMPLE_ALL_BELOW:
        start = np.int64(_rand(seed, np.uint64(0)) % np.uint64(SAMPLE_STRIDE))
        step = SAMPLE_STRIDE
    m = 0
    for p in range(start, n, step):
        scratch[m] = abs(grad[p] + residual[p])
        m += 1
    if m == 0:
        return np.float32(0)
    median = _select(scratch[:m].view(np.uint32), (m - 1) // 2)
    return np.uint32(median).view(np.float32) * np.float32(2)


@_jit
def _mark(grad, residual, out, tau, c0, c1):
    """``residual = u`` over elements ``c0 <= j < c1`` and their bitmap bytes, 64 at a time in
    loops that vectorize; returns the largest kept ``|u|`` as float bits."""
    bits = residual.view(np.uint32)
    top = np.uint32(0)
    for b0 in range(c0, c1, 64):
        lo, hi = np.uint64(b0), np.uint64(min(b0 + 64, c1))
        for j in range(lo, hi):
            residual[j] = grad[j] + residual[j]
        mask = np.uint64(0)
        for j in range(lo, hi):
            keep = abs(residual[j]) > tau
            mask |= np.uint64(keep) << (j - lo)
            top = max(top, bits[j] & np.uint32(0x7FFFFFFF) if keep else np.uint32(0))
        p = HEADER_BYTES + (b0 >> 3)
        for t in range((min(b0 + 64, c1) - b0 + 7) >> 3):
            out[p + t] = (mask >> np.uint64(8 * t)) & np.uint64(0xFF)
    return top


@_jit
def _bf16_values(residual, out, c0, c1, vpos):
    """Values of the kept elements in ``[c0, c1)`` from ``out[vpos]`` on; returns the end."""
    bits = residual.view(np.uint32)
    for b0 in range(c0, c1, 64):
        mask = np.uint64(0)
        for t in range((min(b0 + 64, c1) - b0 + 7) >> 3):
            mask |= np.uint64(out[HEADER_BYTES + (b0 >> 3) + t]) << np.uint64(8 * t)
        while mask:
            j = np.uint64(b0) + _ctz(mask)
            mask &= mask - _ONE
            b = np.uint64(bits[j])
            q = ((b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & _ONE))
                 & np.uint64(0xFFFFFFFF)) >> np.uint64(16)
            out[vpos] = q & np.uint64(0xFF)
            out[vpos + 1] = q >> np.uint64(8)
            vpos += 2
            residual[j] = residual[j] - np.uint32(q << np.uint64(16)).view(np.float32)
    return vpos


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
    a factor of two), so ``residual + decoded`` recovers ``u`` bit for bit."""
    return np.uint32((b & np.uint32(0x80000000)) | np.uint32(biased << 23)).view(np.float32)


@_jit
def _natexp8_values(residual, out, seed, c0, c1, cpos, vpos, top):
    """Codes of the kept elements in ``[c0, c1)`` from ``out[vpos]`` on, chunk exponent at
    ``out[cpos]``, in one visit: the largest kept magnitude ``top = 2**E * 1.m`` makes the chunk
    exponent ``E - 127`` or, if an element rounds up to it, ``E - 126``. Codes are written
    against the latter and lowered by one afterwards if nothing reached it. Returns the count."""
    upper = min(np.int64(top >> np.uint32(23)) - 126, 127)
    bits = residual.view(np.uint32)
    p, hit, far = vpos, False, False
    for b0 in range(c0, c1, 64):
        mask = np.uint64(0)
        for t in range((min(b0 + 64, c1) - b0 + 7) >> 3):
            mask |= np.uint64(out[HEADER_BYTES + (b0 >> 3) + t]) << np.uint64(8 * t)
        while mask:
            j = np.uint64(b0) + _ctz(mask)
            mask &= mask - _ONE
            b = bits[j]
            biased = _rounded_biased(b, seed, j)
            code, off = _natexp8_code(b, biased, upper)
            out[p] = code
            if off < _ZERO_CODE:
                residual[j] = residual[j] - _pow2(b, biased)
            hit |= off == 0
            far |= off >= _ZERO_CODE
            p += 1
    if top < np.uint32(0x800000):  # nothing above zero/subnormal kept
        out[cpos] = 0x80
    elif hit:
        out[cpos] = upper & 0xFF
    else:
        out[cpos] = (upper - 1) & 0xFF
        codes = out[vpos:p]
        for q in range(codes.shape[0]):
            codes[q] -= np.uint8((codes[q] & 127) != _ZERO_CODE)
        if far:
            _rescue_far(residual, out, seed, c0, c1, vpos, upper - 1)
    return p - vpos


@_jit
def _rescue_far(residual, out, seed, c0, c1, p, cmax):
    """Rare: elements 127 binades below ``cmax + 1`` went out as zero but are in range of
    ``cmax``; their residual still holds ``u``, so redo them."""
    bits = residual.view(np.uint32)
    for b0 in range(c0, c1, 64):
        mask = _get_bits(out, HEADER_BYTES + (b0 >> 3), (min(b0 + 64, c1) - b0 + 7) >> 3)
        while mask:
            j = np.uint64(b0) + _ctz(mask)
            mask &= mask - _ONE
            if out[p] & 127 == _ZERO_CODE:
                b = bits[j]
                biased = _rounded_biased(b, seed, j)
                code, off = _natexp8_code(b, biased, cmax)
                if off < _ZERO_CODE:
                    out[p] = code
                    residual[j] = residual[j] - _pow2(b, biased)
            p += 1


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
def _encode(grad, residual, out, scratch, seed, chunk, value_mode):
    n = grad.shape[0]
    tau = _threshold(grad, residual, scratch, seed)
    v0 = HEADER_BYTES + ((n + 7) >> 3)
    nch = (n + chunk - 1) // chunk
    vbase = v0 if value_mode == BF16 else v0 + nch
    vpos = vbase
    for c in range(nch):  # bf16 too: the kept elements are revisited while still in cache
        c0 = c * chunk
        c1 = min(c0 + chunk, n)
        top = _mark(grad, residual, out, tau, c0, c1)
        if value_mode == BF16:
            vpos = _bf16_values(residual, out, c0, c1, vpos)
        else:
            vpos += _natexp8_values(residual, out, seed, c0, c1, v0 + c, vpos, top)
    k = (vpos - vbase) >> 1 if value_mode == BF16 else vpos - vbase
    mode = BITMAP if 32 * k > n else LIST
    if mode == LIST:
        _to_list(out, n, k, v0, vpos - v0)
    _put_u32(out, 0, k)
    out[4], out[5], out[6], out[7] = mode, value_mode, 0, 0
    return vpos if mode == BITMAP else vpos - v0 + HEADER_BYTES + 4 * k


@_jit
def _popcount8(b):
    b = np.int64(b)
    b = b - ((b >> 1) & 0x55)
    b = (b & 0x33) + ((b >> 2) & 0x33)
    return (b + (b >> 4)) & 0x0F


@_jit
def _natexp8_value(code, cmax):
    low = code & 127
    if low == _ZERO_CODE:
        return np.float32(0)
    biased = cmax - low + 127
    bits = (code >> 7) << 31
    if 1 <= biased <= 254:
        bits |= biased << 23
    return np.uint32(bits).view(np.float32)


@_jit
def _decode_add(payload, n, chunk, acc):
    k = _get_u32(payload, 0)
    index_mode, value_mode = payload[4], payload[5]
    nb = (n + 7) >> 3
    v0 = HEADER_BYTES + (nb if index_mode == BITMAP else 4 * k)
    vbase = v0 if value_mode == BF16 else v0 + (n + chunk - 1) // chunk
    w, mask, chunk_end, cmax = -8, np.uint64(0), 0, -128
    for i in range(k):
        if index_mode == LIST:
            j = _get_u32(payload, HEADER_BYTES + 4 * i)
        else:
            while mask == 0:
                w += 8
                mask = _get_bits(payload, HEADER_BYTES + w, min(8, nb - w))
            j = 8 * w + np.int64(_ctz(mask))
            mask &= mask - _ONE
        if value_mode == BF16:
            q = np.int64(payload[vbase + 2 * i]) | (np.int64(payload[vbase + 2 * i + 1]) << 8)
            acc[j] += np.uint32(q << 16).view(np.float32)
        else:
            if j >= chunk_end:
                cmax = _get_i8(payload, v0 + j // chunk)
                chunk_end = (j // chunk + 1) * chunk
            acc[j] += _natexp8_value(np.int64(payload[vbase + i]), cmax)


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


def encode(grad, residual, out, scratch, seed, chunk, value_mode) -> int:
    """Encode ``grad`` plus the error-feedback ``residual`` into ``out[:nbytes]`` and return
    ``nbytes``; ``residual`` becomes what was not sent. Size ``out`` with ``max_payload_bytes``
    and ``scratch`` (float32) with ``sample_size``.

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
                       np.int64(value_mode)))


def decode_add(payload, n, chunk, acc) -> None:
    """``acc[j] += decoded_j`` for every element the payload carries (float32 adds); other
    elements are left alone. ``payload`` (uint8 array or bytes) must have passed ``check``."""
    _key(n, chunk)
    if not isinstance(payload, np.ndarray):
        payload = np.frombuffer(payload, np.uint8)
    _vector("payload", payload, np.uint8, HEADER_BYTES)
    if _vector("acc", acc, np.float32, n, writable=True) != n:
        raise ValueError(f"acc has {acc.shape[0]} elements, expected {n}")
    _decode_add(payload, np.int64(n), np.int64(chunk), acc)


def _payload_bytes(n, chunk, k, index_mode, value_mode):
    index = -(-n // 8) if index_mode == BITMAP else 4 * k
    values = 2 * k if value_mode == BF16 else -(-n // chunk) + k
    return HEADER_BYTES + index + values


def check(payload, n, chunk) -> str | None:
    """None when ``payload`` (an untrusted uint8 array or bytes) is a well-formed payload for a
    key of ``n`` elements and chunk size ``chunk``, else what is wrong with it. The index mode
    must be the one ``encode`` picks for ``k`` (bitmap iff ``32*k > n``)."""
    _key(n, chunk)
    buf = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
    _vector("payload", buf, np.uint8)
    if buf.shape[0] < HEADER_BYTES:
        return f"payload has {buf.shape[0]} bytes, expected at least {HEADER_BYTES} (header)"
    k, index_mode, value_mode, reserved = struct.unpack_from("<IBBH", buf.tobytes()[:8])
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


def encode_reference(grad, residual, seed, chunk, value_mode) -> tuple[bytes, np.ndarray]:
    """The codec spelled out in NumPy: ``(payload, new residual)``; inputs are not modified."""
    u = np.asarray(grad, np.float32) + np.asarray(residual, np.float32)
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
