"""The ``bf16`` and ``fp16`` codecs: float32 values rounded to 16 bits, nearest-even, with optional
error feedback.

Payload of a key of ``n`` elements: ``n`` little-endian 16-bit values, ``2n`` bytes.

- bf16 keeps float32's exponent and the top 7 mantissa bits. Rounding on the float32 bits ``b``:
  ``q = (b + 0x7FFF + ((b >> 16) & 1)) >> 16`` (ties to even; overflow rounds to +-Inf as IEEE
  does); a NaN stays a quiet NaN of the same sign (the formula alone could carry it into the
  sign bit). Decoding is exact: ``bits = q << 16``.
- fp16 is IEEE binary16 through numpy's cast (also nearest-even; out-of-range values become
  +-Inf, which the receiver rejects as non-finite). numba has no float16 on the CPU, so fp16 runs
  in numpy.

With error feedback (``residual`` updated in place): ``u = grad * scale + residual`` (``scale``
is the clip factor, 1 by default), the payload encodes ``u``, and ``residual = u -
decode(payload)``. :func:`raw_encode` is the same wrapper around raw float32 values: nothing is
lost, so the residual only carries what clipping under overlap folds into it afterwards.

Buffer ownership: the caller owns every array; nothing here allocates (fp16 through numpy
allocates its temporaries). ``grad`` and payloads may be read-only views of received frames.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.extending import intrinsic

__all__ = ["bf16_decode_add", "bf16_encode", "bf16_reference", "fp16_decode_add",
           "fp16_encode", "raw_encode"]

_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False, error_model="numpy")


def _check(grad: np.ndarray, residual: np.ndarray | None, out: np.ndarray) -> None:
    n = grad.shape[0]
    if grad.dtype != np.float32 or (residual is not None and (residual.dtype != np.float32
                                                              or residual.shape != grad.shape)):
        raise ValueError(f"grad {grad.dtype}{grad.shape} and residual must be float32 of one "
                         f"length")
    if out.dtype != np.uint16 or out.shape[0] < n:
        raise ValueError(f"out is {out.dtype}[{out.shape[0]}]; expected uint16 of >= {n}")


def bf16_encode(grad: np.ndarray, residual: np.ndarray | None, out: np.ndarray, *,
                scale: float = 1.0) -> int:
    """Round ``grad * scale (+ residual)`` to bf16 into ``out`` (uint16); with a
    ``residual``, store the rounding error there. Returns the payload size in bytes (``2n``)."""
    _check(grad, residual, out)
    n = grad.shape[0]
    if residual is None:
        if scale != 1.0:
            raise ValueError(f"scale {scale} needs a residual (error feedback)")
        _bf16_cast(grad, out[:n])
    else:
        _bf16_encode_ef(grad, residual, out[:n], np.float32(scale))
    return 2 * n


def bf16_decode_add(payload, n: int, acc: np.ndarray) -> None:
    """``acc[:n] += decode(payload)`` for a payload of exactly ``2n`` bytes."""
    _bf16_decode_add(np.frombuffer(payload, np.uint16, count=n), acc[:n])


if numba.config.DISABLE_JIT:
    def _f32(bits):
        """Pure-Python twin for ``NUMBA_DISABLE_JIT=1``."""
        return np.array(int(bits) & 0xFFFFFFFF, np.uint32).view(np.float32)[()]
else:
    @intrinsic
    def _f32(typingctx, bits):
        """The float32 whose bit pattern is the low 32 bits of the integer ``bits`` (a register
        bitcast; numba widens shifted uint32 values to 64 bits)."""
        def codegen(context, builder, signature, args):
            value = args[0]
            if value.type.width != 32:
                value = builder.trunc(value, ir.IntType(32))
            return builder.bitcast(value, ir.FloatType())

        return numba.types.float32(bits), codegen


@_jit
def _bf16_bits(b):
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint32(16))


@_jit
def _bf16_cast(x, out):
    bits = x.view(np.uint32)
    for j in range(x.shape[0]):
        out[j] = _bf16_bits(bits[j])


@_jit
def _bf16_encode_ef(grad, residual, out, gscale):
    # residual holds u first, read back as bits through a uint32 view
    for j in range(grad.shape[0]):
        residual[j] = grad[j] * gscale + residual[j]
    ubits = residual.view(np.uint32)
    for j in range(grad.shape[0]):
        q = _bf16_bits(ubits[j])
        out[j] = q
        residual[j] = residual[j] - _f32(np.uint32(q) << np.uint32(16))


@_jit
def _bf16_decode_add(q, acc):
    for j in range(q.shape[0]):
        acc[j] = acc[j] + _f32(np.uint32(q[j]) << np.uint32(16))


def fp16_encode(grad: np.ndarray, residual: np.ndarray | None, out: np.ndarray, *,
                scale: float = 1.0) -> int:
    """Round ``grad * scale (+ residual)`` to IEEE half into ``out`` (uint16); with a
    ``residual``, store the rounding error there. Returns ``2n``."""
    _check(grad, residual, out)
    n = grad.shape[0]
    if scale != 1.0:
        if residual is None:
            raise ValueError(f"scale {scale} needs a residual (error feedback)")
        grad = grad * np.float32(scale)
    u = grad if residual is None else np.add(grad, residual, out=residual)
    half = out[:n].view(np.float16)
    np.copyto(half, u, casting="same_kind")
    if residual is not None:
        np.subtract(u, half, out=residual, casting="same_kind")
    return 2 * n


def fp16_decode_add(payload, n: int, acc: np.ndarray) -> None:
    """``acc[:n] += decode(payload)`` for a payload of exactly ``2n`` bytes."""
    np.add(acc[:n], np.frombuffer(payload, np.float16, count=n), out=acc[:n],
           casting="same_kind")


def bf16_reference(u: np.ndarray) -> np.ndarray:
    """The bf16 bits (uint16) of float32 ``u``, in plain numpy (the spec check)."""
    b = u.astype(np.float32).view(np.uint32).astype(np.uint64)
    q = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    q[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint32)
    return (q & 0xFFFF).astype(np.uint16)


def raw_encode(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, *,
               scale: float = 1.0) -> int:
    """Raw float32 values with error feedback: ``out = grad * scale + residual``, then
    ``residual = 0`` (a raw payload carries everything). Returns ``4n``."""
    n = grad.shape[0]
    if grad.dtype != np.float32 or residual.dtype != np.float32 or residual.shape != grad.shape:
        raise ValueError(f"grad {grad.dtype}{grad.shape} and residual must be float32 of one "
                         f"length")
    if out.dtype != np.float32 or out.shape[0] < n:
        raise ValueError(f"out is {out.dtype}[{out.shape[0]}]; expected float32 of >= {n}")
    _raw_encode_ef(grad, residual, out[:n], np.float32(scale))
    return 4 * n


@_jit
def _raw_encode_ef(grad, residual, out, gscale):
    for j in range(grad.shape[0]):
        out[j] = grad[j] * gscale + residual[j]
        residual[j] = 0.0
