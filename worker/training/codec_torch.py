"""The worker's codecs written in torch ops, for gradients that live on the GPU: ``sign1`` and
``bf16`` produce the same bytes and the same residuals as the CPU kernels, on any device.

On CUDA a worker compresses on a side stream with these functions so that only the packed
payload crosses to the host; on the CPU the numba kernels are faster and these are the
"torch-ops implementation" the codec benchmark compares them against. Nothing here branches on
the device, and nothing synchronizes with it.

Layouts and arithmetic are those of ``native/sign1.py`` (scales, then sign bits; the
fixed-order float64 lane sums that make the scales bit-exact) and ``native/casts.py`` (bf16 by
round-to-nearest-even on the float32 bits, NaNs kept quiet with their sign). Their numpy
references are the spec, and ``tests/test_codec_torch.py`` checks these functions against them
bit for bit. Multi-byte values are written in the host's byte order, like the kernels do: both
assume little-endian (x86, ARM and CUDA all are).

Buffer ownership: the caller owns ``grad``, ``residual``, ``acc`` and ``payload``. The encoders
update ``residual`` in place and return a new uint8 tensor on ``grad``'s device; the decoders
read ``payload`` (a uint8 tensor, possibly a view at any offset of a larger frame) and add into
``acc[:n]``. Temporaries are allocated per call (one float64 copy of the key for ``sign1``).

Example::

    residual = torch.zeros_like(grad)
    payload = sign1_encode(grad, residual)     # uint8, payload_bytes(n) long
    sign1_decode_add(payload, grad.numel(), acc)
"""

from __future__ import annotations

import torch

from bitps.native.sign1 import DEFAULT_CHUNK, LANES, payload_bytes
from bitps.proto.codecs import MEAN_ABS

__all__ = ["ENCODERS", "bf16_decode_add", "bf16_encode", "encode", "sign1_decode_add",
           "sign1_encode"]


def _check_vectors(grad: torch.Tensor, residual: torch.Tensor | None) -> None:
    if grad.dtype != torch.float32 or grad.dim() != 1:
        raise ValueError(f"grad is {grad.dtype}{tuple(grad.shape)}; expected 1-D float32")
    if residual is not None and (residual.dtype != torch.float32
                                 or residual.shape != grad.shape
                                 or residual.device != grad.device):
        raise ValueError(f"residual is {residual.dtype}{tuple(residual.shape)} on "
                         f"{residual.device}; expected float32{tuple(grad.shape)} on "
                         f"{grad.device}")


def _check_decode(payload: torch.Tensor, size: int, n: int, acc: torch.Tensor) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != size:
        raise ValueError(f"payload is {payload.dtype}[{payload.numel()}]; expected uint8 of "
                         f"{size} bytes for n={n}")
    if acc.dtype != torch.float32 or acc.dim() != 1 or acc.numel() < n:
        raise ValueError(f"acc is {acc.dtype}{tuple(acc.shape)}; expected 1-D float32 of >= {n}")


def _check_chunk(chunk: int) -> None:
    if chunk <= 0 or chunk % LANES:
        raise ValueError(f"sign1 chunk is {chunk}; expected a positive multiple of {LANES}")


# -- sign1 ---------------------------------------------------------------------------------------

def sign1_encode(grad: torch.Tensor, residual: torch.Tensor, *, chunk: int = DEFAULT_CHUNK,
                 mean_abs: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Compress ``grad * scale + residual`` (``scale``: the clip factor) to one sign bit per
    element and one float32 scale per chunk (RMS, or mean |u| with ``mean_abs``); stores the new
    residual in ``residual`` and returns the payload, a uint8 tensor of
    ``payload_bytes(n, chunk)`` bytes on ``grad``'s device."""
    _check_chunk(chunk)
    _check_vectors(grad, residual)
    n = grad.numel()
    u = _add_scaled(residual, grad, scale)
    scales = _chunk_scales(u, chunk, mean_abs)
    # padded to whole chunks (so whole bytes too): the padding bits are the zero high bits
    negative = torch.zeros(scales.numel() * chunk, dtype=torch.bool, device=u.device)
    torch.lt(u, 0, out=negative[:n])
    residual.sub_(_signed_scales(negative, scales, chunk)[:n])
    return torch.cat([scales.view(torch.uint8), _pack_bits(negative)[:(n + 7) // 8]])


def sign1_decode_add(payload: torch.Tensor, n: int, acc: torch.Tensor, *,
                     chunk: int = DEFAULT_CHUNK) -> None:
    """``acc[:n] += decode(payload)`` for a uint8 ``payload`` of ``payload_bytes(n, chunk)``
    bytes on ``acc``'s device."""
    _check_chunk(chunk)
    _check_decode(payload, payload_bytes(n, chunk), n, acc)
    nchunks = -(-n // chunk)
    # the clone realigns the scales: a payload sliced from a frame may start at any byte
    scales = payload[:4 * nchunks].clone().view(torch.float32)
    negative = torch.zeros(nchunks * chunk, dtype=torch.bool, device=acc.device)
    bits = _unpack_bits(payload[4 * nchunks:])
    negative[:bits.numel()] = bits
    acc[:n].add_(_signed_scales(negative, scales, chunk)[:n])


def _add_scaled(residual: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``residual += grad * scale`` with two roundings, as the CPU kernels do (``add_`` with
    ``alpha`` may fuse into one on some devices); ``grad`` itself when ``scale`` is 1."""
    return residual.add_(grad if scale == 1.0 else grad * scale)


def _chunk_scales(u: torch.Tensor, chunk: int, mean_abs: bool) -> torch.Tensor:
    """Per-chunk float32 scales, summed in float64 in the spec's fixed order."""
    n = u.numel()
    nchunks = -(-n // chunk)
    # zero padding leaves every lane sum unchanged (x + 0.0 == x for x >= 0)
    padded = torch.empty(nchunks * chunk, dtype=torch.float64, device=u.device)
    padded[n:].zero_()
    padded[:n].copy_(u)
    # exact in float64; mul_ rather than square_, which could go through a pow kernel
    values = padded.abs_() if mean_abs else padded.mul_(padded)
    rows = values.view(nchunks, chunk // LANES, LANES)
    # one elementwise add per row: each lane sums its elements in order on every device, where
    # torch.sum's reduction tree differs between CPU and CUDA and between sizes
    lanes = rows[:, 0].clone()
    for r in range(1, rows.shape[1]):
        lanes.add_(rows[:, r])
    width = LANES
    while width > 1:
        width //= 2
        lanes = lanes[:, :width] + lanes[:, width:2 * width]
    # counts as a tensor: CUDA divides by a Python scalar as a multiply by its reciprocal,
    # which rounds differently from true division
    starts = torch.arange(nchunks, dtype=torch.float64, device=u.device) * chunk
    counts = torch.clamp(n - starts, max=chunk)
    mean = lanes[:, 0] / counts
    return (mean if mean_abs else mean.sqrt()).to(torch.float32)


def _signed_scales(negative: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    """The decoded values of whole chunks: each element's chunk scale, negated where its sign
    bit is set (``negative`` holds ``chunk`` booleans per scale)."""
    s = scales[:, None]
    return torch.where(negative.view(scales.numel(), chunk), -s, s).view(-1)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans (a multiple of 8) to bytes, element j in bit j & 7 of byte j >> 3 (numpy's
    little bit order)."""
    planes = bits.view(torch.uint8).view(-1, 8)  # torch stores a bool as one byte, 0 or 1
    packed = planes[:, 0].clone()
    for k in range(1, 8):
        packed.bitwise_or_(planes[:, k] << k)
    return packed


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_pack_bits``: 8 booleans per byte."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).view(-1).bool()


# -- bf16 ----------------------------------------------------------------------------------------

def bf16_encode(grad: torch.Tensor, residual: torch.Tensor | None, *,
                scale: float = 1.0) -> torch.Tensor:
    """Round ``grad * scale (+ residual)`` to bf16, nearest-even; returns the ``2n`` payload
    bytes (uint8, on ``grad``'s device). With a ``residual``, stores the rounding error there."""
    _check_vectors(grad, residual)
    if residual is None and scale != 1.0:
        raise ValueError(f"scale {scale} needs a residual (error feedback)")
    u = grad if residual is None else _add_scaled(residual, grad, scale)
    q = _bf16_bits(u)
    payload = q.to(torch.int16).view(torch.uint8)
    if residual is not None:
        # q * 2**16 is the float32's bits (q << 16) without overflow, as |q| <= 2**15
        residual.sub_(q.mul_(65536).view(torch.float32))
    return payload


def bf16_decode_add(payload: torch.Tensor, n: int, acc: torch.Tensor) -> None:
    """``acc[:n] += decode(payload)`` for a uint8 ``payload`` of ``2n`` bytes on ``acc``'s
    device."""
    _check_decode(payload, 2 * n, n, acc)
    # each bf16 becomes the high half of a float32, byte by byte: works at any payload offset
    words = torch.zeros(n, 4, dtype=torch.uint8, device=acc.device)
    words[:, 2:] = payload.view(n, 2)
    acc[:n].add_(words.view(torch.float32).view(n))


def _bf16_bits(u: torch.Tensor) -> torch.Tensor:
    """The bf16 bits of float32 ``u`` by the integer formula of ``native/casts.py``, as int32
    holding the signed 16-bit value (the arithmetic shift sign-extends; the low 16 bits are
    those of the uint32 formula).

    Not ``u.to(torch.bfloat16)``: torch turns every NaN into one fixed pattern (dropping the
    sign), and hardware conversions (AVX512-BF16, CUDA's cvt) are not all specified to round
    subnormal inputs alike; integer ops give the same bits on every device by construction."""
    b = u.view(torch.int32)
    high = b >> 16
    # only positive NaNs could overflow int32 when rounded; clamp them, they are replaced below
    q = b.clamp(max=0x7F800000)
    q.add_(high & 1).add_(0x7FFF).bitwise_right_shift_(16)
    return torch.where(torch.isnan(u), high.bitwise_or_(0x40), q, out=q)


# -- by codec -------------------------------------------------------------------------------------

ENCODERS = {
    "sign1": lambda grad, residual, codec, scale: sign1_encode(
        grad, residual, chunk=codec.chunk, mean_abs=bool(codec.flags & MEAN_ABS), scale=scale),
    "bf16": lambda grad, residual, codec, scale: bf16_encode(grad, residual, scale=scale),
}
"""The codecs with a device encoder, by registered name (``bitps.proto.codecs``): ``(grad,
residual, codec, scale) -> payload``."""


def encode(grad: torch.Tensor, residual: torch.Tensor, codec, scale: float = 1.0) -> torch.Tensor:
    """The payload of ``grad * scale + residual`` in ``codec`` (a ``bitps.proto.codecs.Codec``
    named in :data:`ENCODERS`), with error feedback into ``residual``."""
    encoder = ENCODERS.get(codec.name)
    if encoder is None:
        raise ValueError(f"codec {codec.name!r} has no device encoder; expected one of "
                         f"{sorted(ENCODERS)}")
    return encoder(grad, residual, codec, scale)
