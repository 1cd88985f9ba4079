"""``bitps-bench compare``: every measured figure's median per side, ratio and the rounds' own
noise, from result files; and a real run of a scenario from two checkouts (here the same one
twice: the noise floor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bitps.bench.compare import compare, run
from bitps.bench.config import CompareBench


def _results(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "codec.json").write_text(json.dumps({"rows": rows}))
    return d


def test_ratios_and_noise_come_from_the_medians_and_spreads(tmp_path):
    row = lambda ms, gbps: {"operation": "encode", "implementation": "numba", "ms": ms,  # noqa: E731
                            "GBps": gbps, "bytes": 1 << 20}
    base = [_results(tmp_path / f"b{i}", [row(ms, 2.0)]) for i, ms in enumerate((10., 11., 12.))]
    head = [_results(tmp_path / f"h{i}", [row(ms, 2.0)]) for i, ms in enumerate((12., 12., 13.))]
    rows = {r["figure"]: r for r in compare({"base": base, "head": head}, "codec", 0.03)}
    assert set(rows) == {"ms", "GBps"}  # floats only: the int is configuration
    ms = rows["ms"]
    assert ms["row"] == "numba, encode" and ms["base"] == 11.0 and ms["head"] == 12.0
    assert ms["ratio"] == pytest.approx(12 / 11)
    assert ms["noise"] == pytest.approx(12 / 10 - 1)  # the base side's spread is the larger
    assert not ms["within_tolerance"] and ms["within_noise"]
    assert rows["GBps"]["ratio"] == 1.0 and rows["GBps"]["within_tolerance"]


def test_a_checkout_against_itself_runs_alternated_rounds(tmp_path):
    result = run(CompareBench(scenarios=("volume",), rounds=2), out=tmp_path)
    assert result["config"]["base"] == result["config"]["head"]
    assert result["rows"] and all(r["ratio"] == pytest.approx(1.0) for r in result["rows"])
    assert result["checks"]["figures within tolerance, or within the rounds' own noise"]["ok"]
    for side in ("base", "head"):
        assert sorted(p.name for p in (tmp_path / "compare-runs" / side).iterdir()) == [
            "round0", "round1"]
    assert (tmp_path / "compare.md").read_text().startswith("# bitps-bench compare")
