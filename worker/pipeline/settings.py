"""What one pipeline stage process is configured with, how it reads it and how the plan is
checked: :class:`StageConfig`, :class:`StageProcessConfig`, :func:`program` (the settings, in
``--help`` order), :func:`parse_config` and :func:`check_plan`.

The library under ``bitps-pipeline`` (``worker/pipeline/__main__.py``) and ``bitps-launch``,
which reads and checks a pipeline plan exactly as each stage process will before it starts any
(a refused one names the value and nothing has been started). No torch at import: the model
registry (torch) is imported on first use, by :func:`program` and :func:`check_plan`.

    cfg = parse_config(["--servers", "h:1", "--pipeline-parallel-size", "4"], environ={})
    check_plan(cfg)   # ValueError (PlanError, SettingError) naming what cannot run
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from bitps.proto.codecs import CodecConfig
from bitps.proto.settings import Program, from_field, option
from bitps.worker.config import ClientConfig, EncoderConfig, RunConfig, connection_settings
from bitps.worker.pipeline.config import ParallelConfig

__all__ = ["StageConfig", "StageProcessConfig", "check_plan", "parse_config", "program",
           "resolve_device"]

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
        par("weight_prediction", "flush-free schedules (2bw): compute on the stale weights "
                                 "extrapolated by this many pull intervals (0 = off; "
                                 "flushing schedules ignore it)"),
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
    ), plugins=True)  # a plug-in's codec as --push-codec (docs/plugins.md)


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


def resolve_device(run: RunConfig):
    """The ``torch.device`` a stage runs on: ``run.device``, or with ``auto``
    ``cuda:<local rank>`` when CUDA is available, else ``cpu``."""
    import torch

    if run.device != "auto":
        return torch.device(run.device)
    return torch.device(f"cuda:{run.local_rank}" if torch.cuda.is_available() else "cpu")
