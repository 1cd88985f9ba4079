"""``ParallelConfig``: how many data-parallel replicas and pipeline stages, how big a
micro-batch, how many micro-batches per step, which schedule, and whether the micro-batch size
is tuned at run time.

The problem statement's dict is accepted as it is::

    cfg = ParallelConfig.from_mapping({"data_parallel_size": 2, "pipeline_parallel_size": 4,
                                       "micro_batch_size": 8, "gradient_accumulation_steps": 4})
    cfg.check(num_layers=24)   # before any process starts
    cfg.global_batch           # 64 = 2 x 8 x 4

Every field is a plain ``int``/``bool``/``str``/``float`` with a default, and
``schedule``/``balance`` list their allowed values in ``metadata["choices"]``, so
``proto.settings.from_field`` makes a flag, an environment variable and a TOML key of each.
Construction checks each field alone (:class:`ConfigError`); :meth:`ParallelConfig.check`
checks them together against the model (``num_layers``) and the schedule (the simulator's
deadlock guard, :class:`PlanError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bitps.worker.pipeline.errors import ConfigError, PlanError
from bitps.worker.pipeline.schedules import SCHEDULES, get_schedule

__all__ = ["BALANCE_METHODS", "ParallelConfig"]

BALANCE_METHODS = ("profile", "uniform")
_SIZES = ("data_parallel_size", "pipeline_parallel_size", "micro_batch_size",
          "gradient_accumulation_steps", "micro_batch_min", "micro_batch_max")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """Hybrid data x pipeline parallelism (``worker.pipeline``)."""

    data_parallel_size: int = 1
    """Replicas of the whole pipeline (D); they exchange gradients through the PS shards."""
    pipeline_parallel_size: int = 1
    """Stages per replica (P): one process each, holding a contiguous range of layers."""
    micro_batch_size: int = 8
    """Samples per micro-batch (b); with ``dynamic_micro_batch``, the size of the first step."""
    gradient_accumulation_steps: int = 4
    """Micro-batches per optimizer step (m); the per-replica batch is b x m."""
    schedule: str = field(default="1f1b", metadata={"choices": SCHEDULES.keys()})
    """Pipeline schedule (``worker.pipeline.schedules``): ``gpipe``, ``1f1b``, ``zb-h1`` (split
    input/weight backward, 1F1B's memory, a third of its bubble when F, B and W take equally
    long), ``2bw`` (no flush, two weight versions, one-step-stale updates) or ``zb-v`` (two
    model chunks per rank in a V: the model is cut into 2P parts, so 2P <= the layers).
    ``1f1b`` and ``zb-h1`` need m >= P, ``2bw`` m >= P - 1."""
    dynamic_micro_batch: bool = False
    """Choose the micro-batch size between steps from the measured stage times, keeping the
    per-replica batch (``worker.pipeline.microbatch``)."""
    micro_batch_min: int = 4
    """Smallest micro-batch size ``dynamic_micro_batch`` may choose."""
    micro_batch_max: int = 16
    """Largest micro-batch size ``dynamic_micro_batch`` may choose."""
    lookahead: bool = False
    """The first stage loads, collates and embeds the next micro-batch on a side thread (and
    stream) while the current one runs."""
    balance: str = field(default="profile", metadata={"choices": BALANCE_METHODS})
    """How layers are assigned to stages: ``profile`` (a short profiling run measures each
    layer's forward + backward time; min-max contiguous partition, ``partition.balance``) or
    ``uniform`` (equal layer counts)."""
    weight_prediction: float = 2.0
    """Flush-free schedules (``2bw``): compute each step on its stale version extrapolated by
    this many pull intervals, ``w + h * (w - w_previous)`` (``worker.pipeline.prediction``; the
    exact pulled weights stay untouched); 0 = off. Flushing schedules ignore it. 2: the best
    horizon measured at the shards' default Adam beta1 0.9; 3 with shards at beta1 0.97, the
    pair that ends within 1 % of 1F1B (dp 2 x pp 2 through async shards, docs/pipeline.md)."""

    def __post_init__(self) -> None:
        self._check_fields()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ParallelConfig:
        """The config a dict (the problem statement's ``parallel_config``) describes; an
        unknown key is a :class:`ConfigError` naming it and the accepted keys."""
        accepted = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(accepted))
        if unknown:
            raise ConfigError("parallel_config", unknown,
                              f"only the keys {', '.join(accepted)}")
        return cls(**values)

    @property
    def replica_batch(self) -> int:
        """Samples per optimizer step on one replica: micro_batch_size x m."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all replicas: D x micro_batch_size x m."""
        return self.data_parallel_size * self.replica_batch

    @property
    def world_size(self) -> int:
        """Stage processes in all: D x P."""
        return self.data_parallel_size * self.pipeline_parallel_size

    def micro_batch_choices(self) -> tuple[int, ...]:
        """The sizes ``dynamic_micro_batch`` may use: in [min, max], dividing the replica batch,
        with a micro-batch count the schedule accepts for P stages."""
        schedule, p = get_schedule(self.schedule), self.pipeline_parallel_size
        choices = []
        for b in range(self.micro_batch_min, self.micro_batch_max + 1):
            if self.replica_batch % b == 0:
                try:
                    schedule.check(p, self.replica_batch // b)
                except PlanError:
                    continue
                choices.append(b)
        return tuple(choices)

    def check(self, num_layers: int, *, global_batch: int | None = None) -> None:
        """Raise unless this config can run a model of ``num_layers`` layers: every size >= 1,
        P <= num_layers (chunks x P <= num_layers for a chunked schedule: ``zb-v`` cuts the
        model into 2P parts), the schedule completes P stages x m micro-batches (:class:`PlanError`,
        the simulator's deadlock guard), and with ``dynamic_micro_batch`` the first size in
        [min, max] (then some allowed size divides the replica batch: that one).
        ``global_batch``, if given (a data loader's batch), must equal D x micro_batch_size x
        m."""
        self._check_fields()
        p, m = self.pipeline_parallel_size, self.gradient_accumulation_steps
        if num_layers < 1:
            raise ConfigError("num_layers", num_layers, "a model with at least 1 layer")
        schedule = get_schedule(self.schedule)
        if p > num_layers:
            raise ConfigError("pipeline_parallel_size", p,
                              f"at most the model's {num_layers} layers (every stage holds one "
                              f"or more)")
        if schedule.chunks * p > num_layers:
            # A chunked schedule cuts the model into chunks x P parts, each of >= 1 layer.
            raise ConfigError("pipeline_parallel_size", p,
                              f"at most {num_layers // schedule.chunks} with schedule "
                              f"{self.schedule!r}: it cuts the model into {schedule.chunks} x "
                              f"{p} = {schedule.chunks * p} parts of at least one layer, and the "
                              f"model has {num_layers} layers")
        schedule.check(p, m)
        if global_batch is not None and global_batch != self.global_batch:
            raise ConfigError("global_batch", global_batch,
                              f"data_parallel_size x micro_batch_size x "
                              f"gradient_accumulation_steps = {self.data_parallel_size} x "
                              f"{self.micro_batch_size} x {m} = {self.global_batch}")
        if self.dynamic_micro_batch:
            self._check_dynamic()

    def _check_dynamic(self) -> None:
        lo, hi = self.micro_batch_min, self.micro_batch_max
        if not lo <= self.micro_batch_size <= hi:
            raise ConfigError("micro_batch_size", self.micro_batch_size,
                              f"a size in [micro_batch_min, micro_batch_max] = [{lo}, {hi}] "
                              f"with dynamic_micro_batch")

    def _check_fields(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "bool": bool, "str": str, "float": float}[f.type]
            if type(value) is not kind and not (kind is float and type(value) is int):
                raise ConfigError(f.name, value, f"{'an' if kind is int else 'a'} "
                                  f"{kind.__name__}")
        for name in _SIZES:
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")
        if self.weight_prediction < 0:
            raise ConfigError("weight_prediction", self.weight_prediction,
                              "a number >= 0 (pull intervals; 0 = off)")
        if self.micro_batch_min > self.micro_batch_max:
            raise ConfigError("micro_batch_min", self.micro_batch_min,
                              f"at most micro_batch_max ({self.micro_batch_max})")
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", self.schedule, f"one of {', '.join(sorted(SCHEDULES))}")
        if self.balance not in BALANCE_METHODS:
            raise ConfigError("balance", self.balance, f"one of {', '.join(BALANCE_METHODS)}")
