"""1-bit Adam's settings on a shard: :class:`OneBitConfig` (the ``OptimizerConfig.rule_config`` of
``onebit_adam``), its ``bitps-server`` flags (:data:`SETTINGS`), and what follows from them: the
scale rule and codecs of the published codes, where Adam's moments live, and what workers are
told at registration (``proto/onebit.proto`` ``OneBitParams``). The rule itself is
``ps.onebit``, which re-exports these names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bitps.proto import bitps_pb2 as pb
from bitps.proto import onebit_pb2
from bitps.proto.codecs import MEAN_ABS, Codec, chunk_problem
from bitps.proto.settings import from_field
from bitps.ps.config import RuleConfig, ServerConfig

__all__ = ["MOMENTS", "MOMENTUM_WINDOWS", "SCALES", "SETTINGS", "WARMUP_CODECS", "OneBitConfig",
           "params", "published_codec", "uses_mean_abs", "uses_worker_moments", "warmup_codec"]

MOMENTS = ("auto", "worker", "shard")
MOMENTUM_WINDOWS = ("steps", "updates")
SCALES = ("auto", "mean_abs", "rms")
WARMUP_CODECS = ("sign1", "bf16")


@dataclass(kw_only=True, frozen=True)
class OneBitConfig(RuleConfig):
    """1-bit Adam's settings (``OptimizerConfig.rule_config`` of ``onebit_adam``); the flags
    keep their ``onebit_`` spelling (``--onebit-chunk``, :data:`SETTINGS`)."""

    freeze_step: int = 100
    """Warmup steps of full Adam on bf16 gradients; from this clock on, pushes are sign1 and
    the shard publishes sign1-compressed updates, and v is frozen in ``sync`` and with shard
    moments (DeepSpeed suggests 15-25 % of the run)."""
    chunk: int = 256
    """Elements per scale of every sign1 code, pushed and published (1 + 32/256 = 1.125 bits
    per element). 2048 cost the demo model 1.8 % in final loss against fp32 Adam, 256 cost
    0.5 % (docs/benchmarks.md, 1-bit Adam notes)."""
    scale: str = field(default="auto", metadata={"choices": SCALES})
    """Scale rule of the shard's sign1 codes, ``rms``, ``mean_abs`` or ``auto`` (``rms`` in sync
    mode, where the codes are momenta as in DeepSpeed; ``mean_abs``, the least-squares scale
    that never overshoots, for the heavy-tailed parameter updates of async/ssp). Both choices
    trained the demo model best in their mode (docs/benchmarks.md, 1-bit Adam notes)."""
    moments: str = field(default="auto", metadata={"choices": MOMENTS})
    """``async``/``ssp``: where Adam's moments live after the warmup. ``worker``: each worker
    keeps m and v of its own gradients in float32 and pushes its sign1-compressed Adam
    direction ``m/(1-beta1^t) / (sqrt(v/(1-beta2^t)) + eps)``; the shard applies ``-lr *
    (direction + wd * x)`` (Efficient-Adam's two-way compressed update; v is never frozen).
    ``shard``: the shard keeps m and freezes v at the switch, workers push sign1 gradients.
    ``auto`` = ``worker``; it trained the demo model within 1 % of fp32 Adam in ssp, ``shard``
    9-18 % worse (docs/benchmarks.md, 1-bit Adam notes). ``sync`` always uses DeepSpeed's
    layout and accepts only ``auto``."""
    momentum_window: str = field(default="steps", metadata={"choices": MOMENTUM_WINDOWS})
    """``async``/``ssp`` with worker moments: what each worker's m averages over. ``steps``:
    its own last ``1/(1-beta1)`` steps (m decays by beta1 per push). ``updates``: the shard's
    last ``1/(1-beta1)`` updates: m decays by ``beta1**W`` per push, W the workers pushing the
    key, so the W momenta the shard applies in turn span what one shared momentum spans (fp32
    Adam on a shard, m advanced by every push). v keeps beta2 per step (``beta2**W`` cost 2 %
    at W = 4). On the convergence bench with 4 workers in ssp, ``updates`` with beta1 0.95 took
    1-bit Adam from 1.057x to 1.038x sync fp32 Adam (each at its best lr, one run; fp32 Adam in
    ssp: 1.028x); with 2 workers it ended where ``steps`` does (1.4597 against 1.4598), so it
    is not the default until the e2e models show it (docs/algorithms.md, Staleness)."""
    warmup_codes: bool = False
    """During the warmup, pull replies carry sign1 codes of the shard's Adam updates (error
    feedback on the shard, ``ps.publish``) instead of the float32 parameters, so both
    directions are compressed from the first step: bf16 pushes, about one bit per element
    pulled. In sync mode the shard's residual of those updates is dropped at the switch (the
    same on shard and workers, whose copies stay bit-identical)."""
    warmup_codec: str = field(default="sign1", metadata={"choices": WARMUP_CODECS})
    """The codec of the warmup's codes (``warmup_codes``): ``sign1`` (the codec of the
    compressed stage, about one bit per element) or ``bf16`` (two bytes per element, error
    feedback on the shard as well, so the parameters follow full Adam to within one bf16
    rounding of one update). On the 28.6 M LM, bf16 codes took the sync warmup's step from
    1521 to 1372 ms at the same final loss (docs/benchmarks.md, asynchrony on the LM). The
    first compressed update turns the publisher to sign1: workers behind it then pull the
    parameters."""
    restart_free = ("compact_state",)  # the denominators are made again after a restore
    compact_state: bool = False
    """sync: at the switch the shard makes its m the decode of m's own sign1 code (as every
    later m is: the decode of a published code) and rounds its frozen denominators
    ``sqrt(v)/bc2 + eps`` to bf16, and the state each worker fetches once (the RuleState
    call) is that code and those denominators: about 2.1 bytes per element instead of 8
    (float32 m and v), which the worker keeps as they are (no decode of m, no square root).
    On the 28.6 M LM that is 61 MB instead of 229 MB per worker, in the step that switches,
    where the fetch competes with backward for the CPU (docs/benchmarks.md, asynchrony on the
    LM)."""

    def __post_init__(self) -> None:
        if self.freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1, got {self.freeze_step}")
        if self.scale not in SCALES:
            raise ValueError(f"onebit_scale {self.scale!r}; expected one of {SCALES}")
        if self.moments not in MOMENTS:
            raise ValueError(f"onebit_moments {self.moments!r}; expected one of {MOMENTS}")
        if self.momentum_window not in MOMENTUM_WINDOWS:
            raise ValueError(f"onebit_momentum_window {self.momentum_window!r}; expected one of "
                             f"{MOMENTUM_WINDOWS}")
        if self.warmup_codec not in WARMUP_CODECS:
            raise ValueError(f"onebit_warmup_codec {self.warmup_codec!r}; expected one of "
                             f"{WARMUP_CODECS}")
        if self.warmup_codec != "sign1" and not self.warmup_codes:
            raise ValueError(f"onebit_warmup_codec {self.warmup_codec!r} applies to the "
                             f"warmup's codes; without onebit_warmup_codes warmup pulls carry "
                             f"the parameters")
        if problem := chunk_problem(self.chunk):
            raise ValueError(f"onebit_{problem}")

    def check(self, server: ServerConfig) -> None:
        if server.mode != "sync" and self.compact_state:
            raise ValueError(f"onebit_compact_state applies to sync mode (workers fetch m and v "
                             f"at the switch there); mode {server.mode!r} fetches nothing")
        if server.mode == "sync" and self.moments != "auto":
            raise ValueError(f"onebit_moments {self.moments!r} applies to async/ssp; sync 1-bit "
                             f"Adam keeps DeepSpeed's layout (use auto)")
        if self.momentum_window != "steps" and not uses_worker_moments(server):
            raise ValueError(f"onebit_momentum_window {self.momentum_window!r} applies to the "
                             f"workers' own moments (async/ssp, onebit_moments auto or worker); "
                             f"mode {server.mode!r} with onebit_moments {self.moments!r} keeps "
                             f"one momentum")
        if self.moments == "shard":
            # condemned by the convergence bench: what it loses is sign1 on raw gradients
            # (sync sign1 + EF under Adam loses as much), not staleness
            logging.getLogger("bitps.onebit").warning(
                "onebit_moments=shard is deprecated and will be removed: on the convergence "
                "bench it ends %s above fp32 Adam in ssp with weight prediction, against %s for "
                "the worker moments (auto); docs/algorithms.md, Staleness", "12 %", "1 %")


_C = OneBitConfig
SETTINGS = (
    from_field(_C, "freeze_step", help="onebit_adam: warmup clocks of full Adam on bf16 pushes "
                                       "before traffic goes 1-bit"),
    from_field(_C, "chunk", name="onebit-chunk",
               help="onebit_adam: elements per scale of every sign1 code, pushed and published"),
    from_field(_C, "scale", name="onebit-scale",
               help="onebit_adam: scale rule of the published sign1 codes; auto = rms in sync, "
                    "mean_abs in async/ssp"),
    from_field(_C, "moments", name="onebit-moments",
               help="onebit_adam in async/ssp: Adam's moments on each worker (worker; auto) or "
                    "on the shard (shard); sync accepts only auto"),
    from_field(_C, "momentum_window", name="onebit-momentum-window",
               help="onebit_adam in async/ssp with worker moments: each worker's m spans its "
                    "own last 1/(1-beta1) steps (steps) or the shard's last 1/(1-beta1) "
                    "updates (updates: m decays by beta1**W per push)"),
    from_field(_C, "warmup_codes", name="onebit-warmup-codes",
               help="onebit_adam: warmup pulls carry codes of the Adam updates "
                    "(--onebit-warmup-codec), not float32"),
    from_field(_C, "warmup_codec", name="onebit-warmup-codec",
               help="onebit_adam: the codec of the warmup's codes (with --onebit-warmup-codes)"),
    from_field(_C, "compact_state", name="onebit-compact-state",
               help="onebit_adam in sync: workers fetch m's sign1 code and bf16 denominators "
                    "at the switch (both rounded so on the shard too), not float32 m and v"),
)
"""``bitps-server``'s flags of :class:`OneBitConfig` (``OneBitAdam.settings``)."""


def _opts(cfg: ServerConfig) -> OneBitConfig:
    return cfg.optimizer.rule_config


def uses_mean_abs(cfg: ServerConfig) -> bool:
    """The scale rule of the published codes (``onebit_scale``; ``auto`` = RMS in sync)."""
    scale = _opts(cfg).scale
    return scale == "mean_abs" or (scale == "auto" and cfg.mode != "sync")


def params(cfg: ServerConfig, ratio_clip: float) -> onebit_pb2.OneBitParams:
    """What a RegisterReply tells workers (``RegisterReply.rule_params``)."""
    o, opts = cfg.optimizer, _opts(cfg)
    return onebit_pb2.OneBitParams(
        freeze_step=opts.freeze_step, chunk=opts.chunk,
        codec_flags=MEAN_ABS if uses_mean_abs(cfg) else 0, lr=o.lr, beta1=o.beta1,
        beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, ratio_clip=ratio_clip,
        worker_moments=uses_worker_moments(cfg), lr_warmup_steps=o.schedule.warmup_steps,
        lr_decay_steps=o.schedule.decay_steps, lr_min_ratio=o.schedule.min_ratio,
        momentum_per_update=opts.momentum_window == "updates")


def uses_worker_moments(cfg: ServerConfig) -> bool:
    """async/ssp with ``onebit_moments`` auto or worker: workers keep Adam's moments."""
    return cfg.mode != "sync" and _opts(cfg).moments != "shard"


def published_codec(cfg: ServerConfig) -> Codec:
    """The sign1 codec of every code a 1-bit Adam shard publishes (and workers push)."""
    return Codec(pb.CODEC_SIGN1, _opts(cfg).chunk, MEAN_ABS if uses_mean_abs(cfg) else 0)


def warmup_codec(cfg: ServerConfig) -> Codec | None:
    """The codec of the warmup's published codes (``onebit_warmup_codes``,
    ``onebit_warmup_codec``); ``None``: warmup pulls carry the parameters."""
    opts = _opts(cfg)
    if not opts.warmup_codes:
        return None
    return Codec(pb.CODEC_BF16) if opts.warmup_codec == "bf16" else published_codec(cfg)
