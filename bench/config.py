"""The settings of every ``bitps-bench`` scenario, each declared once: one keyword-only dataclass
per sub-command, one field per option.

A field's docstring is its flag's ``--help`` line, its default the flag's default, its
``metadata["choices"]`` the allowed values; ``bench/options.py`` builds each scenario's flags
from its dataclass and ``make docs`` lists them (docs/benchmarks.md, docs/configuration.md). So
a new option is a new field here and nothing else. ``quick`` (the smoke-test size) is applied
by each dataclass's :meth:`sized`, next to the fields it overrides; a scenario's ``run(cfg)``
calls it first. Nothing here imports torch, numba or zmq: ``bitps-bench --help`` and the docs
load this module alone.

    PushPullBench(sizes_mib=(0.25,), rounds=1, quick=True)   # bitps-bench pushpull --quick ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bitps.bench.models import MODELS
from bitps.proto.keyplan import DEFAULT_PARTITION_BYTES
from bitps.proto.settings import CHOICES

__all__ = ["AllBench", "CodecBench", "CompareBench", "ConvergenceBench", "E2EBench", "KernelsBench",
           "MemoryBench", "OverlapBench", "PipelineBench",
           "PushPullBench", "ReportBench", "ScaleBench", "VolumeBench"]

PLACEMENTS = ("colocated", "own")
PIPELINE_PARTS = ("a", "b", "c")


class _Checked:
    """Refuses a value outside a field's ``metadata["choices"]`` (each element of a tuple
    field), naming the field, the value and the allowed ones."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            allowed = f.metadata.get(CHOICES)
            value = getattr(self, f.name)
            many = isinstance(value, tuple)
            if allowed is None or all(v in allowed for v in (value if many else (value,))):
                continue
            raise ValueError(f"{type(self).__name__}.{f.name}: got {value!r}; expected "
                             f"{'some of' if many else 'one of'} {', '.join(allowed)}")

    def sized(self):
        """This configuration as it runs: with ``quick``, at the smoke-test size."""
        return self


@dataclass(frozen=True, kw_only=True)
class PushPullBench(_Checked):
    """``bitps-bench pushpull``: push+pull throughput and round trip against raw pyzmq."""

    sizes_mib: tuple[float, ...] = (1, 16, 64)
    """payload sizes (MiB), each timed against raw pyzmq"""
    rounds: int = 7
    """alternating rounds per size"""
    small_bytes: int = 1024
    """round-trip payload (bytes)"""
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    """key size of the client's plan (bytes)"""
    idle_s: float = 10.0
    """seconds over which the CPU of a shard with nothing to do is read, after the cases (0:
    not read)"""
    quick: bool = False
    """few iterations per round, the idle shard read for at most 2 s (smoke test)"""

    def sized(self) -> PushPullBench:
        return dataclasses.replace(self, idle_s=min(self.idle_s, 2.0)) if self.quick else self


@dataclass(frozen=True, kw_only=True)
class VolumeBench(_Checked):
    """``bitps-bench volume``: bytes per step by codec, by arithmetic; it has no options."""


@dataclass(frozen=True, kw_only=True)
class ConvergenceBench(_Checked):
    """``bitps-bench convergence``: fp32 Adam against 1-bit Adam, sparse, sign1 and DiLoCo."""

    steps: int = 600
    """training steps per run"""
    freeze_fraction: float = 0.25
    """1-bit Adam warmup as a fraction of the steps"""
    lr: float = 3e-3
    """learning rate of every run"""
    beta2: float = 0.99
    """Adam beta2 of every run"""
    seeds: tuple[int, ...] = (0, 1)
    """model/data seeds; curves are averaged over them"""
    target_factor: float = 1.1
    """target loss = this x the sync fp32 Adam run's final loss"""
    sweep_lrs: tuple[float, ...] = (1.5e-3, 3e-3, 6e-3)
    """learning rates fp32 sync, async and ssp are also run at (asynchrony is judged at each
    one's best)"""
    runs: tuple[str, ...] = ()
    """only these runs (by name; the sync fp32 baseline and each run's peer come too; checks
    without their runs are left out); none: every run"""
    quick: bool = False
    """40 steps, one seed (smoke test)"""

    def sized(self) -> ConvergenceBench:
        return dataclasses.replace(self, steps=40, seeds=(0,)) if self.quick else self


@dataclass(frozen=True, kw_only=True)
class CodecBench(_Checked):
    """``bitps-bench codec``: the codec kernels against memcpy, numpy and torch, one thread."""

    mib: int = 64
    """gradient size (MiB)"""
    repeats: int = 7
    """timed calls per implementation"""
    quick: bool = False
    """8 MiB, 2 repeats (smoke test)"""

    def sized(self) -> CodecBench:
        return dataclasses.replace(self, mib=8, repeats=2) if self.quick else self


@dataclass(frozen=True, kw_only=True)
class KernelsBench(_Checked):
    """``bitps-bench kernels``: a shard's CPU per update of each rule and codec against the
    floor the memory bandwidth sets, one thread."""

    mib: int = 64
    """parameters on the shard (MiB of float32)"""
    key_mib: int = 4
    """size of each key (MiB); the shard holds mib / key_mib keys"""
    rounds: int = 7
    """alternating rounds; each figure is the median over them"""
    repeats: int = 3
    """pushes per case per round"""
    cases: tuple[str, ...] = ()
    """measure only these cases (by name; none: every one)"""
    thread_counts: tuple[int, ...] = (2,)
    """shard threads (ServerConfig.threads) timed against one on the scaling cases"""
    scaling_mib: int = 256
    """parameters of the thread-scaling runs (MiB of float32)"""
    quick: bool = False
    """8 MiB, 2 rounds of 1 push, scaling on 16 MiB (smoke test)"""

    def sized(self) -> KernelsBench:
        return dataclasses.replace(self, mib=8, key_mib=2, rounds=2, repeats=1,
                                   scaling_mib=16) if self.quick else self


@dataclass(frozen=True, kw_only=True)
class OverlapBench(_Checked):
    """``bitps-bench overlap``: step time, utilization and CPU with overlap off and on."""

    rate: str = "1gbit"
    """tc tbf rate of the link, each way"""
    width: int = 512
    """width of each linear layer"""
    depth: int = 16
    """number of linear layers"""
    comm_ratios: tuple[float, ...] = (0.6, 0.8, 1.0)
    """size the batch so communication = this x compute, for each; each is checked"""
    steps: int = 12
    """measured steps per run"""
    warmup: int = 3
    """steps before the measured ones of every run"""
    probe_batch: int = 64
    """batch of the probes that time compute per sample and communication"""
    bucket_bytes: int = 1 << 20
    """overlap bucket size (bytes)"""
    partition_bytes: int = 128 << 10
    """key size of the client's plan (bytes)"""
    inflight_bytes: int = 2 << 20
    """credit window of pushes in flight (bytes)"""
    device: str = "auto"
    """torch device (auto: cuda if available)"""
    quick: bool = False
    """3 steps after 1 warm-up (smoke test)"""

    def sized(self) -> OverlapBench:
        return dataclasses.replace(self, steps=3, warmup=1) if self.quick else self


@dataclass(frozen=True, kw_only=True)
class MemoryBench(_Checked):
    """``bitps-bench memory``: the activation pool's allocators and eviction at budgets."""

    trace_steps: int = 12
    """demo steps recorded"""
    train_steps: int = 18
    """timed steps per configuration, each beside a pool-off step"""
    micro: int = 8
    """micro-batches per step (1F1B)"""
    in_flight: int = 4
    """micro-batches whose activations are alive at once (pipeline depth)"""
    scale: int = 1024
    """divide the problem's block sizes (4 MiB, 2 GiB) by this"""
    seed: int = 0
    """seed of the models, the batches and the trace's batch shapes"""
    quick: bool = False
    """4 trace steps, 2 timed steps (smoke test)"""

    def sized(self) -> MemoryBench:
        return dataclasses.replace(self, trace_steps=4, train_steps=2) if self.quick else self


@dataclass(frozen=True, kw_only=True)
class E2EBench(_Checked):
    """``bitps-bench e2e``: bitps against DDP on an emulated cluster. The fields up to
    ``cases`` are the run's settings as ``<name>.json`` records them."""

    model: str = field(default="lm", metadata={CHOICES: MODELS.keys()})
    """model of every run (bench/models.py)"""
    steps: int = 150
    """steps per worker per run"""
    sweep_steps: int = 60
    """steps of each learning-rate sweep point (at most --steps)"""
    lrs: tuple[float, ...] = (3e-4, 6e-4, 1.2e-3)
    """learning rates swept for every learning run"""
    warmup_frac: float = 0.1
    """linear learning-rate warm-up as a share of the steps (0 = none)"""
    clip_norm: float = 1.0
    """gradient clipping of every run (0 = off)"""
    seed: int = 0
    """model and data seed of every run"""
    rate: str = "1gbit"
    """tc tbf rate of every link, each way"""
    placement: str = field(default="colocated", metadata={CHOICES: PLACEMENTS})
    """a shard beside each worker, or shards on nodes of their own"""
    straggler: bool = False
    """worker 1 computes 1.5x slower (sync vs ssp)"""
    freeze_frac: float = 0.2
    """1-bit Adam: warm-up (variance-freeze) share of the steps, full Adam on bf16 pushes"""
    powersgd_start: int = 10
    """DDP PowerSGD: steps of plain all-reduce before compression starts"""
    device: str = "cpu"
    """torch device of every rank"""
    cases: tuple[str, ...] = ()
    """run only these cases (by name); none: every case (--straggler: its own set)"""
    profile: bool = False
    """record every rank and shard of each learning run with py-spy from its steady phase on
    and report the top CPU consumers per step (perturbs the timings: run it apart, with
    --cases)"""
    name: str = ""
    """result file stem (default e2e-<model>[-straggler])"""
    quick: bool = False
    """the demo model, 30 steps, one learning rate (smoke test); results under <out>/quick"""

    def sized(self) -> E2EBench:
        cfg = self
        if cfg.quick:
            cfg = dataclasses.replace(cfg, model="tiny", steps=30, sweep_steps=30, lrs=(3e-3,))
        stem = cfg.name or f"e2e-{cfg.model}{'-straggler' if cfg.straggler else ''}"
        return dataclasses.replace(cfg, sweep_steps=min(cfg.sweep_steps, cfg.steps), name=stem)


@dataclass(frozen=True, kw_only=True)
class PipelineBench(_Checked):
    """``bitps-bench pipeline``: measured pipeline bubbles on sleep-based stages, the deep
    model on p stages, dp x pp through the PS."""

    p: int = 4
    """pipeline stages (one rank each)"""
    ms: tuple[int, ...] = (4, 8, 16)
    """micro-batches per step, each measured"""
    t_ms: tuple[float, float, float] = field(default=(40.0, 40.0, 40.0),
                                             metadata={"metavar": "MS"})
    """sleep of each stage's F, B and W (ms; >= 20: the ~1 ms per-action floor measured here
    is then <= 2.5 %)"""
    rounds: int = 3
    """timed steps per case, alternated"""
    warmup: int = 1
    """untimed steps per case before the timed ones"""
    rows_per_mb: int = 2
    """(a): rows of each micro-batch"""
    width: int = 8
    """(a): columns of each micro-batch"""
    cases: tuple[str, ...] = ()
    """only these cases (ours: gpipe 1f1b zb-h1 2bw; torch: torch-gpipe torch-1f1b torch-zb1p
    torch-zbv); none: every case"""
    flush_free_steps: int = 6
    """steps of the flush-free plan per timed run (steady state: 1..N-2)"""
    timeout_s: float = 600.0
    """seconds each launch of ranks may take"""
    quiet_busy: float = 0.3
    """(a) waits until at most this share of all cores is busy"""
    quiet_wait_s: float = 120.0
    """seconds (a) waits for that at most"""
    parts: tuple[str, ...] = field(default=PIPELINE_PARTS, metadata={CHOICES: PIPELINE_PARTS})
    """(a) synthetic stages, (b) the deep model on p stages, (c) dp 2 x pp 2 through the PS"""
    deep_steps: int = 24
    """(b): steps per run"""
    dp_pp_steps: int = 150
    """(c): steps per run"""
    nice: int = -15
    """niceness the rank processes ask for, so that other work delays their wake-ups less"""
    quick: bool = False
    """part (a) only, the smallest m, one timed step, no wait for quiet (smoke test)"""

    def sized(self) -> PipelineBench:
        if not self.quick:
            return self
        return dataclasses.replace(self, ms=(min(self.ms),), rounds=1, parts=("a",),
                                   quiet_wait_s=0.0)


SCALE_SCHEMES = ("fp32", "sign1", "onebit")


@dataclass(frozen=True, kw_only=True)
class ScaleBench(_Checked):
    """``bitps-bench scale``: a sync step's time from per-byte costs measured here, checked
    against measured points on the emulated cluster, then extrapolated to a large job."""

    workers: tuple[int, ...] = (1, 2, 4)
    """workers of the measured points (a node each)"""
    shards: tuple[int, ...] = (1, 2)
    """shards of the measured points (a node each)"""
    rates: tuple[str, ...] = ("1gbit", "10gbit")
    """tc tbf rate of every link, each way, of the measured points"""
    schemes: tuple[str, ...] = field(default=SCALE_SCHEMES, metadata={CHOICES: SCALE_SCHEMES})
    """fp32 Adam; Adam with sign1 pushes and pulls; sync 1-bit Adam (compressed phase)"""
    mib: int = 32
    """key set each worker pushes and pulls per step (MiB of float32)"""
    key_kib: int = 1024
    """size of each key (KiB; 1024: the default key plan's)"""
    steps: int = 20
    """steps per measured point, the warm-up's included"""
    warmup: int = 2
    """untimed steps of each measured point"""
    rounds: int = 5
    """rounds of the cost measurements (medians)"""
    side_rounds: int = 2
    """rounds of the CPU costs measured again just before and after every point (each row then
    says how far they moved from the start and across the point, and what they predict; the
    checks use the start's); 0: none"""
    tolerance: float = 0.15
    """largest |measured / predicted - 1| of a measured point"""
    quiet: float = 0.1
    """a point during which other work (the machine's CPU less this point's processes') used
    more than this share of a core is measured again, up to --tries times (the quietest kept)"""
    tries: int = 3
    """most measurements of one point"""
    params: float = 30e9
    """extrapolation: parameters of the model (the seed's 30 B)"""
    big_workers: int = 64
    """extrapolation: workers, each on a machine of its own"""
    max_shards: int = 16
    """extrapolation: shards 1 .. this, each on a machine of its own"""
    link_gbps: tuple[float, ...] = (10, 25, 100)
    """extrapolation: link rates (Gbit/s, each way)"""
    big_key_mib: int = 16
    """extrapolation: also with keys of this size (MiB; a plan's partition_bytes), the per-byte
    costs measured at it too"""
    shard_cores: int = 32
    """extrapolation: cores of a shard machine (its update threads)"""
    shard_memory_gbps: float = 100.0
    """extrapolation: memory bandwidth of a shard machine (GB/s; caps its threads' speed-up)"""
    compute_s: float = 0.87
    """extrapolation: a worker's compute per step that the exchange overlaps (s; the problem
    statement's 30 B step)"""
    quick: bool = False
    """8 MiB, 1 and 2 workers on 1 shard, 5 steps, 2 rounds, 1 side round (smoke test)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        # 1-bit Adam's first two steps are its warm-up and the switch to compression
        if (min(self.workers + self.shards) < 1 or not 2 <= self.warmup < self.steps
                or not 0 < self.tolerance < 1 or self.tries < 1 or self.quiet < 0
                or self.side_rounds < 0):
            raise ValueError(f"ScaleBench: workers {self.workers}, shards {self.shards}, "
                             f"warmup {self.warmup}, steps {self.steps}, tolerance "
                             f"{self.tolerance}, tries {self.tries}, quiet {self.quiet}, "
                             f"side_rounds {self.side_rounds}; expected counts >= 1, "
                             f"2 <= warmup < steps, 0 < tolerance < 1, tries >= 1, quiet >= 0 "
                             f"and side_rounds >= 0")

    def sized(self) -> ScaleBench:
        if not self.quick:
            return self
        return dataclasses.replace(self, mib=8, workers=tuple(w for w in self.workers
                                                             if w <= 2) or (1,),
                                   shards=(min(self.shards),), steps=5, warmup=2, rounds=2,
                                   side_rounds=min(self.side_rounds, 1))


@dataclass(frozen=True, kw_only=True)
class AllBench(_Checked):
    """``bitps-bench all``: every scenario, then the report."""

    quick: bool = False
    """every scenario's smoke-test size; results under <out>/quick"""


@dataclass(frozen=True, kw_only=True)
class ReportBench(_Checked):
    """``bitps-bench report``: REPORT.md from the result files; it has no options."""


COMPARED = ("pushpull", "codec", "overlap", "volume", "memory")


@dataclass(frozen=True, kw_only=True)
class CompareBench(_Checked):
    """``bitps-bench compare``: scenarios from this checkout and another, alternated."""

    base: str = ""
    """the other checkout (a directory with its own .venv, e.g. a git worktree of the previous
    commit); empty: this one, against itself (the noise floor)"""
    scenarios: tuple[str, ...] = field(default=("pushpull", "codec", "overlap"),
                                       metadata={CHOICES: COMPARED})
    """scenarios to run from both checkouts"""
    rounds: int = 3
    """rounds; each runs every scenario once per checkout, the order swapped every round"""
    tolerance: float = 0.03
    """largest |head / base - 1| a figure may differ by (beyond the rounds' own noise)"""
    quick: bool = False
    """the scenarios at smoke-test size (a check of the tool, not a measurement)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds < 1 or not 0 <= self.tolerance < 1:
            raise ValueError(f"CompareBench: rounds {self.rounds}, tolerance {self.tolerance}; "
                             f"expected rounds >= 1 and 0 <= tolerance < 1")
