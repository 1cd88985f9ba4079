"""``python -m bitps.worker.pipeline``: one pipeline stage process.

Started by ``bitps-launch --dp D --pp P`` or by torchrun, it reads torchrun's environment:
``RANK``, ``WORLD_SIZE`` (= D x P), ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``. Rank ``r``
is stage ``r % P`` of replica ``r // P``. Every setting is a flag with an environment twin and
a key of the ``--config`` TOML file (``bitps.proto.settings``: flag > environment > file >
default); the parallel layout (``ParallelConfig``) may also come as the file's
``[parallel_config]`` table, spelled as the problem statement's dict::

    [parallel_config]
    data_parallel_size = 2
    pipeline_parallel_size = 4
    micro_batch_size = 8
    gradient_accumulation_steps = 4

The plan is checked (``ParallelConfig.check`` against the model's layer count, and the
schedule's deadlock guard) before ``torch.distributed`` is initialised: a refused one exits 2
with the error, having talked to nobody.

Then: build the whole model from the seed, partition its layers (profiled: global rank 0
measures and broadcasts; or uniform) into P parts, or 2P with ``zb-v`` (stage ``r`` keeps parts
``r`` and ``2P - 1 - r``), keep this stage's layers, register their keys with the
shards (a ``PSClient`` of world size D x P; replica 0 of each stage sends initial values),
run ``--steps`` steps of the schedule through ``StageRuntime``, and (dynamic micro-batching)
adopt a new micro-batch size between steps. With ``--json`` it prints one JSON object per line:
``start``, ``step`` (every ``--log-every`` steps), ``done`` (``final_loss`` = mean of the last
10 steps' losses, on the stage that computes the loss: ``computes_loss``, stage P - 1, or stage
0 with ``zb-v``), or ``error`` naming the error before exiting 1. SIGTERM
ends the run where it is: the stage leaves every shard (so the shards stop waiting for its
keys' pushes), prints ``terminated`` and exits 0; a second SIGTERM kills it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from bitps.proto.codecs import CodecConfig
from bitps.proto.settings import Program, from_field, option
from bitps.worker.config import ClientConfig, EncoderConfig, RunConfig, connection_settings
from bitps.worker.pipeline.config import ParallelConfig

__all__ = ["StageConfig", "StageProcessConfig", "main", "parse_config", "program"]

_TABLE = "parallel_config"


@dataclasses.dataclass(kw_only=True, frozen=True)
class StageConfig:
    """What a stage process needs beyond the client, the run and the parallel layout."""

    model: str = "mlp"
    """The ``models.MODELS`` entry to train."""
    seed: int = 0
    """Seeds the whole model's weights (same on every rank) and, with the replica, the data."""
    master_addr: str = "127.0.0.1"
    """torch.distributed rendezvous host (torchrun's MASTER_ADDR)."""
    master_port: int = 29500
    """torch.distributed rendezvous port (torchrun's MASTER_PORT)."""
    p2p_timeout_s: float = 60.0
    """Seconds a stage waits for a peer's activation or gradient before naming it failed."""
    profile_repeats: int = 5
    """Timed runs per layer when balancing by profile (their median counts)."""
    global_batch: int = 0
    """Samples per step over all replicas, if the caller fixes it: it must equal
    D x micro_batch_size x m (0: whatever those make)."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.p2p_timeout_s <= 0:
            raise ValueError(f"p2p_timeout_s must be > 0, got {self.p2p_timeout_s}")
        if self.profile_repeats < 1:
            raise ValueError(f"profile_repeats must be >= 1, got {self.profile_repeats}")
        if self.global_batch < 0:
            raise ValueError(f"global_batch must be >= 0, got {self.global_batch}")


@dataclasses.dataclass(kw_only=True, frozen=True)
class StageProcessConfig:
    """Everything one stage process is configured with."""

    client: ClientConfig
    run: RunConfig
    parallel: ParallelConfig
    stage: StageConfig
    encoder: EncoderConfig = dataclasses.field(default_factory=EncoderConfig)

    @property
    def replica(self) -> int:
        return self.client.rank // self.parallel.pipeline_parallel_size

    @property
    def stage_index(self) -> int:
        return self.client.rank % self.parallel.pipeline_parallel_size


@functools.cache
def program() -> Program:
    """The stage process's settings, in ``--help`` order (built on first use: the model
    registry imports torch)."""
    from bitps.worker.pipeline.models import MODELS

    _C, _K, _R, _P, _S = ClientConfig, CodecConfig, RunConfig, ParallelConfig, StageConfig

    def par(field: str, help: str):
        return from_field(_P, field, help=help, table=_TABLE)

    return Program("bitps-pipeline",
                   "Train one pipeline stage (also python -m bitps.worker.pipeline).", (
        option("servers", default="", metavar="HOST:PORT,...",
               help="comma-separated gRPC host:port of every shard, in shard-id order"),
        from_field(_S, "model", help=f"model to train: {', '.join(MODELS)}"),
        from_field(_R, "steps", help="pipeline steps (each: m micro-batches and one push)"),
        par("data_parallel_size", "D: data-parallel replicas, each a whole pipeline"),
        par("pipeline_parallel_size", "P: pipeline stages (processes) per replica"),
        par("micro_batch_size", "samples per micro-batch (the start value when dynamic)"),
        par("gradient_accumulation_steps", "m: micro-batches per step"),
        par("schedule", "pipeline schedule"),
        par("dynamic_micro_batch", "choose the micro-batch size between steps from the "
                                   "measured stage times (keeping the global batch)"),
        par("micro_batch_min", "dynamic micro-batching: smallest micro-batch size"),
        par("micro_batch_max", "dynamic micro-batching: largest micro-batch size"),
        par("lookahead", "first stage: load and embed the next micro-batch on a side thread"),
        par("balance", "how layers are cut into stages: by measured time (profile) or "
                       "count (uniform)"),
        from_field(_C, "rank", env="RANK", help="global rank (torchrun's RANK)"),
        from_field(_C, "world_size", env="WORLD_SIZE",
                   help="stage processes, D x P (torchrun's WORLD_SIZE)"),
        from_field(_S, "master_addr", env="MASTER_ADDR",
                   help="torch.distributed rendezvous host (torchrun's MASTER_ADDR)"),
        from_field(_S, "master_port", env="MASTER_PORT",
                   help="torch.distributed rendezvous port (torchrun's MASTER_PORT)"),
        from_field(_R, "local_rank", env="LOCAL_RANK",
                   help="GPU index on this host (torchrun's LOCAL_RANK)"),
        from_field(_R, "device", help="torch device; auto = cuda:<local rank> when CUDA is "
                                      "available, else cpu"),
        from_field(_R, "threads", help="torch CPU threads"),
        from_field(_S, "seed", help="model init seed (data seed = seed, replica)"),
        from_field(_S, "p2p_timeout_s", name="p2p-timeout",
                   help="seconds to wait for a peer stage's transfer before failing"),
        from_field(_S, "profile_repeats", help="balance = profile: timed runs per layer"),
        from_field(_S, "global_batch", help="samples per step over all replicas; must equal D "
                                            "x micro-batch size x m (0 = not fixed)"),
        from_field(_K, "name", name="push-codec", help="gradient codec, with error feedback"),
        from_field(EncoderConfig, "compress_min_bytes",
                   help="tensors smaller than this go uncompressed"),
        *connection_settings(),
        from_field(_R, "metrics_port", help="Prometheus port; 0 = any free port, -1 = off"),
        from_field(_R, "metrics_host", help="address the Prometheus endpoint binds to"),
        from_field(_R, "log_every", help="progress line every N steps"),
        from_field(_R, "json", help="print JSON progress lines (for bitps-launch)"),
    ))


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
                 ) -> StageProcessConfig:
    """The stage's configuration from ``argv``, ``environ`` and the ``--config`` file. A bad
    flag exits 2 (argparse); a bad variable, file or value raises ``ValueError``. The plan is
    not checked against a model here (:func:`check_plan` does)."""
    r = program().parse(argv, environ)
    servers = tuple(s for s in r["servers"].split(",") if s)
    return StageProcessConfig(
        client=ClientConfig(**r.kwargs(ClientConfig), servers=servers),
        encoder=EncoderConfig(**r.kwargs(EncoderConfig),
                              push_codec=CodecConfig(**r.kwargs(CodecConfig))),
        run=RunConfig(**r.kwargs(RunConfig)),
        parallel=ParallelConfig(**r.kwargs(ParallelConfig)),
        stage=StageConfig(**r.kwargs(StageConfig)))


def check_plan(cfg: StageProcessConfig) -> None:
    """Refuse, before any communication, a layout the model or the schedule cannot run:
    ``ParallelConfig.check`` against the model's layer count (p > layers, 2p > layers for
    ``zb-v``, the schedule's deadlock guard, an indivisible batch, ...), a chunked schedule
    (``zb-v``) on a CUDA device, and a world size other than D x P."""
    from bitps.worker.pipeline.models import MODELS
    from bitps.worker.pipeline.schedules import get_schedule

    if cfg.stage.model not in MODELS:
        raise ValueError(f"model {cfg.stage.model!r}: expected one of {', '.join(MODELS)}")
    p = cfg.parallel
    p.check(MODELS[cfg.stage.model].num_layers, global_batch=cfg.stage.global_batch or None)
    chunks = get_schedule(p.schedule).chunks
    device = resolve_device(cfg.run)
    if chunks > 1 and device.type != "cpu":
        # StageRuntime refuses it too, but only after the process group is up: say it here.
        raise ValueError(f"schedule {p.schedule!r} ({chunks} model chunks per rank) runs on "
                         f"gloo (CPU) only: its two chunks' transfer chains are not provided "
                         f"over NCCL; got device {device} (pass --device cpu)")
    if p.dynamic_micro_batch and not get_schedule(p.schedule).flushes:
        raise ValueError(f"dynamic_micro_batch needs a flushing schedule (the micro-batch size "
                         f"changes between steps); {p.schedule!r} has no flush")
    expected = p.data_parallel_size * p.pipeline_parallel_size
    if cfg.client.world_size != expected:
        raise ValueError(f"world size must be data_parallel_size x pipeline_parallel_size = "
                         f"{p.data_parallel_size} x {p.pipeline_parallel_size} = {expected}, "
                         f"got {cfg.client.world_size}")


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler (a BaseException: no ``except
    Exception`` on the way swallows it)."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    raise _Terminated


def emit(run: RunConfig, **event) -> None:
    """One progress event: a JSON line on stdout with ``--json``, else a log line."""
    if run.json:
        print(json.dumps(event), flush=True)
    else:
        logging.info("%s", event)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        check_plan(cfg)
    except ValueError as err:  # SettingError and PlanError are ValueErrors
        print(f"bitps-pipeline: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s stage %(process)d %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run_stage(cfg, emit=functools.partial(emit, cfg.run))
    except _Terminated:  # the step loop has left the shards on its way out
        emit(cfg.run, event="terminated", rank=cfg.client.rank)
        return 0
    except Exception as err:
        logging.exception("rank %d (replica %d, stage %d) failed", cfg.client.rank,
                          cfg.replica, cfg.stage_index)
        emit(cfg.run, event="error", rank=cfg.client.rank, replica=cfg.replica,
             stage=cfg.stage_index, error=f"{type(err).__name__}: {err}")
        return 1


def resolve_device(run: RunConfig):
    """The ``torch.device`` a stage runs on: ``run.device``, or with ``auto``
    ``cuda:<local rank>`` when CUDA is available, else ``cpu``."""
    import torch

    if run.device != "auto":
        return torch.device(run.device)
    return torch.device(f"cuda:{run.local_rank}" if torch.cuda.is_available() else "cpu")


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
        self.runtime = StageRuntime(ctx, parts[0] if self.chunks == 1 else parts,
                                    loss_fn=self.spec.loss if self.scores else None,
                                    ps_model=self.ps_model, metrics=self.metrics)
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


if __name__ == "__main__":
    sys.exit(main())
