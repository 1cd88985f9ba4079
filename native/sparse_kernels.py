"""The ``sparse`` codec's numba kernels (the format: ``native/sparse.py``'s docstring). Called
through ``bitps.native.sparse``'s entry points, which check the arguments these trust; with
``NUMBA_DISABLE_JIT=1`` they run as plain Python (``_ctz`` and ``_rand`` have Python twins).

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

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

from bitps.native.sparse_format import (
    BF16,
    BITMAP,
    GOLDEN,
    HEADER_BYTES,
    HIST_BINS,
    LIST,
    MIX1,
    MIX2,
    NATEXP8,
    SAMPLE_ALL_BELOW,
    SAMPLE_STRIDE,
    ZERO_CODE,
)

__all__ = ["bitmap_popcount", "decode_add", "encode", "first_bad_index"]

_ONE = np.uint64(1)

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
        z = (int(seed) + (int(i) + 1) * int(GOLDEN)) & m
        z = ((z ^ (z >> 30)) * int(MIX1)) & m
        z = ((z ^ (z >> 27)) * int(MIX2)) & m
        return np.uint64(z ^ (z >> 31))
else:
    _ctz = _llvm_cttz

    @_jit
    def _rand(seed, i):
        """``rand(seed, i)`` for a u64 ``i``. Every operand is a u64: numba has typed int64 mixed
        with uint64 as float64 (NumPy 1 rules) or as int64, depending on its version."""
        z = seed + (i + _ONE) * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * MIX1
        z = (z ^ (z >> np.uint64(27))) * MIX2
        return z ^ (z >> np.uint64(31))


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
                           scratch[m:m + HIST_BINS].view(np.uint32))
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
    off = cmax + 127 - biased if biased != 0 else ZERO_CODE
    return (np.int64(b >> np.uint32(31)) << 7) | min(off, ZERO_CODE), off


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
            if off < ZERO_CODE:
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
        worst = max(worst, low if low != ZERO_CODE else 0)
    if worst + delta < ZERO_CODE:
        for q in range(codes.shape[0]):
            codes[q] += np.uint8(delta if codes[q] & 127 != ZERO_CODE else 0)
        return
    nb = (residual.shape[0] + 7) >> 3
    q, w = 0, c0
    while q < codes.shape[0]:
        mask = _get_bits(out, HEADER_BYTES + (w >> 3), min(8, nb - (w >> 3)))
        while mask and q < codes.shape[0]:
            j = np.uint64(w) + _ctz(mask)
            mask &= mask - _ONE
            low = np.int64(codes[q] & 127)
            if low != ZERO_CODE and low + delta >= ZERO_CODE:
                sign = np.int64(codes[q] >> 7) << 31  # not residual's: u - d may differ in sign
                d = np.uint32(sign | ((cmax - low + 127) << 23)).view(np.float32)
                residual[j] = residual[j] + d
                codes[q] |= np.uint8(ZERO_CODE)
            elif low != ZERO_CODE:
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
def encode(grad, residual, out, scratch, seed, chunk, value_mode, gscale):
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
def decode_add(payload, n, chunk, acc):
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
    if low == ZERO_CODE:
        return np.float32(0)
    biased = cmax - low + 127
    bits = (code >> 7) << 31
    if 1 <= biased <= 254:
        bits |= biased << 23
    return np.uint32(bits).view(np.float32)


@_jit
def first_bad_index(payload, k, n):
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
def bitmap_popcount(payload, nb):
    """Bits set in the ``nb`` bitmap bytes after the header."""
    total = 0
    for p in range(HEADER_BYTES, HEADER_BYTES + nb):
        total += _popcount8(payload[p])
    return total
