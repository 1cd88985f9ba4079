"""bitps-bench runs the real path and writes the agreed JSON + Markdown layout (a smoke run:
figures from a loaded test machine prove nothing, so no ratio is asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pushpull_quick_writes_results(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "--out", str(tmp_path), "pushpull",
                          "--quick", "--sizes-mib", "0.25", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr  # 1 = a goal missed, still a complete run
    doc = json.loads((tmp_path / "pushpull.json").read_text())
    assert set(doc) >= {"config", "versions", "machine", "rows", "checks"}
    assert doc["versions"]["pyzmq"] and doc["machine"]["cores"] >= 1
    cases = [r["case"] for r in doc["rows"]]
    assert cases == ["push+pull 0.25 MiB", "round trip 1024 B"]
    for row in doc["rows"]:
        assert row["bitps_ms"] > 0 and row["raw_ms"] > 0 and row["ratio"] > 0
    assert set(doc["checks"]) == {"throughput_0.25MiB_vs_raw", "small_round_trip_vs_raw"}
    for c in doc["checks"].values():
        assert set(c) == {"value", "goal", "ok"} and isinstance(c["ok"], bool)
    md = (tmp_path / "pushpull.md").read_text()
    assert "| push+pull 0.25 MiB |" in md and "| check | value | goal | ok |" in md
