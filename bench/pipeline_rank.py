"""One rank of ``bitps-bench pipeline`` (a): ``python -m bitps.bench.pipeline_rank '<json>'``
with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). It joins a gloo group,
builds every case's stages on :class:`~bitps.worker.pipeline.synthetic.SleepStage` (torch's
``PipelineStage`` + schedule, or our ``StageRuntime`` + action list), runs the cases in
rounds (a barrier before each step, every case once per round, the first round a warm-up),
and prints one JSON line: per case and round, this rank's step start and end
(``time.perf_counter``, one clock for every process of the machine), busy seconds, mean F/B/W
durations, peak in-flight micro-batches and the intervals themselves, read from the stage
recorder.

Settings (the JSON): ``p``, ``ms`` (micro-batch counts), ``t_f``/``t_b``/``t_w`` (seconds),
``rows``/``width`` (one micro-batch's shape), ``rounds`` (timed), ``warmup``, ``cases`` (names
from :data:`CASES`), ``flush_free_steps``, ``nice`` (the ranks' priority), ``timeout_s``.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import time

__all__ = ["CASES", "OUR_CASES", "TORCH_CASES", "main"]

TORCH_CASES = ("torch-gpipe", "torch-1f1b", "torch-zb1p", "torch-zbv")
"""torch.distributed.pipelining's schedules: GPipe, 1F1B, ``ScheduleInterleavedZeroBubble``
with one stage per rank (ZB1P) and ``ScheduleZBVZeroBubble`` (two half-size stages per rank)."""
OUR_CASES = ("gpipe", "1f1b", "zb-h1", "zb-v", "2bw")
"""Our schedules (``pipeline.schedules``) run by our ``StageRuntime``; a flush-free one runs
``flush_free_steps`` steps as one plan per timed step."""
CASES = TORCH_CASES + OUR_CASES


def _loss(out, target):
    return (out - target).square().mean()


class _TorchCase:
    """One torch schedule at one m: this rank's stages (stage index -> share of one rank's
    work), the schedule object and the step's inputs."""

    def __init__(self, name: str, m: int, s: dict, rank: int) -> None:
        import torch
        from torch.distributed import pipelining as pp

        from bitps.worker.pipeline.synthetic import SleepStage

        p = s["p"]
        self.name, self.m, self.rank = name, m, rank
        chunks = (rank, 2 * p - 1 - rank) if name == "torch-zbv" else (rank,)
        num_stages = p * len(chunks)
        share = 1.0 / len(chunks)
        shape = (s["rows"], s["width"])
        self.weights = {idx: share for idx in chunks}
        stages = []
        for idx in chunks:
            module = SleepStage(s["t_f"] * share, s["t_b"] * share, s["t_w"] * share, stage=idx)
            # static mode: examples without requires_grad make torch send or expect no gradient
            stages.append(pp.PipelineStage(
                module, idx, num_stages, torch.device("cpu"),
                input_args=(torch.zeros(shape, requires_grad=True),),
                output_args=(torch.zeros(shape, requires_grad=True),)))
        if name == "torch-gpipe":
            self.schedule = pp.ScheduleGPipe(stages[0], m, loss_fn=_loss)
        elif name == "torch-1f1b":
            self.schedule = pp.Schedule1F1B(stages[0], m, loss_fn=_loss)
        elif name == "torch-zb1p":
            self.schedule = pp.ScheduleInterleavedZeroBubble(stages, m, loss_fn=_loss)
        elif name == "torch-zbv":
            self.schedule = pp.ScheduleZBVZeroBubble(stages, m, loss_fn=_loss)
        else:
            raise ValueError(f"case {name!r}: expected one of {TORCH_CASES}")
        gen = torch.Generator().manual_seed(m)
        full = (s["rows"] * m, s["width"])
        # stage 0's input requires grad, so its B (the input gradient) runs and costs t_b
        self.x = torch.randn(full, generator=gen).requires_grad_(True)
        self.target = torch.randn(full, generator=gen)
        self.first = 0 in chunks
        self.last = num_stages - 1 in chunks
        self.modules = [st.submod for st in stages]

    def step(self) -> None:
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.target, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)
        self.x.grad = None


class _OurCase:
    """One of our schedules at one m: this rank's action list of the plan, its
    ``StageRuntime`` over a SleepStage and the micro-batches of the plan's steps."""

    def __init__(self, name: str, m: int, s: dict, rank: int) -> None:
        import torch

        from bitps.worker.pipeline.actions import virtual_stage
        from bitps.worker.pipeline.runtime import StageContext, StageRuntime
        from bitps.worker.pipeline.schedules import get_schedule
        from bitps.worker.pipeline.synthetic import SleepStage

        p = s["p"]
        schedule = get_schedule(name)
        steps = 1 if schedule.flushes else s["flush_free_steps"]
        self.name, self.m, self.rank, self.steps = name, m, rank, steps
        self.actions = schedule.generate(p, m, steps=steps)[rank]
        ctx = StageContext(stage=rank, num_stages=p, prev_rank=rank - 1 if rank else None,
                           next_rank=rank + 1 if rank < p - 1 else None,
                           timeout_s=s["timeout_s"])
        if schedule.chunks == 1:
            last = rank == p - 1
            self.weights = {rank: 1.0}
            self.modules = [SleepStage(s["t_f"], s["t_b"], s["t_w"], stage=rank)]
            self.runtime = StageRuntime(ctx, self.modules[0], loss_fn=_loss if last else None)
        else:
            # a V of 2 chunks per rank, each half a stage's work (as torch-zbv's); rank 0 holds
            # the first and the last virtual stage: it feeds the inputs and takes the loss
            last = rank == 0
            share = 1.0 / schedule.chunks
            stages = [virtual_stage(rank, c, p) for c in range(schedule.chunks)]
            self.weights = {v: share for v in stages}
            self.modules = [SleepStage(s["t_f"] * share, s["t_b"] * share, s["t_w"] * share,
                                       stage=v) for v in stages]
            self.runtime = StageRuntime(ctx, self.modules, loss_fn=_loss if last else None)
        gen = torch.Generator().manual_seed(m)
        shape = (s["rows"], s["width"])
        xs = [torch.randn(shape, generator=gen) for _ in range(steps * m)]
        ts = [torch.randn(shape, generator=gen) for _ in range(steps * m)]
        self.inputs = xs if rank == 0 else None
        self.targets = ts if last else None
        self.report = None

    def step(self) -> None:
        self.report = self.runtime.run_step(self.actions, self.inputs, self.targets)
        for module in self.modules:
            module.zero_grad(set_to_none=True)


def _comm_one_way_s(rank: int, shape: tuple[int, int], repeats: int = 20) -> float:
    """One-way time of one micro-batch's activation between ranks 0 and 1 (half a ping-pong
    round trip, median), the transfer cost the simulator is given. Other ranks return 0."""
    import statistics

    import torch
    import torch.distributed as dist

    buf = torch.zeros(shape)
    spans = []
    for _ in range(repeats):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(buf, 1)
            dist.recv(buf, 1)
            spans.append((time.perf_counter() - t0) / 2)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return statistics.median(spans) if spans else 0.0


def _link_one_way_s(rank: int, shape: tuple[int, int], timeout_s: float,
                    repeats: int = 20) -> float:
    """The same through our runtime's ``StageLink`` (header and tensor, posted receives): the
    transfer cost our simulator is given for our schedules. Other ranks return 0."""
    import statistics

    import torch

    from bitps.worker.pipeline.p2p import Direction, Peer, StageLink

    if rank > 1:
        return 0.0
    other = Peer(stage=1 - rank, replica=0, rank=1 - rank)
    out, back = ((Direction.TO_NEXT, Direction.FROM_NEXT) if rank == 0
                 else (Direction.TO_PREV, Direction.FROM_PREV))
    link = StageLink({out: other, back: other}, device=torch.device("cpu"), timeout_s=timeout_s)
    link.expect(back, range(repeats))
    buf, spans = torch.zeros(shape), []
    for k in range(repeats):
        t0 = time.perf_counter()
        if rank == 0:
            link.send(out, k, buf)
            link.recv(back, k)
            spans.append((time.perf_counter() - t0) / 2)
        else:
            link.send(out, k, link.recv(back, k))
    link.finish()
    return statistics.median(spans) if spans else 0.0


def _record(case, round_no: int, t0: float, t1: float) -> dict:
    from bitps.worker.pipeline.synthetic import RECORDER

    # a flush-free plan's steady state is cut from the intervals; the gaps show the overhead
    extra = {"intervals": [(iv.kind, iv.start, iv.end) for iv in RECORDER.intervals(t0)]}
    report = getattr(case, "report", None)
    if report is not None:
        extra.update(runtime_bubble=report.bubble, runtime_wall_s=report.wall_s,
                     runtime_peak_inflight=report.peak_inflight)
    return {"case": case.name, "m": case.m, "round": round_no, "start": t0, "end": t1, **extra,
            "busy_s": RECORDER.busy_s(t0),
            **{f"t_{k.lower()}_s": RECORDER.mean_s(k, t0) for k in ("F", "B", "W")},
            "peak_inflight": RECORDER.peak_inflight(t0, weights=case.weights),
            "peak_held": RECORDER.peak_inflight(t0, until="W", weights=case.weights)}


def _raise_priority(nice: int) -> int | str:
    """Run at ``nice`` (negative: ahead of other work): the stages sleep most of the time, and
    a loaded machine's CPU-bound work otherwise delays each wake-up by milliseconds, which the
    bubble would count. The nice value in force, or why it could not be set."""
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError as err:
            return f"not set ({err.strerror})"
    return os.getpriority(os.PRIO_PROCESS, 0)


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from bitps.worker.pipeline.synthetic import RECORDER

    s = json.loads((argv or sys.argv[1:])[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != s["p"]:
        raise ValueError(f"WORLD_SIZE={world}: expected p={s['p']} (one rank per stage)")
    # a wedged schedule dumps every thread's stack before the parent's deadline
    faulthandler.dump_traceback_later(s["timeout_s"], exit=True)
    nice = _raise_priority(s.get("nice", 0))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=s["timeout_s"]))
    try:
        comm_s = _comm_one_way_s(rank, (s["rows"], s["width"]))
        dist.barrier()
        link_s = _link_one_way_s(rank, (s["rows"], s["width"]), s["timeout_s"])
        dist.barrier()
        cases, refused = [], {}
        for name in s["cases"]:
            for m in s["ms"]:
                make = _TorchCase if name in TORCH_CASES else _OurCase
                try:
                    cases.append(make(name, m, s, rank))
                except ValueError as err:  # the schedule refuses this m: report it
                    refused[f"{name} m={m}"] = str(err)
        records = []
        for round_no in range(s["warmup"] + s["rounds"]):
            for case in cases:
                dist.barrier()
                RECORDER.clear()
                t0 = time.perf_counter()
                case.step()
                t1 = time.perf_counter()
                if round_no >= s["warmup"]:
                    records.append(_record(case, round_no - s["warmup"], t0, t1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "nice": nice, "comm_s": comm_s, "link_s": link_s,
                      "refused": refused,
                      "records": records}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
