"""Tests for the ``sparse`` codec (native.sparse): the numba kernels against the NumPy reference,
bit for bit over error-feedback steps, in bitmap and list mode, both value modes; hand-worked
payloads that pin the reference to the spec; ``check`` on damaged payloads; edge values; and the
pure-Python path (``NUMBA_DISABLE_JIT=1``)."""

from __future__ import annotations

import struct
import textwrap

import numpy as np
import pytest

from bitps.native import sparse as sp

MODES = [sp.BF16, sp.NATEXP8]
STEPS = 3


def gaussian(n: int, seed: int) -> np.ndarray:
    """About 18% of the elements exceed twice the median: bitmap mode."""
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def spiky(n: int, seed: int) -> np.ndarray:
    """A flat bulk (|x| in [1, 1.5) * 1e-3 with the same signs every step, so that after error
    feedback too it never exceeds twice its median) and 0.3% spikes: list mode."""
    rng = np.random.default_rng(seed)
    signs = np.random.default_rng(0).choice([-1.0, 1.0], n)
    x = rng.uniform(1e-3, 1.5e-3, n) * signs
    spikes = rng.choice(n, max(1, n // 300), replace=False)
    x[spikes] = rng.standard_normal(spikes.size) * 5
    return x.astype(np.float32)


def wide(n: int, seed: int) -> np.ndarray:
    """Random finite bit patterns below 2**127: every binade, subnormals and zeros, so natexp8
    chunks span more than 127 binades (codes pushed to zero when a larger exponent turns up)."""
    bits = np.random.default_rng(seed).integers(0, 0x7F000000, n, dtype=np.uint32)
    bits[::7] = 0
    bits[1::2] |= np.uint32(0x80000000)
    return bits.view(np.float32)


def kernel_steps(grads, seed0: int, chunk: int, mode: int):
    n = grads[0].shape[0]
    residual = np.zeros(n, np.float32)
    out = np.full(sp.max_payload_bytes(n, chunk, mode), 0xAB, np.uint8)
    scratch = np.full(sp.sample_size(n), np.nan, np.float32)
    payloads, residuals = [], []
    for step, g in enumerate(grads):
        nbytes = sp.encode(g, residual, out, scratch, seed0 + step, chunk, mode)
        payloads.append(bytes(out[:nbytes]))
        residuals.append(residual.copy())
    return payloads, residuals


def reference_steps(grads, seed0: int, chunk: int, mode: int):
    residual = np.zeros(grads[0].shape[0], np.float32)
    payloads, residuals = [], []
    for step, g in enumerate(grads):
        payload, residual = sp.encode_reference(g, residual, seed0 + step, chunk, mode)
        payloads.append(payload)
        residuals.append(residual)
    return payloads, residuals


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


CASES = [  # (data, n, chunk, index mode of the first payload)
    (gaussian, 1001, 2048, 0),
    (gaussian, 4096, 192, 0),  # largest key sampled in full
    (gaussian, 4097, 2048, 0),  # smallest key with a strided sample
    (gaussian, 20_011, 2048, 0),
    (gaussian, 20_011, 64, 0),
    (spiky, 1003, 128, 1),
    (spiky, 30_001, 2048, 1),
    (wide, 5_003, 64, 0),
    (wide, 777, 2048, 0),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data,n,chunk,first_index_mode", CASES)
def test_kernel_matches_reference_over_ef_steps(data, n, chunk, first_index_mode, mode):
    grads = [data(n, 10 * n + s) for s in range(STEPS)]
    got_p, got_r = kernel_steps(grads, 1000 + n, chunk, mode)
    ref_p, ref_r = reference_steps(grads, 1000 + n, chunk, mode)
    assert got_p[0][4] == first_index_mode
    if data is spiky:
        assert all(p[4] == 1 for p in got_p)
    for step in range(STEPS):
        assert got_p[step] == ref_p[step], f"payload differs at step {step}"
        assert same_bits(got_r[step], ref_r[step]), f"residual differs at step {step}"
        assert sp.check(got_p[step], n, chunk) is None
        assert len(got_p[step]) <= sp.max_payload_bytes(n, chunk, mode)


@pytest.mark.parametrize("mode", MODES)
def test_tiny_keys(mode):
    """Keys of 0 to 70 elements: partial bitmap bytes and blocks, one-element samples."""
    for n in range(71):
        grads = [wide(n, s) * np.float32(2.0**-60) for s in range(2)]
        got_p, got_r = kernel_steps(grads, n, 64, mode)
        ref_p, ref_r = reference_steps(grads, n, 64, mode)
        assert got_p == ref_p and all(same_bits(a, b) for a, b in zip(got_r, ref_r)), n
        for payload in got_p:
            assert sp.check(payload, n, 64) is None
            acc = np.zeros(n, np.float32)
            sp.decode_add(payload, n, 64, acc)
            assert same_bits(acc, sp.decode_reference(payload, n, 64) + np.float32(0))


@pytest.mark.parametrize("mode", MODES)
def test_read_only_grad_and_unaligned_out(mode):
    """Gradients arrive as read-only frame views; ``out`` may start at any byte."""
    n, chunk = 5000, 128
    g = gaussian(n, 3)
    ref, ref_res = sp.encode_reference(g, np.zeros(n, np.float32), 9, chunk, mode)
    ro = np.frombuffer(g.tobytes(), np.float32)
    assert not ro.flags.writeable
    residual = np.zeros(n, np.float32)
    big = np.zeros(sp.max_payload_bytes(n, chunk, mode) + 3, np.uint8)
    out = big[3:]
    nbytes = sp.encode(ro, residual, out, np.empty(sp.sample_size(n), np.float32), 9, chunk, mode)
    assert bytes(out[:nbytes]) == ref and same_bits(residual, ref_res)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data,n,chunk", [(gaussian, 20_011, 2048), (spiky, 30_001, 192),
                                          (wide, 5_003, 64)])
def test_decode_add_and_error_feedback_identity(data, n, chunk, mode):
    grads = [data(n, s) for s in range(STEPS)]
    payloads, residuals = kernel_steps(grads, 7, chunk, mode)
    previous = np.zeros(n, np.float32)
    for g, payload, residual in zip(grads, payloads, residuals):
        dense = sp.decode_reference(payload, n, chunk)
        u = g + previous
        sent = dense != 0
        # residual = u - decoded where something was sent, u elsewhere, by construction
        assert same_bits(residual[sent], u[sent] - dense[sent])
        assert same_bits(residual[~sent], u[~sent])
        acc = gaussian(n, 99)
        expected = acc + dense
        # a payload at an odd offset, as it sits inside a received frame
        frame = np.frombuffer(b"xyz" + payload, np.uint8)[3:]
        sp.decode_add(frame, n, chunk, acc)
        assert same_bits(acc, expected)
        previous = residual


def test_decode_add_leaves_unsent_elements_alone():
    """Only the elements sent change (-0.0 stays -0.0), also in a longer accumulator."""
    n = 300
    g = np.zeros(n, np.float32)
    g[[5, 250]] = [3.0, -1.5]
    payload, _ = sp.encode_reference(g, np.zeros(n, np.float32), 1, 64, sp.BF16)
    acc = np.full(n + 20, -0.0, np.float32)
    sp.decode_add(payload, n, 64, acc)
    expected = np.full(n + 20, -0.0, np.float32)
    expected[[5, 250]] = [3.0, -1.5]
    assert same_bits(acc, expected)


# Hand-worked payloads: n = 10, u = grad, median of |u| is 0 so tau = 0 and every non-zero
# element is kept; k = 5 and 32*5 > 10 picks the bitmap (bits 1, 2, 3, 4, 9).
HAND_U = np.array([0, 1, -2, 4, 0.5, 0, 0, 0, 0, 16], np.float32)
HAND_HEADER_BITMAP = "05000000" + "00"
HAND_BITMAP = "1e02"


def test_hand_worked_bf16_payload():
    payload, residual = sp.encode_reference(HAND_U, np.zeros(10, np.float32), 5, 64, sp.BF16)
    assert payload.hex() == HAND_HEADER_BITMAP + "00" + "0000" + HAND_BITMAP \
        + "803f" + "00c0" + "8040" + "003f" + "8041"
    assert not residual.any()


def test_hand_worked_natexp8_payload():
    # powers of two never round up (mantissa 0): e = 0, 1, 2, -1, 4, chunk_max = 4,
    # offsets 4, 3, 2, 5, 0 and the sign of -2 in bit 7
    payload, residual = sp.encode_reference(HAND_U, np.zeros(10, np.float32), 5, 64, sp.NATEXP8)
    assert payload.hex() == HAND_HEADER_BITMAP + "01" + "0000" + HAND_BITMAP + "04" \
        + "04" + "83" + "02" + "05" + "00"
    assert not residual.any()


def test_hand_worked_list_payload():
    g = np.zeros(64, np.float32)
    g[40] = 3.0  # k = 1, 32 <= 64: list mode with index 40 = 0x28
    payload, _ = sp.encode_reference(g, np.zeros(64, np.float32), 5, 64, sp.BF16)
    assert payload.hex() == "01000000" + "01" + "00" + "0000" + "28000000" + "4040"


def test_bf16_rounds_to_nearest_even():
    u = np.array([0, 0, 0, 0, 0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -(1 + 2**-8 + 2**-20)],
                 np.float32)
    got_p, got_r = kernel_steps([u], 1, 64, sp.BF16)
    dense = sp.decode_reference(got_p[0], u.size, 64)
    # ties to even (down, then up), below half (down), above half (up)
    assert dense[5:].tolist() == [1.0, 1 + 4 * 2**-8, 1.0, -(1 + 2**-7)]
    assert same_bits(got_r[0], u - dense)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_natexp8_far_exponents_in_one_chunk(seed):
    """Largest exponent last, so earlier codes are shifted, and pushed out of range (offset >=
    127: sent as zero, residual keeps u) or just kept (offset 126)."""
    small = [2.0**-126, -(2.0**-125), 1.5 * 2.0**-124, 2.0**-100, 1e-45, 0.75, 1.0, 3.0]
    u = np.array([0.0] * 20 + small + [2.0, 2.0**1 * 1.999, 2.0**100, 2.0**126], np.float32)
    got_p, got_r = kernel_steps([u], seed, 64, sp.NATEXP8)
    ref_p, ref_r = reference_steps([u], seed, 64, sp.NATEXP8)
    assert got_p == ref_p and same_bits(got_r[0], ref_r[0])
    dense = sp.decode_reference(got_p[0], u.size, 64)
    out_of_range = (u != 0) & (np.abs(u) < 2.0**-1)
    assert not dense[out_of_range].any() and same_bits(got_r[0][out_of_range], u[out_of_range])
    assert dense[u == 1.0] == 1.0  # offset 126 from 2**126


def test_all_zero_gradient_sends_nothing():
    n, chunk = 5000, 2048
    for mode in MODES:
        payloads, residuals = kernel_steps([np.zeros(n, np.float32)] * 2, 1, chunk, mode)
        assert payloads[0][:8] == struct.pack("<IBBH", 0, 1, mode, 0)
        chunk_bytes = b"\x80" * 3 if mode == sp.NATEXP8 else b""
        assert payloads[0][8:] == chunk_bytes and sp.check(payloads[0], n, chunk) is None
        assert not residuals[-1].any()
    assert sp.encode_reference(np.zeros(0, np.float32), np.zeros(0, np.float32), 1, 64, 0)[0] \
        == struct.pack("<IBBH", 0, 1, 0, 0)


@pytest.mark.parametrize("mode", MODES)
def test_finite_input_never_yields_nan(mode):
    """Extreme but finite values for several steps: payload values and residuals stay finite.
    (bf16 rounds anything from 0x7F7F8000 = 3.39e38 up to inf, as round-to-nearest-even does.)"""
    rng = np.random.default_rng(4)
    top = 5e37  # four steps of error feedback stay below float32's 3.4e38
    pool = np.array([top, -top, 1e-45, -1e-38, 1e-30, 7.0, 0.0, -0.0], np.float32)
    grads = [rng.choice(pool, 3000) * rng.uniform(0.5, 1, 3000).astype(np.float32)
             for _ in range(4)]
    payloads, residuals = kernel_steps(grads, 1, 64, mode)
    for payload, residual in zip(payloads, residuals):
        assert np.isfinite(sp.decode_reference(payload, 3000, 64)).all()
        assert np.isfinite(residual).all()


def test_natexp8_is_unbiased():
    """Each kept value goes out as 2**e or 2**(e+1) with E[decoded] = u: averaged over 3000
    seeds every element is within 5% (over 5 standard deviations of the mean)."""
    n = 192  # two thirds zeros: median 0, tau 0, every non-zero element kept
    u = np.zeros(n, np.float32)
    u[::3] = np.random.default_rng(5).uniform(-8, 8, n // 3)
    out = np.empty(sp.max_payload_bytes(n, 64, sp.NATEXP8), np.uint8)
    scratch = np.empty(sp.sample_size(n), np.float32)
    total = np.zeros(n, np.float64)
    low, high = np.full(n, np.inf), np.zeros(n)
    for seed in range(3000):
        residual = np.zeros(n, np.float32)
        sp.encode(u, residual, out, scratch, seed, 64, sp.NATEXP8)
        decoded = np.abs(u - residual)  # exact: u - (u - decoded)
        total += u - residual
        low, high = np.minimum(low, decoded), np.maximum(high, decoded)
    assert np.all(np.abs(total / 3000 - u) <= 0.05 * np.abs(u))
    kept = u != 0
    assert np.array_equal(high[kept], 2 * low[kept])
    assert np.array_equal(low[kept], 2.0 ** np.floor(np.log2(np.abs(u[kept]))))


def test_sample_offset_comes_from_the_seed():
    """Beyond 4096 elements only every 100th is sampled, from an offset set by the seed: a
    gradient whose large values sit at one residue mod 100 gets a different threshold."""
    n = 10_000
    g = np.full(n, 0.01, np.float32)
    g[np.arange(n) % 100 < 60] = 1.0  # sample median 1.0 for offsets < 60, else 0.01
    ks = {struct.unpack_from("<I", kernel_steps([g], s, 2048, sp.BF16)[0][0])[0]
          for s in range(20)}
    assert ks == {0, 6000}


# ---------------------------------------------------------------- check()


def _valid(mode=sp.BF16, data=gaussian, n=1000, chunk=128):
    payload, _ = sp.encode_reference(data(n, 1), np.zeros(n, np.float32), 3, chunk, mode)
    assert sp.check(payload, n, chunk) is None
    return bytearray(payload), n, chunk


def _set_u32(buf: bytearray, offset: int, value: int) -> bytearray:
    buf[offset:offset + 4] = struct.pack("<I", value)
    return buf


@pytest.mark.parametrize("mode", MODES)
def test_check_rejects_bad_lengths(mode):
    p, n, chunk = _valid(mode)
    assert "expected at least 8" in sp.check(bytes(p[:5]), n, chunk)
    assert f"payload has {len(p) - 1} bytes, expected {len(p)}" in sp.check(p[:-1], n, chunk)
    assert f"payload has {len(p) + 1} bytes" in sp.check(p + b"\0", n, chunk)
    assert "expected at least 8" in sp.check(b"", n, chunk)


def test_check_rejects_bad_header_fields():
    p, n, chunk = _valid()
    bad = bytearray(p)
    bad[5] = 2
    assert "value_mode is 2, expected 0 (bf16) or 1 (natexp8)" == sp.check(bad, n, chunk)
    bad = bytearray(p)
    bad[4] = 1
    assert "index_mode is 1, expected 0 (bitmap)" in sp.check(bad, n, chunk)
    bad = bytearray(p)
    bad[4] = 7
    assert "index_mode is 7" in sp.check(bad, n, chunk)
    bad = bytearray(p)
    bad[7] = 1
    assert "reserved header field is 256, expected 0" == sp.check(bad, n, chunk)
    assert f"k is {n + 1}, expected at most n={n}" == sp.check(_set_u32(bytearray(p), 0, n + 1),
                                                              n, chunk)
    assert sp.check(_set_u32(bytearray(p), 0, 400), n, chunk) == f"payload has {len(p)} " \
        f"bytes, expected {8 + 125 + 800} for k=400, index_mode=0, value_mode=0, n=1000, " \
        "chunk=128"


def test_check_rejects_bits_beyond_n():
    p, n, chunk = _valid(n=1003)
    p[8 + 125] |= 0x80  # bit 1007 of a 1003-element key (the last byte holds bits 1000-1007)
    assert sp.check(p, n, chunk) == f"bitmap's last byte is {p[8 + 125]:#04x}, expected no " \
        "bits set at or beyond n=1003"


def test_check_counts_bitmap_bits():
    p, n, chunk = _valid()
    k = struct.unpack_from("<I", p)[0]
    bad = bytearray(p)
    bad[8] = bad[8] & 0xFE if bad[8] & 1 else bad[8] | 1
    ones = k - 1 if p[8] & 1 else k + 1
    assert sp.check(bad, n, chunk) == f"bitmap has {ones} bits set, expected k={k}"


def test_check_rejects_bad_index_lists():
    p, n, chunk = _valid(data=spiky, n=3000)
    assert p[4] == 1
    k = struct.unpack_from("<I", p)[0]
    assert k >= 3
    second = struct.unpack_from("<I", p, 12)[0]
    assert sp.check(_set_u32(bytearray(p), 8, second), n, chunk) \
        == f"index 1 of the list is {second} after {second}, expected strictly ascending"
    assert sp.check(_set_u32(bytearray(p), 8 + 4 * (k - 1), n), n, chunk) \
        == f"index {k - 1} of the list is {n}, expected below n={n}"
    assert sp.check(_set_u32(bytearray(p), 8 + 4 * (k - 1), 2**32 - 1), n, chunk) is not None


def test_check_accepts_every_valid_mode_combination():
    for mode in MODES:
        for data in (gaussian, spiky):
            _valid(mode, data, 3001, 192)


def test_argument_errors_name_the_value():
    n = 100
    g, r = np.zeros(n, np.float32), np.zeros(n, np.float32)
    out = np.empty(sp.max_payload_bytes(n, 64, 0), np.uint8)
    scratch = np.empty(sp.sample_size(n), np.float32)
    with pytest.raises(ValueError, match="chunk is 100, expected a positive multiple of 64"):
        sp.encode(g, r, out, scratch, 1, 100, 0)
    with pytest.raises(ValueError, match="value_mode is 2"):
        sp.encode(g, r, out, scratch, 1, 64, 2)
    with pytest.raises(ValueError, match="grad is a float64 array"):
        sp.encode(g.astype(np.float64), r, out, scratch, 1, 64, 0)
    with pytest.raises(ValueError, match=f"out has {out.size - 1} elements, expected at least"):
        sp.encode(g, r, out[:-1], scratch, 1, 64, 0)
    with pytest.raises(ValueError, match="scratch has"):
        sp.encode(g, r, out, scratch[:10], 1, 64, 0)
    with pytest.raises(ValueError, match="residual is read-only"):
        sp.encode(g, np.frombuffer(r.tobytes(), np.float32), out, scratch, 1, 64, 0)
    with pytest.raises(ValueError, match="residual has 99 elements, expected at least 100"):
        sp.encode(g, r[:99], out, scratch, 1, 64, 0)
    with pytest.raises(ValueError, match="seed is -1"):
        sp.encode(g, r, out, scratch, -1, 64, 0)
    with pytest.raises(ValueError, match="overlap"):
        sp.encode(g, g, out, scratch, 1, 64, 0)
    with pytest.raises(ValueError, match="acc has 99 elements, expected at least 100"):
        sp.decode_add(b"\0" * 8, 100, 64, np.zeros(99, np.float32))


# ---------------------------------------------------------------- NUMBA_DISABLE_JIT=1

_NOJIT_SCRIPT = textwrap.dedent("""
    import sys
    import numba
    import numpy as np
    assert numba.config.DISABLE_JIT
    from bitps.native import sparse as sp

    data = np.load(sys.argv[1])
    out = {}
    for name in ("gauss", "spiky", "wide"):
        grads = data[name]
        n = grads.shape[1]
        for mode in (sp.BF16, sp.NATEXP8):
            residual = np.zeros(n, np.float32)
            buf = np.empty(sp.max_payload_bytes(n, 192, mode), np.uint8)
            scratch = np.empty(sp.sample_size(n), np.float32)
            for step, g in enumerate(grads):
                nbytes = sp.encode(g, residual, buf, scratch, 50 + step, 192, mode)
                key = f"{name}_{mode}_{step}"
                out[key + "_payload"] = buf[:nbytes].copy()
                out[key + "_residual"] = residual.copy()
                acc = np.ones(n, np.float32)
                sp.decode_add(buf[:nbytes], n, 192, acc)
                out[key + "_acc"] = acc
                assert sp.check(buf[:nbytes], n, 192) is None
    np.savez(sys.argv[2], **out)
""")


def test_pure_python_path_matches_reference(run_without_jit):
    inputs = {"gauss": np.stack([gaussian(4500, s) for s in range(STEPS)]),
              "spiky": np.stack([spiky(1500, s) for s in range(STEPS)]),
              "wide": np.stack([wide(700, s) for s in range(STEPS)])}
    got = run_without_jit(_NOJIT_SCRIPT, **inputs)
    for name, grads in inputs.items():
        n = grads.shape[1]
        for mode in MODES:
            ref_p, ref_r = reference_steps(list(grads), 50, 192, mode)
            for step in range(STEPS):
                key = f"{name}_{mode}_{step}"
                assert bytes(got[key + "_payload"]) == ref_p[step], key
                assert same_bits(got[key + "_residual"], ref_r[step]), key
                expected = np.ones(n, np.float32) + sp.decode_reference(ref_p[step], n, 192)
                assert same_bits(got[key + "_acc"], expected), key
