"""The ``sparse`` codec's constants and sizes, as ``native/sparse.py``'s docstring specifies
them: what the kernels (``sparse_kernels``), the NumPy reference (``sparse_reference``) and the
entry points (``sparse``) share. Import the public ones from ``bitps.native.sparse``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BF16", "BITMAP", "DEFAULT_CHUNK", "GOLDEN", "HEADER_BYTES", "HIST_BINS", "LIST",
           "MAX_ELEMENTS", "MIX1", "MIX2", "NATEXP8", "SAMPLE_ALL_BELOW", "SAMPLE_STRIDE",
           "ZERO_CODE", "max_payload_bytes", "payload_bytes", "sample_size"]

HEADER_BYTES = 8
SAMPLE_STRIDE = 100
SAMPLE_ALL_BELOW = 4097
BF16 = 0
NATEXP8 = 1
BITMAP = 0
LIST = 1
DEFAULT_CHUNK = 2048
MAX_ELEMENTS = 2**32 - 1
"""Indices are u32."""

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
"""``rand``'s increment; ``MIX1`` and ``MIX2`` are its finalizer's multipliers (splitmix64)."""
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
ZERO_CODE = 127
"""The natexp8 offset that decodes to ``+0.0``."""
HIST_BINS = 2048
"""Histogram bins of the median's radix select, at the end of ``scratch``."""


def max_payload_bytes(n: int, chunk: int, value_mode: int) -> int:
    """Size ``out`` for ``encode``: list mode is only chosen when ``4k <= n/8``."""
    values = 2 * n if value_mode == BF16 else -(-n // chunk) + n
    return HEADER_BYTES + -(-n // 8) + values


def sample_size(n: int) -> int:
    """Length of the float32 ``scratch`` that ``encode`` needs for a key of ``n`` elements: the
    sample, then a histogram for the median."""
    return (n if n < SAMPLE_ALL_BELOW else -(-n // SAMPLE_STRIDE)) + HIST_BINS


def payload_bytes(n, chunk, k, index_mode, value_mode):
    """The length of a payload that keeps ``k`` of ``n`` elements in these modes."""
    index = -(-n // 8) if index_mode == BITMAP else 4 * k
    values = 2 * k if value_mode == BF16 else -(-n // chunk) + k
    return HEADER_BYTES + index + values
