"""The ``sparse`` codec spelled out in NumPy (``native/sparse.py``'s docstring is the spec): what
the kernels are held to, bit for bit (``tests/test_sparse.py``). Slow and allocating; for tests
and checks only. Import it from ``bitps.native.sparse``.
"""

from __future__ import annotations

import struct

import numpy as np

from bitps.native.sparse_format import (
    BF16,
    BITMAP,
    GOLDEN,
    LIST,
    MIX1,
    MIX2,
    SAMPLE_ALL_BELOW,
    SAMPLE_STRIDE,
    ZERO_CODE,
)

__all__ = ["decode_reference", "encode_reference"]



def _rand_np(seed, i):
    """``rand`` over a uint64 array (array arithmetic wraps without warnings)."""
    z = np.uint64(seed) + (i + np.uint64(1)) * GOLDEN
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


def _natexp8_np(codes, cmax):
    low = codes & 127
    biased = cmax - low + 127
    mag = np.where((biased >= 1) & (biased <= 254), biased << 23, 0)
    bits = np.where(low == ZERO_CODE, 0, ((codes >> 7) << 31) | mag)
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
