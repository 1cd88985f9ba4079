"""``bitps-bench codec``: the codec kernels on one thread against memcpy, the numpy references
and the torch-ops implementation, all in the same run.

Float32 gradients of ``mib`` MiB (standard normal, seed 0; two, taken in turn, so every
compression sees a new gradient plus the carried residual, as in training) are compressed with
error feedback and decompressed-and-accumulated. Every implementation is called ``repeats``
times, round-robin with the others and with ``np.copyto`` of the same bytes into a preallocated
buffer (memcpy), so machine noise hits all alike; medians are reported. "vs memcpy" = memcpy
time / this time (1.0 = as fast as copying the float32 gradient once); "kernel speedup" = this
time / the numba kernel's time for the same operation. "clipped sign1 push" compares the
worker's preparation of a clipped compressed push before ``worker.training.clip`` (torch's
``clip_grad_norm_`` in place, the finiteness check, the encode) with now (``sum_squares`` for
the norm and the finiteness check in one read, the encode applying the factor).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bitps import native
from bitps.bench.config import CodecBench
from bitps.bench.report import check, median, write_results
from bitps.native import casts, sign1, sparse

__all__ = ["run"]

MIB = 1 << 20


def _cases(grads: list[np.ndarray]) -> dict:
    """(operation, implementation) -> a zero-argument callable doing it once. Encoders take the
    next of ``grads`` on every call, as training brings a new gradient each step (the residual
    carries over); encoding one gradient again and again would thin sparse's selection."""
    import itertools

    import torch

    from bitps.worker.training import codec_torch

    grad = grads[0]
    n, chunk = grad.shape[0], sign1.DEFAULT_CHUNK
    turn = {name: itertools.cycle(grads) for name in ("k", "np", "t", "sk", "snp", "bf")}
    tgrads = itertools.cycle([torch.from_numpy(g) for g in grads])
    res = {name: np.zeros(n, np.float32) for name in ("k", "np", "sk", "snp", "bf")}
    out = np.empty(sign1.payload_bytes(n, chunk), np.uint8)
    sign1.encode(grad, res["k"], out)
    payload = out.tobytes()
    acc = np.zeros(n, np.float32)
    tres, tacc = torch.zeros(n), torch.zeros(n)
    tpayload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    sp_out = np.empty(sparse.max_payload_bytes(n, chunk, sparse.NATEXP8), np.uint8)
    scratch = np.empty(sparse.sample_size(n), np.float32)
    size = sparse.encode(grad, res["sk"], sp_out, scratch, np.uint64(1), chunk, sparse.NATEXP8)
    sp_payload = sp_out[:size].copy()
    bf_out = np.empty(n, np.uint16)
    dst = np.empty_like(grad)
    # A clipped sign1 push as the worker prepared it before clipping moved into the encoder
    # (torch's clip_grad_norm_ in place, then the finiteness check, then the encode) and now
    # (one read for the norm and the finiteness check, then the encode applying the factor).
    clip_grad = torch.from_numpy(grads[1].copy())
    clip_grad.grad = clip_grad.clone()  # clip_grad_norm_ works on .grad
    res["before"], res["now"] = np.zeros(n, np.float32), np.zeros(n, np.float32)

    def before() -> None:
        torch.nn.utils.clip_grad_norm_([clip_grad], 1.0)
        g = clip_grad.grad.numpy()
        native.all_finite(g)
        sign1.encode(g, res["before"], out)

    def now() -> None:
        g = grads[1]
        factor = min(1.0, 1.0 / (float(np.sqrt(native.sum_squares(g))) + 1e-6))
        sign1.encode(g, res["now"], out, scale=factor)

    return {
        ("clipped sign1 push", "before: clip_grad_norm_, all_finite, encode"): before,
        ("clipped sign1 push", "now: sum_squares, encode with the factor"): now,
        ("copy float32 gradient", "memcpy (np.copyto)"): lambda: np.copyto(dst, grad),
        ("sign1 compress + EF", "numba kernel"):
            lambda: sign1.encode(next(turn["k"]), res["k"], out),
        ("sign1 compress + EF", "numpy reference"):
            lambda: sign1.encode_reference(next(turn["np"]), res["np"]),
        ("sign1 compress + EF", "torch ops"):
            lambda: codec_torch.sign1_encode(next(tgrads), tres, chunk=chunk),
        ("sign1 decompress + accumulate", "numba kernel"):
            lambda: sign1.decode_add(payload, n, acc),
        ("sign1 decompress + accumulate", "numpy reference"):
            lambda: np.add(acc, sign1.decode_reference(payload, n), out=acc),
        ("sign1 decompress + accumulate", "torch ops"):
            lambda: codec_torch.sign1_decode_add(tpayload, n, tacc, chunk=chunk),
        ("sparse natexp8 compress + EF", "numba kernel"):
            lambda: sparse.encode(next(turn["sk"]), res["sk"], sp_out, scratch, np.uint64(1),
                                  chunk, sparse.NATEXP8),
        ("sparse natexp8 compress + EF", "numpy reference"):
            lambda: sparse.encode_reference(next(turn["snp"]), res["snp"], np.uint64(1), chunk,
                                            sparse.NATEXP8),
        ("sparse decompress + accumulate", "numba kernel"):
            lambda: sparse.decode_add(sp_payload, n, chunk, acc),
        ("bf16 compress + EF", "numba kernel"):
            lambda: casts.bf16_encode(next(turn["bf"]), res["bf"], bf_out),
        ("bf16 decompress + accumulate", "numba kernel"):
            lambda: casts.bf16_decode_add(bf_out, n, acc),
    }


def run(cfg: CodecBench | None = None, *, out: Path | None = None) -> dict:
    """Run the scenario (``None``: the defaults), write ``codec.json``/``.md`` under ``out``,
    return the document."""
    import numba
    import torch

    cfg = (cfg or CodecBench()).sized()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(cfg.mib * MIB // 4).astype(np.float32) for _ in range(2)]
    med = _medians(_cases(grads), cfg.repeats)
    memcpy = med[("copy float32 gradient", "memcpy (np.copyto)")]
    kernel = {op: t for (op, impl), t in med.items() if impl == "numba kernel"}
    rows = [{"operation": op, "implementation": impl, "ms": t * 1e3,
             "GBps": grads[0].nbytes / t / 1e9, "vs_memcpy": memcpy / t,
             "kernel_speedup": t / kernel[op] if op in kernel else None}
            for (op, impl), t in med.items()]
    checks = _checks(rows, med)
    notes = (f"{cfg.mib} MiB float32 gradients (standard normal, two in turn), one thread (numba "
             f"and torch set to 1), medians of {cfg.repeats} round-robin calls. vs memcpy = "
             "memcpy time / this time; kernel speedup = this time / the numba kernel's time.")
    write_results("codec", config={"mib": cfg.mib, "repeats": cfg.repeats,
                                   "chunk": sign1.DEFAULT_CHUNK, "threads": 1},
                  rows=rows, checks=checks, out=out, notes=notes,
                  columns=[("operation", "operation"), ("implementation", "implementation"),
                           ("ms", "ms"), ("GBps", "GB/s (fp32 in)"),
                           ("vs_memcpy", "vs memcpy"), ("kernel_speedup", "kernel speedup")])
    return {"rows": rows, "checks": checks}


def _medians(cases: dict, repeats: int) -> dict:
    """Each case's median seconds over ``repeats`` calls, the cases called round robin."""
    for fn in cases.values():
        fn()  # compile and touch every buffer once
    times: dict = {key: [] for key in cases}
    for _ in range(repeats):
        for key, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: median(ts) for key, ts in times.items()}


def _checks(rows: list[dict], med: dict) -> dict:
    by = {(r["operation"], r["implementation"]): r for r in rows}

    def ratio(op: str, impl: str, key: str) -> float:
        return round(by[(op, impl)][key], 2)

    enc, dec = "sign1 compress + EF", "sign1 decompress + accumulate"
    checks = {
        "sign1_compress_vs_memcpy": _goal(ratio(enc, "numba kernel", "vs_memcpy"), 0.4),
        "sign1_decompress_vs_memcpy": _goal(ratio(dec, "numba kernel", "vs_memcpy"), 0.8),
        "sign1_compress_vs_numpy": _goal(ratio(enc, "numpy reference", "kernel_speedup"), 5),
        "sign1_decompress_vs_numpy": _goal(ratio(dec, "numpy reference", "kernel_speedup"), 5),
        "sign1_compress_vs_torch": _goal(ratio(enc, "torch ops", "kernel_speedup"), 10),
        "sign1_decompress_vs_torch": _goal(ratio(dec, "torch ops", "kernel_speedup"), 10),
        "sparse_compress_vs_memcpy": _goal(
            ratio("sparse natexp8 compress + EF", "numba kernel", "vs_memcpy"), 0.2),
    }
    clip = [t for (op, _), t in med.items() if op == "clipped sign1 push"]
    checks["clipped_push_before_over_now"] = _goal(round(clip[0] / clip[1], 2), 1.1)
    return checks


def _goal(value: float, at_least: float) -> dict:
    return check(value, f">= {at_least:g}", value >= at_least)
