"""``bitps-bench compare``: the same scenarios run from two checkouts in one run, alternated.

Each round runs every scenario once from each side, the order swapped every round (A B, B A,
...), each from its own checkout's interpreter (``<checkout>/.venv/bin/python -m bitps.bench
SCENARIO --out DIR``), so both see the same machine at nearly the same time. Then, for every
row of every scenario's results and every measured (float) figure in it: the median over the
rounds on each side, the ratio ``head / base``, and the noise, the larger of the two sides'
spread over their own rounds (``max / min - 1``). A figure differs by more than ``tolerance``
only when the ratio says so beyond the noise; both are reported.

    bitps-bench compare --base ../bitps-old --scenarios pushpull codec --rounds 3

The load of the machine before the run (``/proc/stat``) is recorded in the config.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bitps.bench.config import CompareBench
from bitps.bench.proc import machine_busy
from bitps.bench.report import write_results

__all__ = ["compare", "run"]

_HEAD = Path(__file__).resolve().parents[1]  # this checkout (bench/ is bitps.bench)


def _python(checkout: Path) -> str:
    """The checkout's own interpreter (its ``.venv``), or this one for the running checkout."""
    venv = checkout / ".venv" / "bin" / "python"
    if venv.exists():
        return str(venv)
    if checkout.resolve() == _HEAD:
        return sys.executable
    raise ValueError(f"checkout {checkout} has no .venv/bin/python; expected `make venv` there")


def _run_side(checkout: Path, scenario: str, quick: bool, out: Path) -> float:
    """One scenario from one checkout into ``out``; its wall seconds. A scenario whose own
    checks failed exits 1 with its results written: that is a result, not a failure here."""
    cmd = [_python(checkout), "-m", "bitps.bench", scenario, "--out", str(out)]
    if quick:
        cmd.append("--quick")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    if proc.returncode != 0 and not (out / f"{scenario}.json").exists():
        raise RuntimeError(f"{' '.join(cmd)} (in {checkout}) exited {proc.returncode}: "
                           f"{proc.stderr[-2000:]}")
    return time.monotonic() - t0


def _rows(path: Path) -> dict[tuple, dict[str, float]]:
    """A result file's measured figures: row identity (its string fields) -> float fields."""
    doc = json.loads(path.read_text())
    rows = {}
    for row in doc["rows"]:
        key = tuple(sorted((k, v) for k, v in row.items() if isinstance(v, str)))
        rows[key] = {k: v for k, v in row.items() if isinstance(v, float)}
    return rows


def compare(runs: dict[str, list[Path]], scenario: str, tolerance: float) -> list[dict]:
    """Rows of the comparison of ``scenario``'s result files by side (``base``, ``head``)."""
    sides = {side: [_rows(d / f"{scenario}.json") for d in dirs] for side, dirs in runs.items()}
    out = []
    for key in sides["base"][0]:
        for field in sides["base"][0][key]:
            values = {side: [r[key][field] for r in rounds if key in r and field in r[key]]
                      for side, rounds in sides.items()}
            if any(not v for v in values.values()):
                continue
            med = {side: statistics.median(v) for side, v in values.items()}
            if med["base"] == 0:
                continue
            noise = max(_spread(v) for v in values.values())
            ratio = med["head"] / med["base"]
            out.append({"scenario": scenario, "row": ", ".join(v for _, v in key),
                        "figure": field, "base": med["base"], "head": med["head"],
                        "ratio": ratio, "noise": noise,
                        "within_tolerance": abs(ratio - 1) <= tolerance,
                        "within_noise": abs(ratio - 1) <= max(noise, tolerance)})
    return out


def _spread(values: list[float]) -> float:
    lo, hi = min(values), max(values)
    return hi / lo - 1 if lo > 0 else 0.0


def run(cfg: CompareBench | None = None, *, out: Path | None = None) -> dict:
    cfg = (cfg or CompareBench()).sized()
    head = _HEAD
    base = Path(cfg.base).resolve() if cfg.base else head  # none: this checkout against itself
    work = (Path(out or "bench/results") / "compare-runs").resolve()  # each side's cwd differs
    busy = machine_busy(2.0)
    runs = {side: {s: [] for s in cfg.scenarios} for side in ("base", "head")}
    walls = {"base": 0.0, "head": 0.0}
    for r in range(cfg.rounds):
        order = (("base", base), ("head", head)) if r % 2 == 0 else (("head", head),
                                                                    ("base", base))
        for scenario in cfg.scenarios:
            for side, checkout in order:
                d = work / side / f"round{r}"
                walls[side] += _run_side(checkout, scenario, cfg.quick, d)
                runs[side][scenario].append(d)
    rows = [row for s in cfg.scenarios for row in compare(
        {side: runs[side][s] for side in runs}, s, cfg.tolerance)]
    outside = [r for r in rows if not r["within_noise"]]
    config = {"base": str(base), "head": str(head), "scenarios": list(cfg.scenarios),
              "rounds": cfg.rounds, "tolerance": cfg.tolerance, "quick": cfg.quick,
              "machine_busy_before": round(busy, 3),
              "wall_s": {k: round(v, 1) for k, v in walls.items()}}
    checks = {"figures within tolerance, or within the rounds' own noise": {
        "value": f"{len(rows) - len(outside)} of {len(rows)}", "goal": "all",
        "ok": not outside}}
    write_results("compare", config=config, rows=rows, checks=checks, out=out,
                  columns=[("scenario", "scenario"), ("row", "row"), ("figure", "figure"),
                           ("base", "base"), ("head", "head"), ("ratio", "head / base"),
                           ("noise", "noise"), ("within_tolerance", "within tolerance"),
                           ("within_noise", "within noise")],
                  notes=f"base {base}, head {head}; {cfg.rounds} rounds, sides alternated; "
                        f"median per side; noise = the larger side's max/min - 1 over its "
                        f"rounds. Machine busy before the run: {busy:.0%} of all cores.")
    return {"config": config, "rows": rows, "checks": checks}
