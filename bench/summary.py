"""``bitps-bench report``: one Markdown report over every result file in a results directory.

It reads ``<dir>/<scenario>.json`` (``bench.report`` layout) and writes ``<dir>/REPORT.md``: the
problem statement's claims beside bitps's measured values, row by row (each with the file and
row it came from), then every scenario's notes, tables and checks, and for each end-to-end
result (``e2e-*.json``) four PNG plots: loss against wall time and against samples, samples/s
bars, and wire bytes per step bars. Every figure is read from the JSON files, none typed in
(``tests/test_bench.py`` checks the report's against them).
"""

from __future__ import annotations

import json
from pathlib import Path

from bitps.bench.e2e_report import best_run
from bitps.bench.report import DEFAULT_OUT, _fmt, moving_average

__all__ = ["claims", "write_report"]

# scenarios in the order the report shows them
_ORDER = ("e2e-lm", "e2e-moe", "e2e-lm-straggler", "e2e-tiny", "overlap", "convergence",
          "volume", "pushpull", "codec", "memory")


def _load(out: Path) -> dict[str, dict]:
    docs = {}
    for path in sorted(out.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and "scenario" in doc and "rows" in doc:
            docs[path.stem] = doc
    return docs


def _rows(doc: dict, key: str) -> dict:
    return {r.get(key): r for r in doc["rows"]}


def claims(docs: dict[str, dict]) -> list[dict]:
    """The problem statement's claims and bitps's measured values: one dict per row with
    ``claim``, ``problem`` (the statement's figures, as text), ``baseline`` and ``bitps``
    (numbers from the result files, or None where not measured) and ``source``."""
    out = []
    e2e_name = next((n for n in ("e2e-lm", "e2e-moe", "e2e-tiny") if n in docs), None)
    if e2e_name:
        doc = docs[e2e_name]
        by = _rows(doc, "run")
        ddp, best = by.get("DDP fp32"), best_run(doc["rows"])
        src = f"{e2e_name}.json"
        if ddp and best:
            first = best if best.get("time_to_target_s") is not None else None
            out += [
                {"claim": "communication volume per step (MB on the wire)",
                 "problem": "FP32 30 GB -> 1-bit 3.75 GB (8x)",
                 "baseline": ddp.get("wire_mb_per_step"), "bitps": best.get("wire_mb_per_step"),
                 "source": f"{src}: DDP fp32 vs {best['run']}"},
                {"claim": "exposed sync latency per step (ms)", "problem": "420 ms -> 68 ms",
                 "baseline": ddp.get("exposed_ms"), "bitps": best.get("exposed_ms"),
                 "source": f"{src}: DDP fp32 vs {best['run']}"},
                {"claim": "step time (ms)", "problem": "1.42 s -> 0.87 s",
                 "baseline": ddp.get("step_ms"), "bitps": best.get("step_ms"),
                 "source": f"{src}: DDP fp32 vs {best['run']}"},
                {"claim": "utilization (samples/s vs the no-traffic ceiling)",
                 "problem": "68 % -> 92 %", "baseline": ddp.get("vs_ceiling"),
                 "bitps": best.get("vs_ceiling"), "source": f"{src}: DDP fp32 vs {best['run']}"},
                {"claim": "throughput (samples/s)", "problem": "112 -> 183 samples/s",
                 "baseline": ddp.get("samples_per_s"), "bitps": best.get("samples_per_s"),
                 "source": f"{src}: DDP fp32 vs {best['run']}"},
                {"claim": "steps to the target loss", "problem": "58k -> 53k",
                 "baseline": ddp.get("steps_to_target"),
                 "bitps": first.get("steps_to_target") if first else None,
                 "source": f"{src}: DDP fp32 vs {first['run'] if first else 'no bitps run'}"},
            ]
            async_r, sync_r = by.get("bitps async fp32"), by.get("bitps sync fp32")
            if async_r and sync_r:
                out.append({"claim": "async vs sync efficiency (samples/s ratio)",
                            "problem": "62 % -> 91 %", "baseline": None,
                            "bitps": async_r["samples_per_s"] / sync_r["samples_per_s"],
                            "source": f"{src}: bitps async fp32 / bitps sync fp32"})
    if "convergence" in docs:
        by = _rows(docs["convergence"], "run")
        r = by.get("1-bit Adam (sync)")
        if r:
            out.append({"claim": "1-bit loss difference vs fp32 (final loss ratio - 1)",
                        "problem": "< 0.5 %", "baseline": None, "bitps": r["vs_fp32"] - 1.0,
                        "source": "convergence.json: 1-bit Adam (sync)"})
    if "memory" in docs:
        c = docs["memory"]["checks"].get("default_external_fragmentation_at_peak")
        if c and isinstance(c["value"], (int, float)):
            out.append({"claim": "memory fragmentation at peak", "problem": "15 % -> 3.2 %",
                        "baseline": None, "bitps": c["value"],
                        "source": "memory.json: check default_external_fragmentation_at_peak"})
    out.append(_pipeline_claim(docs.get("pipeline")))
    return out


def _pipeline_claim(doc: dict | None) -> dict:
    """The bubble claim from ``pipeline.json`` part (a): our 1F1B at p = 4, m = 8 as the
    baseline, our best flushing schedule at the same m as bitps (measured, sleep-based stages)."""
    claim = {"claim": "pipeline bubble share", "problem": "28 % -> 12 %", "baseline": None,
             "bitps": None, "source": "not measured (no pipeline.json)"}
    if doc is None:
        return claim
    ours = {r["case"]: r for r in doc["rows"] if r.get("m") == 8 and "sim_bubble_max" in r}
    flushing = [r for c, r in ours.items() if c != "2bw"]
    if "1f1b" in ours and flushing:
        best = min(flushing, key=lambda r: r["bubble_max"])
        claim.update(baseline=ours["1f1b"]["bubble_max"], bitps=best["bubble_max"],
                     source=f"pipeline.json (a), p = 4, m = 8: 1f1b vs {best['case']} "
                            "(measured, sleep-based stages)")
    return claim


def _plots(name: str, doc: dict, out: Path) -> list[str]:
    curves_path = out / f"{name}_curves.json"
    if not curves_path.exists():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    curves = json.loads(curves_path.read_text())
    cfg = doc["config"]
    window = cfg.get("smoothing_window", 10)
    per_step = cfg.get("batch_per_worker", 1) * 2
    files = []
    for xlabel, suffix in (("wall time (s)", "loss_time"), ("samples", "loss_samples")):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        for run, c in curves.items():
            loss = moving_average(c["loss"], window)
            x = (np.asarray(c["time"])[window - 1:] if suffix == "loss_time"
                 else (np.arange(loss.size) + window) * per_step)
            ax.plot(x, loss, label=run, lw=1.1)
        if cfg.get("target_loss") is not None:
            ax.axhline(cfg["target_loss"], color="grey", ls=":", lw=1, label="target")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"loss ({window}-step average, mean of ranks)")
        ax.set_title(f"{name}: loss against {xlabel.split(' (')[0]}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(f"{name}_{suffix}.png")
        fig.savefig(out / files[-1])
        plt.close(fig)
    for key, label, suffix in (("samples_per_s", "samples/s", "throughput"),
                               ("wire_mb_per_step", "wire MB per step per node", "wire")):
        rows = [r for r in doc["rows"] if r.get(key) is not None]
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.barh([r["run"] for r in rows], [r[key] for r in rows])
        ax.set_xlabel(label)
        if suffix == "wire":
            ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{name}: {label}")
        fig.tight_layout()
        files.append(f"{name}_{suffix}.png")
        fig.savefig(out / files[-1])
        plt.close(fig)
    return files


_PEERS = ("DDP fp32", "DDP bf16", "DDP PowerSGD r1")


def headline(docs: dict[str, dict]) -> list[dict]:
    """One row per end-to-end result file: bitps's best run (``bench.e2e.best_run``) against
    the ceiling and each DDP peer of the same run, in samples/s, time to the target loss and
    wire bytes per step."""
    out = []
    for name in [n for n in _ORDER if n in docs and n.startswith("e2e")]:
        rows = docs[name]["rows"]
        by, best = _rows(docs[name], "run"), best_run(rows)
        if best is None:
            continue
        row = {"scenario": name, "run": best["run"], "vs_ceiling": best.get("vs_ceiling"),
               "time_to_target_s": best.get("time_to_target_s"),
               "wire_vs_fp32": best.get("wire_vs_fp32")}
        for peer in _PEERS:
            p = by.get(peer)
            row[f"{peer} samples/s"] = (best["samples_per_s"] / p["samples_per_s"]
                                        if p else None)
            row[f"{peer} s to target"] = p.get("time_to_target_s") if p else None
        out.append(row)
    return out


def write_report(out: Path | None = None) -> Path:
    """Write ``REPORT.md`` (and the e2e plots) from the JSON files under ``out``."""
    out = Path(out or DEFAULT_OUT)
    docs = _load(out)
    if not docs:
        raise FileNotFoundError(f"no bench result files (*.json) under {out}")
    names = [n for n in _ORDER if n in docs] + sorted(set(docs) - set(_ORDER))
    lines = ["# bitps benchmark report", "",
             "Every figure below is read from the result files in this directory; each file "
             "records its versions, configuration, machine and the limits measured in the same "
             "run.", "", "## The problem statement's claims beside bitps's measurements", "",
             "| claim | problem statement | baseline (measured) | bitps (measured) | source |",
             "|---|---|---|---|---|"]
    for c in claims(docs):
        lines.append(f"| {c['claim']} | {c['problem']} | {_fmt(c['baseline'])} | "
                     f"{_fmt(c['bitps']) if c['bitps'] is not None else 'not measured'} | "
                     f"{c['source']} |")
    lines.append("")
    if heads := headline(docs):
        lines += ["## bitps's best run against DDP, per end-to-end scenario", "",
                  "Best run: the first bitps run to reach the target loss (DDP fp32's final), or "
                  "the fastest when none does. Ratios are its samples/s over each peer's; "
                  "seconds to the target are its and each peer's (blank: not reached).", "",
                  "| scenario | best bitps run | vs ceiling | vs DDP fp32 | vs DDP bf16 | "
                  "vs DDP PowerSGD r1 | s to target | DDP fp32 s | DDP bf16 s | "
                  "DDP PowerSGD r1 s | wire vs DDP fp32 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for h in heads:
            cells = [h["scenario"], h["run"], h["vs_ceiling"],
                     *(h[f"{p} samples/s"] for p in _PEERS), h["time_to_target_s"],
                     *(h[f"{p} s to target"] for p in _PEERS), h["wire_vs_fp32"]]
            lines.append("| " + " | ".join(c if isinstance(c, str) else _fmt(c)
                                           for c in cells) + " |")
        lines.append("")
    for name in names:
        doc = docs[name]
        md = out / f"{name}.md"
        lines += [f"## {name}", ""]
        if md.exists():
            body = md.read_text().splitlines()
            lines += [ln for ln in body if not ln.startswith("# bitps-bench")]
        for png in _plots(name, doc, out) if name.startswith("e2e") else []:
            lines += [f"![{png}]({png})", ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path
