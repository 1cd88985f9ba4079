"""``bitps-bench volume``: communication bytes per worker per step, by codec, by arithmetic.

The problem statement reports FP32 30 GB -> 1-bit 3.75 GB per sync. This scenario computes the
same quantity from the wire layouts (``proto.codecs``) for the demo model (its real key plan)
and for 7.5B- and 30B-parameter models (keys of 1 MiB; 7.5B is one of the problem's four
pipeline stages, whose fp32 gradient is the 30 GB). Nothing is timed: the sizes are exact for
every codec but ``sparse``, whose size depends on the data; it is computed at the density its
threshold keeps on Gaussian data, 2*median(|u|) -> P(|u| > 1.349 sigma) = 0.177.

Directions: push = gradients worker -> shard; pull = parameters, or the codes of the shard's
update (compressed pulls, ``ps.publish``; one code per step, as in sync), shard -> worker. The
pull codec defaults to the push codec's; the "(pull fp32)" rows set it to raw. sign1 uses its
default chunk (2048); 1-bit Adam its own default (``OneBitConfig.chunk``, 256).
"""

from __future__ import annotations

import math
from pathlib import Path

from bitps.bench.config import VolumeBench
from bitps.native import sign1, sparse
from bitps.proto.keyplan import DEFAULT_PARTITION_BYTES, ParamSpec, make_plan
from bitps.ps.onebit import OneBitConfig

__all__ = ["run"]

SPARSE_DENSITY = 0.177
ONEBIT_CHUNK = OneBitConfig().chunk
_KEY_ELEMS = DEFAULT_PARTITION_BYTES // 4
# name -> (push codec, pull codec)
SCHEMES = {
    "fp32": ("raw", "raw"),
    "bf16": ("bf16", "bf16"),
    "sign1 + EF (pull fp32)": ("sign1", "raw"),
    "sign1 + EF (both ways)": ("sign1", "sign1"),
    "1-bit Adam (both ways)": ("onebit", "onebit"),
    "sparse natexp8 + EF (pull fp32)": ("sparse_natexp8", "raw"),
    "sparse natexp8 + EF (both ways)": ("sparse_natexp8", "sparse_natexp8"),
    "sparse bf16 + EF (pull fp32)": ("sparse_bf16", "raw"),
}


def key_bytes(codec: str, n: int, chunk: int = sign1.DEFAULT_CHUNK) -> int:
    """Payload bytes of one key of ``n`` elements."""
    if codec == "raw":
        return 4 * n
    if codec == "bf16":
        return 2 * n
    if codec == "sign1":
        return sign1.payload_bytes(n, chunk)
    if codec == "onebit":
        return sign1.payload_bytes(n, ONEBIT_CHUNK)
    k = round(SPARSE_DENSITY * n)
    index = (n + 7) // 8 if k * 32 > n else 4 * k
    values = 2 * k if codec == "sparse_bf16" else (n + chunk - 1) // chunk + k
    return sparse.HEADER_BYTES + index + values


def _key_lengths(params: int) -> list[int]:
    full, rest = divmod(params, _KEY_ELEMS)
    return [_KEY_ELEMS] * full + ([rest] if rest else [])


def _demo_key_lengths() -> list[int]:
    from bitps.worker.demo import DemoConfig, build_model

    model = build_model(DemoConfig())
    plan = make_plan([ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters()],
                     num_shards=2)
    return [k.length for k in plan.keys]


def _count(lengths: list[int], codec: str) -> int:
    # Key lengths repeat (all full keys but a few): count each distinct length once.
    sizes: dict[int, int] = {}
    for n in lengths:
        sizes[n] = sizes.get(n, 0) + 1
    return sum(c * key_bytes(codec, n) for n, c in sizes.items())


def run(cfg: VolumeBench | None = None, *, out: Path | None = None) -> dict:
    """Compute the table (``cfg``: no options), write ``volume.json``/``.md`` under ``out``,
    return the document."""
    from bitps.bench.report import check, write_results

    models = {"demo (tiny Qwen3-MoE)": _demo_key_lengths(),
              "7.5B (one of 4 pipeline stages)": _key_lengths(7_500_000_000),
              "30B": _key_lengths(30_000_000_000)}
    rows = []
    for model, lengths in models.items():
        params = sum(lengths)
        fp32 = 2 * _count(lengths, "raw")
        for scheme, (up, down) in SCHEMES.items():
            push, pull = _count(lengths, up), _count(lengths, down)
            rows.append({"model": model, "params": params, "scheme": scheme,
                         "push_GB": push / 1e9, "pull_GB": pull / 1e9,
                         "push_bits_per_elem": 8 * push / params,
                         "reduction_vs_fp32": fp32 / (push + pull)})
    stage = {r["scheme"]: r for r in rows if r["model"].startswith("7.5B")}
    sign1_ratio = 4 * 7_500_000_000 / (stage["1-bit Adam (both ways)"]["push_GB"] * 1e9)
    checks = {
        "stage_fp32_push_GB": check(round(stage["fp32"]["push_GB"], 2), "problem: 30 GB",
                                    math.isclose(stage["fp32"]["push_GB"], 30, rel_tol=1e-3)),
        "stage_1bit_push_reduction": check(round(sign1_ratio, 2), "problem: 8x (3.75 GB)",
                                           sign1_ratio >= 8),
    }
    notes = ("Bytes per worker per step from the wire layouts (no timing). sparse at the "
             f"density of its threshold on Gaussian data, p = {SPARSE_DENSITY}; bitmap positions "
             "(p > 1/32). reduction = fp32 push+pull / this scheme's push+pull. Keys of "
             f"{_KEY_ELEMS} elements (1 MiB) for the large models; the demo model's real plan. "
             "The problem statement's 30 GB -> 3.75 GB is the 7.5B stage's fp32 gradient.")
    write_results("volume", config={"sparse_density": SPARSE_DENSITY,
                                    "chunk": sign1.DEFAULT_CHUNK, "key_elements": _KEY_ELEMS},
                  rows=rows, checks=checks, out=out, notes=notes,
                  columns=[("model", "model"), ("params", "params"), ("scheme", "scheme"),
                           ("push_GB", "push GB/step"), ("pull_GB", "pull GB/step"),
                           ("push_bits_per_elem", "push bits/elem"),
                           ("reduction_vs_fp32", "push+pull reduction vs fp32")])
    return {"rows": rows, "checks": checks}
