"""``bitps-bench``: the benchmark harness. One sub-command per scenario; each writes
``<out>/<scenario>.json`` and ``<out>/<scenario>.md`` (default ``bench/results``).

A sub-command's options are the fields of its dataclass in ``bench/config.py``, read by
``bench/options.py``; :data:`SCENARIOS` names each sub-command's dataclass and what runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitps import __version__
from bitps.bench import config
from bitps.bench.options import HelpFormatter, add_options, from_args
from bitps.bench.report import DEFAULT_OUT

__all__ = ["SCENARIOS", "Scenario", "build_parser", "main", "run_scenario"]

_DESCRIPTION = ("The benchmark harness: one sub-command per scenario, each writing "
                "<out>/<scenario>.json and .md.")
_OUT_HELP = "results directory (default bench/results; --quick: bench/results/quick)"


@dataclass(frozen=True)
class Scenario:
    """One sub-command of ``bitps-bench``."""

    config: type
    """Its options: a dataclass of ``bench/config.py``."""
    run: Callable[[Any, Path | None], int]
    """Runs it with an instance of :attr:`config` and ``--out`` (``None``: the default);
    returns the exit status (1: a check failed)."""
    help: str
    """One line for ``bitps-bench --help`` and the reference."""


def _measured(module: str) -> Callable[[Any, Path | None], int]:
    """A scenario that ``module.run(cfg, out=...)`` measures. The module is imported when the
    scenario runs, so that ``--help`` and the docs load no torch, numba or zmq. Smoke-test
    results (``quick``) go under ``<results>/quick`` unless ``--out`` names a folder: they
    never overwrite a full run's."""

    def run(cfg: Any, out: Path | None) -> int:
        if getattr(cfg, "quick", False) and out is None:
            out = DEFAULT_OUT / "quick"
        return _print(importlib.import_module(module).run(cfg, out=out))

    return run


def _run_all(cfg: config.AllBench, out: Path | None) -> int:
    out = (out or DEFAULT_OUT) / ("quick" if cfg.quick else "")
    failed = 0
    for name, options, in_quick in _ALL:
        if cfg.quick and not in_quick:
            continue  # one e2e scenario at smoke-test size
        scenario = SCENARIOS[name]
        if cfg.quick and "quick" in {f.name for f in dataclasses.fields(scenario.config)}:
            options = {**options, "quick": True}
        flags = (f"--{k}" + ("" if v is True else f" {v}") for k, v in options.items())
        print(f"== bitps-bench {' '.join([name, *flags])}", flush=True)
        failed += scenario.run(scenario.config(**options), out)
    _run_report(config.ReportBench(), out)
    return 1 if failed else 0


def _run_report(cfg: config.ReportBench, out: Path | None) -> int:
    from bitps.bench.summary import write_report

    print(write_report(out))
    return 0


def _chaos_config() -> type:
    # its options live beside the soak (bench/chaos.py imports no zmq or torch at import)
    from bitps.bench.chaos import ChaosBench

    return ChaosBench


SCENARIOS = {
    "pushpull": Scenario(config.PushPullBench, _measured("bitps.bench.pushpull"),
                         "push+pull throughput and round trip vs raw pyzmq"),
    "volume": Scenario(config.VolumeBench, _measured("bitps.bench.volume"),
                       "bytes per step by codec, by arithmetic (problem's table)"),
    "convergence": Scenario(config.ConvergenceBench, _measured("bitps.bench.convergence"),
                            "fp32 Adam vs 1-bit Adam, sparse, sign1 and DiLoCo on the demo"),
    "codec": Scenario(config.CodecBench, _measured("bitps.bench.codec"),
                      "codec kernels vs memcpy, numpy and torch (1 thread)"),
    "kernels": Scenario(config.KernelsBench, _measured("bitps.bench.kernels"),
                        "a shard's CPU per update of each rule and codec against the memory-"
                        "bandwidth floor (1 thread)"),
    "overlap": Scenario(config.OverlapBench, _measured("bitps.bench.overlap"),
                        "step time, utilization and worker CPU, overlap off/on vs compute "
                        "only, over a tc-shaped link: one worker, two workers in sync, sign1 "
                        "with clipping"),
    "memory": Scenario(config.MemoryBench, _measured("bitps.bench.memory"),
                       "activation-pool allocators on a dynamic-batch trace, and the pool in "
                       "training at budgets"),
    "e2e": Scenario(config.E2EBench, _measured("bitps.bench.e2e"),
                    "bitps vs DDP on an emulated cluster: samples/s, wire bytes, CPU, time to "
                    "the target loss"),
    "pipeline": Scenario(config.PipelineBench, _measured("bitps.bench.pipeline"),
                         "measured pipeline bubbles on sleep-based stages: our schedules vs "
                         "the simulator and torch's pipelining"),
    "scale": Scenario(config.ScaleBench, _measured("bitps.bench.scale"),
                      "step time and shards needed from per-byte costs measured here, "
                      "checked on the emulated cluster, extrapolated to 64 workers"),
    "chaos": Scenario(_chaos_config(), _measured("bitps.bench.chaos"),
                      "a 2 x 2 job soaked under a seeded schedule of shard, worker and network "
                      "faults: faults survived, updates lost, sync equality, RSS/threads/fds"),
    "compare": Scenario(config.CompareBench, _measured("bitps.bench.compare"),
                        "the same scenarios from this checkout and another (e.g. the previous "
                        "commit), alternated: every figure's ratio and the rounds' noise"),
    "all": Scenario(config.AllBench, _run_all,
                    "every scenario (e2e: the LM, the MoE and the straggler), then the report"),
    "report": Scenario(config.ReportBench, _run_report,
                       "REPORT.md (claims, tables, plots) from the result files"),
}
"""Every sub-command, in ``--help`` order."""

# what ``all`` runs, in order: (scenario, its options, also under ``all --quick``?)
_ALL = (("volume", {}, True), ("pushpull", {}, True), ("codec", {}, True), ("kernels", {}, True),
        ("overlap", {}, True), ("memory", {}, True), ("convergence", {}, True),
        ("pipeline", {}, True), ("e2e", {"model": "lm"}, True),
        ("e2e", {"model": "moe"}, False), ("e2e", {"model": "lm", "straggler": True}, False))


def build_parser() -> argparse.ArgumentParser:
    """The whole command line. Each sub-command also takes ``--out`` (``bitps-bench SCENARIO
    --out DIR`` as well as ``bitps-bench --out DIR SCENARIO``); the sub-parser's copy has no
    default, so it overrides the top-level value only when given (argparse lets a
    sub-parser's default overwrite the parent's otherwise)."""
    p = argparse.ArgumentParser(prog="bitps-bench", description=_DESCRIPTION)
    p.add_argument("--version", action="version", version=f"bitps {__version__}")
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help=_OUT_HELP)
    sub = p.add_subparsers(dest="scenario", required=True)
    for name, scenario in SCENARIOS.items():
        sp = sub.add_parser(name, help=scenario.help, description=scenario.help,
                            formatter_class=HelpFormatter)
        sp.add_argument("--out", type=Path, default=argparse.SUPPRESS, metavar="DIR",
                        help=_OUT_HELP)
        add_options(sp, scenario.config)
    return p


def run_scenario(args: argparse.Namespace) -> int:
    """Run the sub-command ``args`` (from :func:`build_parser`) names; its exit status."""
    scenario = SCENARIOS[args.scenario]
    return scenario.run(from_args(scenario.config, args), args.out)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(build_parser().parse_args(argv))


def _print(result: dict) -> int:
    for row in result["rows"]:
        print(row)
    failed = [name for name, c in result["checks"].items() if not c["ok"]]
    for name, c in result["checks"].items():
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name}: {c['value']} (goal {c['goal']})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
