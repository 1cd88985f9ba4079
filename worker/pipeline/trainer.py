"""One pipeline stage process's run: join the process group, build the whole model and keep
this stage's part(s), register their keys with the shards, train ``--steps`` steps of the
schedule through ``StageRuntime`` and report progress through ``emit``.

:func:`run_stage` is what ``bitps-pipeline`` (``worker/pipeline/__main__.py``) runs once its
settings are read and the plan is checked (``worker/pipeline/settings.py``). Imports torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Sequence

from bitps.worker.pipeline.settings import StageProcessConfig, resolve_device

__all__ = ["run_stage"]


def run_stage(cfg: StageProcessConfig, emit) -> int:
    """Join the process group, build and place this stage, train ``--steps`` steps."""
    import torch
    import torch.distributed as dist

    run, par = cfg.run, cfg.parallel
    torch.set_num_threads(run.threads)
    device = resolve_device(run)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{cfg.stage.master_addr}:{cfg.stage.master_port}",
        rank=cfg.client.rank, world_size=cfg.client.world_size,
        timeout=datetime.timedelta(seconds=max(60.0, cfg.stage.p2p_timeout_s)))
    try:
        # Every rank creates every replica's group, in one order (new_group is collective).
        groups = [dist.new_group(list(range(r * par.pipeline_parallel_size,
                                            (r + 1) * par.pipeline_parallel_size)))
                  for r in range(par.data_parallel_size)]
        return _Stage(cfg, device, groups[cfg.replica], emit).train()
    finally:
        dist.destroy_process_group()


class _Stage:
    """One stage process's model part(s), shards, runtime and step loop.

    With a one-chunk schedule the model is cut into P parts and stage ``s`` holds part ``s``.
    With ``zb-v`` (``Schedule.chunks == 2``) it is cut into 2P parts (virtual stages) and stage
    ``s`` holds parts ``s`` and ``2P - 1 - s`` (``actions.virtual_stage``): stage 0 then both
    feeds the inputs (to its chunk 0) and computes the loss (on its chunk 1), and stage P - 1
    has no data at all. ``feeds``/``scores`` say which of the two this stage does.
    """

    def __init__(self, cfg: StageProcessConfig, device, group, emit) -> None:
        from prometheus_client import start_http_server

        from bitps.worker.pipeline.actions import virtual_stage
        from bitps.worker.pipeline.metrics import StageMetrics
        from bitps.worker.pipeline.models import MODELS, chunk_holder, stage_module, whole_plan
        from bitps.worker.pipeline.runtime import StageContext, StageRuntime
        from bitps.worker.pipeline.schedules import get_schedule
        from bitps.worker.training.model import PSModel
        from bitps.worker.transport.client import PSClient

        self.cfg, self.device, self.group, self.emit = cfg, device, group, emit
        par, rank = cfg.parallel, cfg.client.rank
        self.p, self.stage, self.replica = par.pipeline_parallel_size, cfg.stage_index, cfg.replica
        self.chunks = get_schedule(par.schedule).chunks
        self.virtual_stages = [virtual_stage(self.stage, c, self.p) for c in range(self.chunks)]
        # The first virtual stage takes the inputs, the last one the targets and the loss:
        # stages 0 and P - 1, or with a V both on stage 0 (its chunks 0 and 1).
        self.feeds = 0 in self.virtual_stages
        self.scores = self.chunks * self.p - 1 in self.virtual_stages
        self.spec = MODELS[cfg.stage.model]
        model = self.spec.build(seed=cfg.stage.seed)
        self.ranges, self.costs = self._partition(model)
        self.layers = [self.ranges[v] for v in self.virtual_stages]
        parts = [stage_module(model, layers) for layers in self.layers]
        # The PSModel's module: the part, or one holding both chunks' layers under the whole
        # model's names (moving it moves the chunks: the same module objects).
        self.module = (parts[0] if self.chunks == 1 else chunk_holder(parts)).to(device)
        # Replica 0 of each stage sends its keys' initial values: one sender per key.
        self.client = PSClient(dataclasses.replace(cfg.client, initializes=self.replica == 0))
        plan = whole_plan(model, self.client.num_shards, self.client.cfg.partition_bytes)
        self.ps_model = PSModel(self.module, self.client, plan=plan, encoder=cfg.encoder)
        self.metrics = StageMetrics(self.stage, self.replica, registry=self.client.metrics.registry)
        self.metrics_port = -1
        if cfg.run.metrics_port >= 0:
            httpd, _ = start_http_server(cfg.run.metrics_port, addr=cfg.run.metrics_host,
                                         registry=self.client.metrics.registry)
            self.metrics_port = httpd.server_port
        ctx = StageContext(stage=self.stage, num_stages=self.p, replica=self.replica,
                           prev_rank=None if self.stage == 0 else rank - 1,
                           next_rank=None if self.stage == self.p - 1 else rank + 1,
                           device=device, timeout_s=cfg.stage.p2p_timeout_s)
        predictor = None
        if par.weight_prediction > 0 and not get_schedule(par.schedule).flushes:
            from bitps.worker.pipeline.prediction import WeightPredictor

            predictor = WeightPredictor(par.weight_prediction)
        self.runtime = StageRuntime(ctx, parts[0] if self.chunks == 1 else parts,
                                    loss_fn=self.spec.loss if self.scores else None,
                                    ps_model=self.ps_model, metrics=self.metrics,
                                    predictor=predictor)
        self.sizes = self._micro_batching()

    def _partition(self, model) -> tuple[list[range], list[float] | None]:
        """Every virtual stage's layers (chunks x P parts; P for a one-chunk schedule):
        measured on global rank 0 and broadcast (``profile``), or equal counts (``uniform``,
        the same everywhere without a message)."""
        from bitps.worker.pipeline.partition import balance, uniform
        from bitps.worker.pipeline.profile import broadcast_partition, profile_layers

        par = self.cfg.parallel
        parts = self.chunks * self.p
        if par.balance == "uniform":
            return uniform(len(model), parts), None
        costs = ranges = None
        if self.cfg.client.rank == 0:
            x, y = next(self.spec.batches(par.micro_batch_size, replica=0, replicas=1,
                                          seed=self.cfg.stage.seed + 1))
            model.to(self.device)
            costs = profile_layers(model, x.to(self.device), y.to(self.device),
                                   self.cfg.stage.profile_repeats, loss_fn=self.spec.loss)
            ranges = balance(costs, parts)
        return broadcast_partition(ranges, src=0), costs

    def _micro_batching(self):
        from bitps.worker.pipeline.microbatch import MicroBatchTuner
        from bitps.worker.pipeline.tuning import DynamicMicroBatch, FixedMicroBatch

        par = self.cfg.parallel
        if not par.dynamic_micro_batch:
            return FixedMicroBatch(par.micro_batch_size, par.replica_batch)
        tuner = MicroBatchTuner.from_config(par)
        return DynamicMicroBatch(tuner, num_stages=self.p, group=self.group)

    def _data(self):
        """This replica's step batches (``(inputs, targets)`` of the replica batch), on the
        device; a side thread prepares them ahead with look-ahead (on the feeding stage, which
        with ``zb-v`` also takes the targets). None on stages that neither feed nor score
        (middle stages; with ``zb-v`` every stage but 0)."""
        if not (self.feeds or self.scores):
            return None
        par = self.cfg.parallel
        stream = self.spec.batches(par.replica_batch, replica=self.replica,
                                   replicas=par.data_parallel_size, seed=self.cfg.stage.seed)
        device = self.device

        def to_device(batch):
            return tuple(t.to(device, non_blocking=True) for t in batch)

        if par.lookahead and self.feeds:
            from bitps.worker.pipeline.lookahead import Prefetcher

            return Prefetcher(stream, prepare=to_device, depth=2, device=device)
        return (to_device(b) for b in stream)

    def _layers_text(self) -> str:
        """This stage's layers as ``"a-b"`` (inclusive), per chunk joined by ``","``."""
        return ",".join(f"{r.start}-{r.stop - 1}" for r in self.layers)

    def train(self) -> int:
        cfg, run, par = self.cfg, self.cfg.run, self.cfg.parallel
        params = sum(p.numel() for p in self.module.parameters())
        self.emit(event="start", rank=cfg.client.rank, replica=self.replica, stage=self.stage,
                  steps=run.steps, layers=self._layers_text(),
                  virtual_stages=self.virtual_stages, computes_loss=self.scores,
                  partition=[[r.start, r.stop] for r in self.ranges], costs=self.costs,
                  params=params, keys=len(self.ps_model.keys), metrics_port=self.metrics_port,
                  device=str(self.device), schedule=par.schedule)
        from bitps.worker.pipeline.schedules import get_schedule

        schedule = get_schedule(par.schedule)
        data = self._data()
        t_start = time.perf_counter()
        try:
            steps = self._flushing(schedule, data) if schedule.flushes else \
                self._flush_free(schedule, data)
        except BaseException:
            # Leave every shard now, waiting for nothing in flight: in sync mode the other
            # replicas' pushes of these keys stop waiting for this stage at once.
            self.client.close()
            raise
        finally:
            if hasattr(data, "close"):
                data.close()
        wall = time.perf_counter() - t_start
        self.ps_model.close()
        losses = [s["loss"] for s in steps if s["loss"] is not None]
        recent = losses[-10:]
        busy = sum(s["busy_s"] for s in steps)
        self.emit(event="done", rank=cfg.client.rank, replica=self.replica, stage=self.stage,
                  layers=self._layers_text(), computes_loss=self.scores, steps=len(steps),
                  first_loss=losses[0] if losses else None,
                  final_loss=sum(recent) / len(recent) if recent else None,
                  last_loss=losses[-1] if losses else None, seconds=wall,
                  samples_per_s=len(steps) * par.replica_batch / wall,
                  bubble=1 - busy / sum(s["wall_s"] for s in steps) if steps else 0.0,
                  micro_batch_size=steps[-1]["micro_batch_size"] if steps else self.sizes.size,
                  micro_batch_sizes=[s["micro_batch_size"] for s in steps],
                  p2p_bytes_sent=sum(s["p2p_bytes_sent"] for s in steps),
                  p2p_bytes_received=sum(s["p2p_bytes_received"] for s in steps))
        return 0

    def _flushing(self, schedule, data) -> list[dict]:
        """One ``run_step`` per step; the micro-batch size may change between steps."""
        plans: dict[int, list] = {}
        out = []
        for step in range(self.cfg.run.steps):
            b = self.sizes.size
            m = self.sizes.samples_per_step // b
            if m not in plans:
                plans[m] = schedule.generate(self.p, m)[self.stage]
            x, y = next(data) if data is not None else (None, None)
            report = self.runtime.run_step(
                plans[m], inputs=list(x.split(b)) if self.feeds else None,
                targets=list(y.split(b)) if self.scores else None)
            self.sizes.after_step(report.times, report.wall_s)
            out.append(self._step_event(step, report, report.losses, b))
        return out

    def _flush_free(self, schedule, data) -> list[dict]:
        """One ``run_step`` over every step's micro-batches (no flush to cut the plan at)."""
        steps, b = self.cfg.run.steps, self.sizes.size
        m = self.sizes.samples_per_step // b
        xs, ys = [], []
        if data is not None:
            for _ in range(steps):
                x, y = next(data)
                xs += list(x.split(b))
                ys += list(y.split(b))
        report = self.runtime.run_step(schedule.generate(self.p, m, steps)[self.stage],
                                       inputs=xs if self.feeds else None,
                                       targets=ys if self.scores else None)
        # One report for the whole run: each step's event carries its share of it.
        share = dataclasses.replace(report, wall_s=report.wall_s / steps,
                                    busy_s=report.busy_s / steps,
                                    p2p_bytes_sent=report.p2p_bytes_sent // steps,
                                    p2p_bytes_received=report.p2p_bytes_received // steps)
        return [self._step_event(k, share, report.losses[k * m:(k + 1) * m], b)
                for k in range(steps)]

    def _step_event(self, step: int, report, losses: Sequence[float], b: int) -> dict:
        run = self.cfg.run
        event = dict(event="step", rank=self.cfg.client.rank, replica=self.replica,
                     stage=self.stage, step=step,
                     loss=sum(losses) / len(losses) if losses else None,
                     wall_s=report.wall_s, busy_s=report.busy_s,
                     bubble=1 - report.busy_s / report.wall_s if report.wall_s > 0 else 0.0,
                     micro_batch_size=b, next_micro_batch_size=self.sizes.size,
                     samples_per_s=self.sizes.samples_per_step / report.wall_s,
                     p2p_bytes_sent=report.p2p_bytes_sent,
                     p2p_bytes_received=report.p2p_bytes_received)
        if step % run.log_every == 0 or step == run.steps - 1:
            self.emit(**event)
        return event
