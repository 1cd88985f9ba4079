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

The code is in four modules: this one (the entry points, which check their arguments),
``sparse_format`` (the constants and sizes above), ``sparse_kernels`` (the numba kernels) and
``sparse_reference`` (the NumPy reference); every public name is importable from here.
"""

from __future__ import annotations

import struct

import numpy as np

from bitps.native import sparse_kernels as _k
from bitps.native.sparse_format import (
    BF16,
    BITMAP,
    DEFAULT_CHUNK,
    HEADER_BYTES,
    LIST,
    MAX_ELEMENTS,
    NATEXP8,
    SAMPLE_ALL_BELOW,
    SAMPLE_STRIDE,
    max_payload_bytes,
    payload_bytes,
    sample_size,
)
from bitps.native.sparse_reference import decode_reference, encode_reference

__all__ = ["BF16", "BITMAP", "DEFAULT_CHUNK", "HEADER_BYTES", "LIST", "MAX_ELEMENTS", "NATEXP8",
           "SAMPLE_ALL_BELOW", "SAMPLE_STRIDE", "check", "decode_add", "decode_reference", "encode",
           "encode_reference", "max_payload_bytes", "sample_size", "size_of"]


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
    return int(_k.encode(grad, residual, out, scratch, np.uint64(seed), np.int64(chunk),
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
    _k.decode_add(payload, np.int64(n), np.int64(chunk), acc[:n])


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
    return payload_bytes(n, chunk, k, index_mode, value_mode)


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
    size = payload_bytes(n, chunk, k, index_mode, value_mode)
    if buf.shape[0] != size:
        return (f"payload has {buf.shape[0]} bytes, expected {size} for k={k}, "
                f"index_mode={index_mode}, value_mode={value_mode}, n={n}, chunk={chunk}")
    if index_mode == LIST:
        i, j, prev = _k.first_bad_index(buf, np.int64(k), np.int64(n))
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
    ones = int(_k.bitmap_popcount(buf, np.int64(nb)))
    if ones != k:
        return f"bitmap has {ones} bits set, expected k={k}"
    return None
