"""worker.training.codec_torch against the numpy references of native/sign1.py and native/casts.py,
bit for bit: payload bytes, residuals after several error-feedback steps, and decode_add; on CUDA
too when there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitps.native.casts import bf16_reference
from bitps.native.sign1 import decode_reference, encode_reference
from bitps.worker.training.codec_torch import (
    bf16_decode_add,
    bf16_encode,
    sign1_decode_add,
    sign1_encode,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
SIZES = [0, 1, 63, 64, 100, 2048, 2049, 5000, 100003]


def _grads(rng: np.random.Generator, n: int, steps: int) -> list[np.ndarray]:
    """Fresh gradients per step, magnitudes spread over six decades, some exact zeros and -0.0."""
    out = []
    for _ in range(steps):
        g = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 4))
        g[rng.random(n) < 0.01] = 0.0
        g[rng.random(n) < 0.01] = -0.0
        out.append(g)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def _same_bits(t: torch.Tensor, a: np.ndarray) -> bool:
    return np.array_equal(t.cpu().numpy().view(np.uint32), a.view(np.uint32))


def _same_bits_any_nan(t: torch.Tensor, a: np.ndarray) -> bool:
    """Bit for bit, except that a NaN result may be any NaN: arithmetic on a NaN gives the
    canonical NaN (0x7fffffff) on CUDA, where x86 keeps the operand's sign and payload (seen
    on an H200: the 93 NaN sums of the bf16 decode-add test, and nothing else, differed)."""
    got = t.cpu().numpy()
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(got)) and np.array_equal(
        got[~nan].view(np.uint32), a[~nan].view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mean_abs", [False, True])
@pytest.mark.parametrize("chunk", [64, 2048])
@pytest.mark.parametrize("n", SIZES)
def test_sign1_matches_reference_over_ef_steps(device, n, chunk, mean_abs):
    rng = np.random.default_rng(n * 7 + chunk + mean_abs)
    ref_residual = np.zeros(n, np.float32)
    residual = torch.zeros(n, device=device)
    for g in _grads(rng, n, steps=3):
        ref_payload, ref_residual = encode_reference(g, ref_residual, chunk=chunk,
                                                     mean_abs=mean_abs)
        payload = sign1_encode(torch.from_numpy(g).to(device), residual, chunk=chunk,
                               mean_abs=mean_abs)
        assert payload.dtype == torch.uint8 and payload.device.type == device
        assert _bytes(payload) == ref_payload
        assert _same_bits(residual, ref_residual)

        acc0 = rng.standard_normal(n + 3).astype(np.float32)
        acc = torch.from_numpy(acc0.copy()).to(device)  # from_numpy shares memory
        sign1_decode_add(payload, n, acc, chunk=chunk)
        expected = acc0.copy()
        expected[:n] += decode_reference(ref_payload, n, chunk=chunk)
        assert _same_bits(acc, expected)


def _order_sensitive_chunks(rng: np.random.Generator, nchunks: int) -> np.ndarray:
    """Chunks of 256 whose mean |u| sits on a float32 rounding tie plus float64 crumbs that survive
    or vanish depending on the order of the sum: they catch any deviation from the lane order."""
    z = np.zeros((nchunks, 256), np.float32)
    z[:, :128] = 2.0
    z[np.arange(nchunks), rng.integers(0, 128, nchunks)] = 2 * (1 + 2.0 ** -17)
    for row in z:
        crumbs = 128 + rng.choice(128, rng.integers(1, 20), replace=False)
        row[crumbs] = 2.0 ** rng.integers(-49, -44)
    return z.reshape(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mean_abs", [False, True])
def test_sign1_scales_follow_the_lane_order(device, mean_abs):
    g = _order_sensitive_chunks(np.random.default_rng(4), 200)
    ref_payload, ref_residual = encode_reference(g, np.zeros_like(g), chunk=256, mean_abs=mean_abs)
    residual = torch.zeros(g.size, device=device)
    payload = sign1_encode(torch.from_numpy(g).to(device), residual, chunk=256, mean_abs=mean_abs)
    assert _bytes(payload) == ref_payload
    assert _same_bits(residual, ref_residual)
    if mean_abs:  # the data has teeth: another summation order (numpy's pairwise) differs
        plain = (g.reshape(200, 256).astype(np.float64).sum(axis=1) / 256).astype(np.float32)
        assert np.sum(plain != np.frombuffer(ref_payload, np.float32, count=200)) > 10


@pytest.mark.parametrize("device", DEVICES)
def test_sign1_decode_reads_payload_at_an_odd_offset(device):
    n, chunk = 300, 64
    g = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    ref_payload, _ = encode_reference(g, np.zeros(n, np.float32), chunk=chunk)
    frame = torch.tensor(list(b"x" + ref_payload), dtype=torch.uint8, device=device)
    acc = torch.zeros(n, device=device)
    sign1_decode_add(frame[1:], n, acc, chunk=chunk)
    assert _same_bits(acc, decode_reference(ref_payload, n, chunk=chunk))


def test_sign1_rejects_bad_arguments():
    g = torch.zeros(100)
    with pytest.raises(ValueError, match="chunk is 100"):
        sign1_encode(g, torch.zeros(100), chunk=100)
    with pytest.raises(ValueError, match="residual is"):
        sign1_encode(g, torch.zeros(99))
    with pytest.raises(ValueError, match="expected uint8 of 17 bytes"):
        sign1_decode_add(torch.zeros(16, dtype=torch.uint8), 100, g)


BF16_SPECIALS = np.array([
    0x7F7FFFFF, 0xFF7FFFFF,  # +-max finite: round up to +-inf
    0x7F7F7FFF, 0x7F7F8000,  # just below / exactly at the tie to inf
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00001, 0x7FFFFFFF, 0xFFFFFFFF,  # quiet NaNs, both signs, full payloads
    0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F80FFFF,  # signaling NaNs
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF,  # subnormals, incl. ties
    0x00000000, 0x80000000,  # +-0
    0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x3F807FFF, 0x3F808001,  # ties and near
    0x3F800000, 0x3FFFFFFF,  # exact, carry into the exponent
], dtype=np.uint32)


def _bf16_inputs(rng: np.random.Generator) -> np.ndarray:
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([BF16_SPECIALS, random_bits]).view(np.float32)


def _bf16_values(q: np.ndarray) -> np.ndarray:
    return (q.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_matches_reference_without_ef(device):
    u = _bf16_inputs(np.random.default_rng(2))
    payload = bf16_encode(torch.from_numpy(u).to(device), None)
    assert payload.dtype == torch.uint8 and payload.numel() == 2 * u.size
    assert _bytes(payload) == bf16_reference(u).astype("<u2").tobytes()

    acc0 = np.random.default_rng(3).standard_normal(u.size + 1).astype(np.float32)
    acc = torch.from_numpy(acc0.copy()).to(device)  # from_numpy shares memory
    bf16_decode_add(payload, u.size, acc)
    expected = acc0.copy()
    expected[:u.size] += _bf16_values(bf16_reference(u))
    assert _same_bits_any_nan(acc, expected)  # the encode above is bit for bit, NaNs too


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 1000, 100003])
def test_bf16_ef_matches_reference_over_steps(device, n):
    rng = np.random.default_rng(n + 5)
    ref_residual = np.zeros(n, np.float32)
    residual = torch.zeros(n, device=device)
    for g in _grads(rng, n, steps=3):
        u = g + ref_residual
        q = bf16_reference(u)
        ref_residual = u - _bf16_values(q)
        payload = bf16_encode(torch.from_numpy(g).to(device), residual)
        assert _bytes(payload) == q.astype("<u2").tobytes()
        assert _same_bits(residual, ref_residual)


def test_bf16_rejects_bad_arguments():
    with pytest.raises(ValueError, match="grad is torch.float64"):
        bf16_encode(torch.zeros(4, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="expected uint8 of 8 bytes"):
        bf16_decode_add(torch.zeros(7, dtype=torch.uint8), 4, torch.zeros(4))
