"""Benchmark results: one JSON and one Markdown file per scenario.

JSON layout (``bench/results/<scenario>.json``)::

    {"scenario": str, "config": {...}, "versions": {...}, "machine": {...},
     "rows": [{...}, ...], "checks": {name: {"value": v, "goal": str, "ok": bool}}}
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

__all__ = ["DEFAULT_OUT", "check", "machine", "median", "versions", "write_results"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
_PACKAGES = ("numpy", "numba", "pyzmq", "grpcio", "protobuf", "prometheus-client", "torch",
             "transformers")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    try:
        import zmq

        out["libzmq"] = zmq.zmq_version()
    except ImportError:
        pass
    return out


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") \
        else 0
    return {"system": platform.system(), "machine": platform.machine(), "cpu": cpu,
            "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def median(values) -> float:
    return statistics.median(values)


def moving_average(values, window: int):
    """The trailing ``window``-point means of ``values`` (``window`` clipped to 1..len), as a
    float64 array of ``len - window + 1`` points: how every loss curve here is smoothed."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    w = max(1, min(window, x.size))
    return np.convolve(x, np.ones(w) / w, mode="valid")


def check(value, goal: str, ok: bool) -> dict:
    return {"value": value, "goal": goal, "ok": bool(ok)}


def write_results(scenario: str, *, config: dict, rows: list[dict], checks: dict,
                  columns: list[tuple[str, str]], out: Path | None = None,
                  notes: str = "") -> tuple[Path, Path]:
    """Write ``<scenario>.json`` and ``<scenario>.md`` under ``out``; ``columns`` are
    ``(row key, header)`` pairs for the Markdown table."""
    out = Path(out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"scenario": scenario, "config": config, "versions": versions(), "machine": machine(),
           "rows": rows, "checks": checks}
    json_path = out / f"{scenario}.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# bitps-bench {scenario}", "", f"Machine: {doc['machine']['cpu']} "
             f"({doc['machine']['cores']} cores), {doc['machine']['date']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + ".", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(h for _, h in columns) + " |",
              "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k, _ in columns) + " |")
    lines += ["", "| check | value | goal | ok |", "|---|---|---|---|"]
    for name, c in checks.items():
        lines.append(f"| {name} | {_fmt(c['value'])} | {c['goal']} | "
                     f"{'yes' if c['ok'] else '**no**'} |")
    md_path = out / f"{scenario}.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)
