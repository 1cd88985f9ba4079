"""``bitps-bench``: the benchmark harness. One sub-command per scenario; each writes
``<out>/<scenario>.json`` and ``<out>/<scenario>.md`` (default ``bench/results``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bitps import __version__
from bitps.bench.report import DEFAULT_OUT

__all__ = ["build_parser", "main"]

_OUT_HELP = "results directory (default bench/results; --quick: bench/results/quick)"


class _Scenarios:
    """The scenario sub-parsers, each also taking ``--out`` (``bitps-bench SCENARIO --out DIR``
    as well as ``bitps-bench --out DIR SCENARIO``). The sub-parser's copy has no default, so
    it overrides the top-level value only when given (argparse lets a sub-parser's default
    overwrite the parent's otherwise)."""

    def __init__(self, action) -> None:
        self._action = action

    def add_parser(self, name: str, **kw) -> argparse.ArgumentParser:
        sp = self._action.add_parser(name, **kw)
        sp.add_argument("--out", type=Path, default=argparse.SUPPRESS, help=_OUT_HELP)
        return sp


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bitps-bench", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"bitps {__version__}")
    p.add_argument("--out", type=Path, default=None, help=_OUT_HELP)
    sub = _Scenarios(p.add_subparsers(dest="scenario", required=True))
    pp = sub.add_parser("pushpull", help="push+pull throughput and round trip vs raw pyzmq")
    pp.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    pp.add_argument("--rounds", type=int, default=7, help="alternating rounds per size")
    pp.add_argument("--small-bytes", type=int, default=1024, help="round-trip payload")
    pp.add_argument("--quick", action="store_true", help="few iterations (smoke test)")
    sub.add_parser("volume", help="bytes per step by codec, by arithmetic (problem's table)")
    cv = sub.add_parser("convergence", help="fp32 Adam vs 1-bit Adam, sparse, sign1 and "
                                             "DiLoCo on the demo")
    cv.add_argument("--steps", type=int, default=600, help="training steps per run")
    cv.add_argument("--freeze-fraction", type=float, default=0.25,
                    help="1-bit Adam warmup as a fraction of the steps")
    cv.add_argument("--lr", type=float, default=3e-3, help="learning rate of every run")
    cv.add_argument("--beta2", type=float, default=0.99, help="Adam beta2 of every run")
    cv.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                    help="model/data seeds; curves are averaged over them")
    cv.add_argument("--sweep-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3],
                    help="learning rates fp32 sync, async and ssp are also run at (asynchrony "
                         "is judged at each one's best)")
    cv.add_argument("--runs", nargs="+", default=[],
                    help="only these runs (by name; the sync fp32 baseline and each run's "
                         "peer come too; checks without their runs are left out)")
    cv.add_argument("--quick", action="store_true", help="40 steps, one seed (smoke test)")
    cd = sub.add_parser("codec", help="codec kernels vs memcpy, numpy and torch (1 thread)")
    cd.add_argument("--mib", type=int, default=64, help="gradient size")
    cd.add_argument("--repeats", type=int, default=7, help="timed calls per implementation")
    cd.add_argument("--quick", action="store_true", help="8 MiB, 2 repeats (smoke test)")
    ov = sub.add_parser("overlap", help="step time, utilization and worker CPU, overlap off/on "
                                         "vs compute only, over a tc-shaped link: one worker, "
                                         "two workers in sync, sign1 with clipping")
    ov.add_argument("--rate", default="1gbit", help="tc tbf rate of the link, each way")
    ov.add_argument("--width", type=int, default=512, help="width of each linear layer")
    ov.add_argument("--depth", type=int, default=16, help="number of linear layers")
    ov.add_argument("--comm-ratios", type=float, nargs="+", default=[0.6, 0.8, 1.0],
                    help="size the batch so communication = this x compute, for each; each "
                         "is checked")
    ov.add_argument("--steps", type=int, default=12, help="measured steps per run")
    ov.add_argument("--bucket-bytes", type=int, default=1 << 20)
    ov.add_argument("--partition-bytes", type=int, default=128 << 10)
    ov.add_argument("--inflight-bytes", type=int, default=2 << 20)
    ov.add_argument("--device", default="auto", help="torch device (auto: cuda if available)")
    ov.add_argument("--quick", action="store_true", help="few steps (smoke test)")
    me = sub.add_parser("memory", help="activation-pool allocators on a dynamic-batch trace, "
                                       "and the pool in training at budgets")
    me.add_argument("--trace-steps", type=int, default=12, help="demo steps recorded")
    me.add_argument("--train-steps", type=int, default=18,
                    help="timed steps per configuration, each beside a pool-off step")
    me.add_argument("--micro", type=int, default=8, help="micro-batches per step (1F1B)")
    me.add_argument("--in-flight", type=int, default=4,
                    help="micro-batches whose activations are alive at once (pipeline depth)")
    me.add_argument("--scale", type=int, default=1024,
                    help="divide the problem's block sizes (4 MiB, 2 GiB) by this")
    me.add_argument("--seed", type=int, default=0)
    me.add_argument("--quick", action="store_true", help="few steps (smoke test)")
    e2 = sub.add_parser("e2e", help="bitps vs DDP on an emulated cluster: samples/s, wire "
                                     "bytes, CPU, time to the target loss")
    e2.add_argument("--model", default="lm", choices=("lm", "moe", "tiny"))
    e2.add_argument("--steps", type=int, default=150, help="steps per worker per run")
    e2.add_argument("--sweep-steps", type=int, default=60,
                    help="steps of each learning-rate sweep point")
    e2.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 6e-4, 1.2e-3],
                    help="learning rates swept for every learning run")
    e2.add_argument("--rate", default="1gbit", help="tc tbf rate of every link, each way")
    e2.add_argument("--placement", default="colocated", choices=("colocated", "own"),
                    help="a shard beside each worker, or shards on nodes of their own")
    e2.add_argument("--straggler", action="store_true",
                    help="worker 1 computes 1.5x slower (sync vs ssp)")
    e2.add_argument("--warmup-frac", type=float, default=0.1,
                    help="linear learning-rate warm-up as a share of the steps (0 = none)")
    e2.add_argument("--clip-norm", type=float, default=1.0,
                    help="gradient clipping of every run (0 = off)")
    e2.add_argument("--freeze-frac", type=float, default=0.2,
                    help="1-bit Adam: warm-up (variance-freeze) share of the steps")
    e2.add_argument("--cases", nargs="+", default=[], help="run only these cases (by name)")
    e2.add_argument("--device", default="cpu", help="torch device of every rank")
    e2.add_argument("--name", default="",
                    help="result file stem (default e2e-<model>[-straggler])")
    e2.add_argument("--quick", action="store_true",
                    help="the demo model, 30 steps, one learning rate (smoke test); results "
                         "under <out>/quick")
    pl = sub.add_parser("pipeline", help="measured pipeline bubbles on sleep-based stages: our "
                                         "schedules vs the simulator and torch's pipelining")
    pl.add_argument("--p", type=int, default=4, help="pipeline stages (one rank each)")
    pl.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16],
                    help="micro-batches per step, each measured")
    pl.add_argument("--t-ms", type=float, nargs=3, default=[40.0, 40.0, 40.0],
                    metavar=("F", "B", "W"), help="sleep of each stage's F, B and W (ms; >= 20: "
                    "the ~1 ms per-action floor measured here is then <= 2.5 %%)")
    pl.add_argument("--rounds", type=int, default=3, help="timed steps per case, alternated")
    pl.add_argument("--flush-free-steps", type=int, default=6,
                    help="steps of the flush-free plan per timed run (steady state: 1..N-2)")
    pl.add_argument("--cases", nargs="+", default=[],
                    help="only these cases (ours: gpipe 1f1b zb-h1 2bw; torch: torch-gpipe "
                         "torch-1f1b torch-zb1p torch-zbv)")
    pl.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=("a", "b", "c"),
                    help="(a) synthetic stages, (b) the deep model on p stages, (c) dp 2 x pp 2 "
                         "through the PS")
    pl.add_argument("--deep-steps", type=int, default=24, help="(b): steps per run")
    pl.add_argument("--dp-pp-steps", type=int, default=150, help="(c): steps per run")
    pl.add_argument("--quick", action="store_true", help="part (a) only, the smallest m, one "
                    "timed step (smoke test)")
    al = sub.add_parser("all", help="every scenario (e2e: the LM, the MoE and the straggler), "
                                     "then the report")
    al.add_argument("--quick", action="store_true",
                    help="every scenario's smoke-test size; results under <out>/quick")
    sub.add_parser("report", help="REPORT.md (claims, tables, plots) from the result files")
    return p


# what ``all`` runs: (scenario argv, also with --quick?)
_ALL = ((["volume"], False), (["pushpull"], True), (["codec"], True), (["overlap"], True),
        (["memory"], True), (["convergence"], True), (["pipeline"], True),
        (["e2e", "--model", "lm"], True),
        (["e2e", "--model", "moe"], False), (["e2e", "--model", "lm", "--straggler"], False))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.scenario == "report":
        from bitps.bench.summary import write_report

        print(write_report(args.out))
        return 0
    if args.scenario != "all":
        return _print(run_scenario(args))
    out = args.out or DEFAULT_OUT
    if args.quick:
        out = out / "quick"
    failed = 0
    for scenario, has_quick in _ALL:
        if args.quick and not has_quick and scenario[0] != "volume":
            continue  # one e2e scenario at smoke-test size
        print(f"== bitps-bench {' '.join(scenario)}", flush=True)
        sub_args = build_parser().parse_args(
            ["--out", str(out), *scenario, *(["--quick"] if args.quick and has_quick else [])])
        failed += _print(run_scenario(sub_args))
    from bitps.bench.summary import write_report

    print(write_report(out))
    return 1 if failed else 0


def run_scenario(args) -> dict:
    """Run the scenario ``args`` name; its result (rows and checks). Smoke-test results
    (``--quick``) go under ``<results>/quick`` unless ``--out`` names a folder: they never
    overwrite a full run's."""
    if getattr(args, "quick", False) and args.out is None:
        args.out = DEFAULT_OUT / "quick"
    if args.scenario == "pushpull":
        from bitps.bench.pushpull import run

        result = run(sizes_mib=tuple(args.sizes_mib), rounds=args.rounds,
                     small_bytes=args.small_bytes, out=args.out, quick=args.quick)
    elif args.scenario == "volume":
        from bitps.bench.volume import run

        result = run(out=args.out)
    elif args.scenario == "convergence":
        from bitps.bench.convergence import run

        steps, seeds = (40, (0,)) if args.quick else (args.steps, tuple(args.seeds))
        result = run(steps=steps, freeze_fraction=args.freeze_fraction, lr=args.lr,
                     beta2=args.beta2, seeds=seeds, sweep_lrs=tuple(args.sweep_lrs),
                     out=args.out, only=tuple(args.runs))
    elif args.scenario == "memory":
        from bitps.bench.memory import run

        result = run(trace_steps=args.trace_steps, train_steps=args.train_steps,
                     micro=args.micro, in_flight=args.in_flight, scale=args.scale,
                     seed=args.seed, out=args.out, quick=args.quick)
    elif args.scenario == "e2e":
        from bitps.bench.e2e import run

        name = args.name or ("e2e-" + ("tiny" if args.quick else args.model)
                             + ("-straggler" if args.straggler else ""))
        result = run(model=args.model, steps=args.steps, sweep_steps=args.sweep_steps,
                     lrs=tuple(args.lrs), rate=args.rate, placement=args.placement,
                     straggler=args.straggler, cases=tuple(args.cases), device=args.device,
                     warmup_frac=args.warmup_frac, clip_norm=args.clip_norm,
                     freeze_frac=args.freeze_frac, out=args.out, quick=args.quick, name=name)
    elif args.scenario == "overlap":
        from bitps.bench.overlap import run

        result = run(rate=args.rate, width=args.width, depth=args.depth,
                     comm_ratios=tuple(args.comm_ratios), steps=args.steps,
                     bucket_bytes=args.bucket_bytes, partition_bytes=args.partition_bytes,
                     inflight_bytes=args.inflight_bytes, device=args.device, out=args.out,
                     quick=args.quick)
    elif args.scenario == "pipeline":
        from bitps.bench.pipeline import run

        ms, rounds = ((min(args.ms),), 1) if args.quick else (tuple(args.ms), args.rounds)
        t_f, t_b, t_w = (t / 1e3 for t in args.t_ms)
        result = run(p=args.p, ms=ms, t_f=t_f, t_b=t_b, t_w=t_w, rounds=rounds,
                     cases=tuple(args.cases), flush_free_steps=args.flush_free_steps,
                     parts=("a",) if args.quick else tuple(args.parts),
                     deep_steps=args.deep_steps, dp_pp_steps=args.dp_pp_steps, out=args.out,
                     quick=args.quick)
    else:
        from bitps.bench.codec import run

        mib, repeats = (8, 2) if args.quick else (args.mib, args.repeats)
        result = run(mib=mib, repeats=repeats, out=args.out)
    return result


def _print(result: dict) -> int:
    for row in result["rows"]:
        print(row)
    failed = [name for name, c in result["checks"].items() if not c["ok"]]
    for name, c in result["checks"].items():
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name}: {c['value']} (goal {c['goal']})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
