"""1-bit Adam on a shard (async/SSP and sync): workers push error-feedback-compressed
directions, momenta or gradients, and the shard publishes compressed parameter updates.

Per key, after the warmup (``freeze_step`` clocks of full Adam on bf16 pushes), ``async`` and
``ssp`` with worker moments (``onebit_moments`` auto/worker, the default): every worker keeps
Adam's m and v of its own gradients (float32, never frozen;
``worker.algorithms.onebit.WorkerMoments``) and pushes ``sign1(direction + worker residual)``,
``direction = m/bc1 / (sqrt(v)/bc2 + eps)``; the shard, per push::

    delta   = -lr * (clip(decode(push)) + wd * x)
    payload = sign1(delta + server residual)
    x      += decode(payload)                    version += 1; payload kept in the history

This is Efficient-Adam's two-way compressed update. With the moments on the shard
(``onebit_moments=shard``: the shard keeps m and a frozen v)::

    g       = decode(push)                       (sync: the mean of the live workers' pushes)
    m       = lerp(m, g, 1 - beta1)              v frozen at the switch
    delta   = -lr * (m / (sqrt(v)/bc2 + eps) + wd * x)
    payload = sign1(delta + server residual)     residual = what the payload did not carry
    x      += decode(payload)                    version += 1; payload kept in the history

``sync`` reproduces DeepSpeed's compressed allreduce: each worker pushes
``sign1(lerp(m, g_i, 1 - beta1) + worker residual)``; the shard averages the decoded pushes,
publishes ``payload = sign1(mean + server residual)`` and sets ``m = decode(payload)``; the shard
and every worker then apply ``x -= lr * (m / (sqrt(v)/bc2 + eps) + wd * x)`` with the same
kernel and the same frozen v (workers fetch m and v once, with the OptimizerState RPC).

A worker whose copy of the key is at version ``b`` gets, in its pull reply, the payloads of
versions ``b+1 .. now`` (``frame_codecs`` = CODEC_SIGN1) and adds each to its copy exactly as the
shard did, so worker and shard hold bit-identical parameters; a worker further behind than the
history (or behind a warmup update, which has no payload) gets the float32 parameters instead
(CODEC_RAW). Both directions carry about one bit per element. docs/design.md (1-bit Adam) sets out
the shard-moment and sync layouts. With a frozen v, coordinates whose v is 0 never move
(``native.onebit_adam_delta``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bitps import native
from bitps.native import casts
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import MEAN_ABS, Codec, Compressor
from bitps.proto.wire import PSError
from bitps.ps.config import ServerConfig
from bitps.ps.publish import Publisher, publish_update
from bitps.ps.rules import AdamW, make_rule, register

if TYPE_CHECKING:
    from bitps.ps.rules import KeyState
    from bitps.ps.store import Slot

__all__ = ["OneBitAdam", "OneBitAdamShardMoments", "OneBitAdamSync", "OneBitAdamWorkerMoments",
           "OneBitState", "key_states", "new_state", "params", "published_codec",
           "uses_worker_moments"]


def uses_mean_abs(cfg: ServerConfig) -> bool:
    """The scale rule of the published codes (``onebit_scale``; ``auto`` = RMS in sync)."""
    scale = cfg.optimizer.onebit_scale
    return scale == "mean_abs" or (scale == "auto" and cfg.mode != "sync")


def params(cfg: ServerConfig) -> pb.OneBitParams | None:
    """What a RegisterReply tells workers (``None`` unless the shard runs onebit_adam)."""
    o = cfg.optimizer
    if o.name != "onebit_adam":
        return None
    return pb.OneBitParams(freeze_step=o.freeze_step, chunk=o.onebit_chunk,
                           codec_flags=MEAN_ABS if uses_mean_abs(cfg) else 0, lr=o.lr,
                           beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                           weight_decay=o.weight_decay, ratio_clip=make_rule(o).ratio_clip,
                           worker_moments=uses_worker_moments(cfg),
                           lr_warmup_steps=o.schedule.warmup_steps,
                           lr_decay_steps=o.schedule.decay_steps,
                           lr_min_ratio=o.schedule.min_ratio)


def uses_worker_moments(cfg: ServerConfig) -> bool:
    """async/ssp with ``onebit_moments`` auto or worker: workers keep Adam's moments."""
    return cfg.mode != "sync" and cfg.optimizer.onebit_moments != "shard"


def published_codec(cfg: ServerConfig) -> Codec:
    """The sign1 codec of every code a 1-bit Adam shard publishes (and workers push)."""
    return Codec(pb.CODEC_SIGN1, cfg.optimizer.onebit_chunk,
                 MEAN_ABS if uses_mean_abs(cfg) else 0)


def new_state(n: int, cfg: ServerConfig) -> OneBitState:
    """A key's 1-bit Adam state, as ``cfg`` sets it up."""
    o = cfg.optimizer
    return OneBitState(n, chunk=o.onebit_chunk, history=o.delta_history,
                       mean_abs=uses_mean_abs(cfg), sync=cfg.mode == "sync",
                       warmup_codes=o.onebit_warmup_codes)


def key_states(slots: dict[int, Slot], cfg: ServerConfig) -> list[pb.KeyOptimizerState]:
    """sync 1-bit Adam: every key's momentum and frozen v (the OptimizerState RPC); raises
    :class:`PSError` for another rule or mode, or while a key is still in warmup."""
    if cfg.optimizer.name != "onebit_adam" or cfg.mode != "sync":
        raise PSError(pb.BAD_HEADER, f"shard {cfg.shard_id} runs {cfg.optimizer.name} in "
                      f"{cfg.mode} mode; optimizer state is only shared by sync onebit_adam")
    out = []
    for key, slot in sorted(slots.items()):
        if not slot.onebit.compressing:
            raise PSError(pb.BAD_CLOCK, f"key {key} is still in warmup (version {slot.version}, "
                          f"freeze_step {cfg.optimizer.freeze_step})")
        out.append(slot.onebit.state_message(key, slot.version, slot.state))
    return out


class OneBitState:
    """One key's 1-bit Adam state beyond the Adam moments (which live in ``KeyState``)."""

    def __init__(self, n: int, *, chunk: int, history: int, mean_abs: bool,
                 sync: bool, warmup_codes: bool = False) -> None:
        self.n = n
        self.codec = Codec(pb.CODEC_SIGN1, chunk, MEAN_ABS if mean_abs else 0)
        self.sync = sync
        """Momentum lives on the workers (DeepSpeed's math): pushes are worker momenta, the
        published codes are the averaged momentum, every replica applies it."""
        self.warmup_codes = warmup_codes
        """Warmup updates are published as sign1 codes of the parameter change
        (``onebit_warmup_codes``) instead of leaving workers to pull the parameters."""
        self.compressing = False
        """False during warmup; True from the first compressed push on (v is frozen then,
        unless the workers keep the moments)."""
        self.bias_correction2_sqrt = 1.0
        self.m_code = b""
        """sync, after the switch: the sign1 code the shard's m is the decode of."""
        self.pub = Publisher(self.codec, n, history=history)
        """The published codes (``ps.publish``): what pull replies carry."""
        self.server, self.delta = self.pub.server, self.pub.delta

    def freeze(self, bias_correction2_sqrt: float, state: KeyState) -> None:
        """Enter the compression stage: v and its bias correction stop changing.

        In sync mode the published codes become momenta, so the residual of the warmup's
        parameter-update codes is dropped (it is in other units); with
        ``onebit_warmup_codes`` the state workers fetch once is made compact as well: m
        becomes the decode of its own sign1 code (as every later m is) and v is rounded to
        bf16, the same on the shard as on the workers that fetch them."""
        self.compressing = True
        self.bias_correction2_sqrt = bias_correction2_sqrt
        if not self.sync:
            return
        self.server.residual.fill(0.0)
        if self.warmup_codes:
            self.m_code = bytes(Compressor(self.codec, self.n).encode(state.buf1))
            state.buf1.fill(0.0)
            self.codec.decode_add(self.m_code, self.n, state.buf1)
            bits = np.empty(self.n, np.uint16)
            casts.bf16_encode(state.buf2, None, bits)
            state.buf2.fill(0.0)
            casts.bf16_decode_add(bits, self.n, state.buf2)

    def state_message(self, key: int, version: int, state: KeyState) -> pb.KeyOptimizerState:
        """The key's m and frozen v as the OptimizerState RPC sends them (``compact`` with
        ``onebit_warmup_codes``: m's sign1 code and v in bf16, exact since v was rounded)."""
        if not self.warmup_codes:
            return pb.KeyOptimizerState(key=key, version=version, exp_avg=state.buf1.tobytes(),
                                        exp_avg_sq=state.buf2.tobytes(),
                                        bias_correction2_sqrt=self.bias_correction2_sqrt)
        bits = np.empty(self.n, np.uint16)
        casts.bf16_encode(state.buf2, None, bits)
        return pb.KeyOptimizerState(key=key, version=version, exp_avg=self.m_code,
                                    exp_avg_sq=bits.tobytes(), compact=True,
                                    bias_correction2_sqrt=self.bias_correction2_sqrt)

    def publish(self, version: int, payload: memoryview) -> None:
        """Keep the payload that took the key to ``version`` (sync: the code m decodes from)."""
        self.pub.publish(version, payload)
        if self.sync:
            self.m_code = self.pub.history[-1][1]

    def forget(self) -> None:
        """A warmup update has no payload: workers behind it need the full parameters."""
        self.pub.forget()


@register
class OneBitAdam(AdamW):
    """1-bit Adam: AdamW (decoupled decay) for ``freeze_step`` clocks, then compressed updates
    in one of three layouts (the module docstring): :class:`OneBitAdamSync` (DeepSpeed's
    momenta), :class:`OneBitAdamWorkerMoments` and :class:`OneBitAdamShardMoments`
    (async/ssp). This class alone is the arithmetic, for tests; a shard gets a layout."""

    name = "onebit_adam"

    @classmethod
    def create(cls, cfg, server=None):
        if server is None:
            return cls(cfg, None)
        if server.mode == "sync":  # the layout follows the mode: DeepSpeed's is sync-only
            return OneBitAdamSync(cfg, server)
        if uses_worker_moments(server):
            return OneBitAdamWorkerMoments(cfg, server)
        return OneBitAdamShardMoments(cfg, server)

    # -- a key on a shard ---------------------------------------------------------------------
    def setup(self, slot):
        slot.onebit = new_state(slot.length, self.server)
        slot.publisher = slot.onebit.pub

    def update(self, slot, grad, *, clock, grad_scale=1.0, lr_scale=1.0):
        """Full Adam during the warmup; then the compressed update, added to the parameters
        exactly as workers will add it, and published."""
        ob = slot.onebit
        if not ob.compressing or self._warmup_push(clock):
            if ob.warmup_codes:
                # full Adam, published as the sign1 code of the parameter change
                return publish_update(slot, lambda dst: self.apply(
                    slot.param, grad, slot.state, grad_scale=grad_scale, lr_scale=lr_scale,
                    dst=dst), seed=0)
            self.apply(slot.writable(), grad, slot.state, grad_scale=grad_scale,
                       lr_scale=lr_scale)
            slot.version += 1
            ob.forget()
            return
        payload = self._compressed(slot, grad, grad_scale, lr_scale)
        slot.version += 1
        ob.publish(slot.version, payload)

    def _warmup_push(self, clock: int) -> bool:
        """Whether a push computed at ``clock`` still gets a warmup step after the switch."""
        return False

    def _compressed(self, slot: Slot, grad: np.ndarray, grad_scale: float,
                    lr_scale: float) -> memoryview:
        """One compression-stage update of ``slot``; returns the published payload."""
        raise NotImplementedError(f"{type(self).__name__} is the arithmetic alone; a shard "
                                  f"uses a layout (create)")

    def arrived(self, slot, clock):
        # async/ssp: pushes for clocks >= freeze_step are compression-stage pushes
        if clock >= self.cfg.freeze_step and not slot.onebit.compressing:
            slot.onebit.freeze(self.bias_correction2_sqrt(slot.state), slot.state)

    def aggregated(self, slot):
        ob = slot.onebit
        if not ob.compressing and slot.version >= self.cfg.freeze_step:
            # the warmup is complete: workers now fetch m and v (OptimizerState) and push momenta
            ob.freeze(self.bias_correction2_sqrt(slot.state), slot.state)

    def published_codec(self):
        return published_codec(self.server)

    def register_params(self):
        return params(self.server)

    def optimizer_state(self, slots):
        return key_states(slots, self.server)

    def compressing_keys(self, slots):
        return sum(s.onebit.compressing for s in slots.values())

    def save_state(self, slot):
        out = super().save_state(slot)
        ob = slot.onebit
        if ob is not None:
            out["compressing"] = np.array([ob.compressing], np.int64)
            out["bias_correction2_sqrt"] = np.array([ob.bias_correction2_sqrt], np.float64)
            out["m_code"] = np.frombuffer(ob.m_code, np.uint8).copy()
        return out

    def load_state(self, slot, arrays):
        ob = slot.onebit
        extra = ("compressing", "bias_correction2_sqrt", "m_code") if ob is not None else ()
        if missing := [k for k in extra if k not in arrays]:
            raise PSError(pb.BAD_HEADER, f"key {slot.spec.key}: onebit_adam state lacks "
                          f"{missing}")
        if ob is not None:
            m_code, size = arrays["m_code"], ob.codec.max_bytes(ob.n)
            if m_code.size not in (0, size) or arrays["compressing"].shape != (1,) \
                    or arrays["bias_correction2_sqrt"].shape != (1,):
                raise PSError(pb.BAD_LENGTH, f"key {slot.spec.key}: onebit_adam state of "
                              f"m code {m_code.size} bytes (expected 0 or {size}) and flags "
                              f"{arrays['compressing'].shape}; expected one value each")
        super().load_state(slot, {k: v for k, v in arrays.items() if k not in extra})
        if ob is not None:
            ob.compressing = bool(arrays["compressing"][0])
            ob.bias_correction2_sqrt = float(arrays["bias_correction2_sqrt"][0])
            ob.m_code = arrays["m_code"].tobytes()

    # -- arithmetic of the compression stage --------------------------------------------------
    def delta(self, param: np.ndarray, grad: np.ndarray, state: KeyState, out: np.ndarray, *,
              bias_correction2_sqrt: float, grad_scale: float = 1.0,
              lr_scale: float = 1.0) -> None:
        """After warmup: update the momentum with ``grad * grad_scale`` and write the
        parameter update ``-lr * (m / (sqrt(v)/bc2 + eps) + wd * param)`` to ``out`` (v and
        its bias correction frozen at the switch; m's correction is ~1 by then and omitted, as
        in DeepSpeed)."""
        f32 = np.float32
        state.step += 1
        native.onebit_adam_delta(param, grad, state.buf1, state.buf2, out, f32(grad_scale),
                                 self._one_minus_beta1, self._eps, self._wd,
                                 self.neg_lr(lr_scale), f32(bias_correction2_sqrt),
                                 f32(self.ratio_clip))

    def apply_momentum(self, param: np.ndarray, state: KeyState, *,
                       bias_correction2_sqrt: float, lr_scale: float = 1.0) -> None:
        """sync: ``state.buf1`` holds the published momentum; apply it with the frozen v,
        exactly as workers do (``native.onebit_adam_apply``)."""
        f32 = np.float32
        state.step += 1
        native.onebit_adam_apply(param, state.buf1, state.buf2, self._eps, self._wd,
                                 self.neg_lr(lr_scale), f32(bias_correction2_sqrt),
                                 f32(self.ratio_clip))

    def direction_delta(self, param: np.ndarray, direction: np.ndarray, out: np.ndarray, *,
                        grad_scale: float = 1.0, lr_scale: float = 1.0) -> None:
        """Worker moments, after warmup: write ``-lr * (clip(direction) + wd * param)`` to
        ``out``, ``direction`` being a worker's decoded Adam direction."""
        native.onebit_direction_delta(param, direction, out, np.float32(grad_scale), self._wd,
                                      self.neg_lr(lr_scale), np.float32(self.ratio_clip))


class OneBitAdamSync(OneBitAdam):
    """sync: pushes are worker momenta; their compressed mean is published as m and every
    replica applies it with the frozen v (DeepSpeed's compressed allreduce)."""

    def _compressed(self, slot, grad, grad_scale, lr_scale):
        ob = slot.onebit
        # grad is the sum of the workers' momenta: publish their compressed mean as m
        np.multiply(grad, np.float32(grad_scale), out=ob.delta)
        payload = ob.server.encode(ob.delta)
        slot.state.buf1.fill(0.0)
        ob.codec.decode_add(payload, slot.length, slot.state.buf1)
        self.apply_momentum(slot.writable(), slot.state, lr_scale=lr_scale,
                            bias_correction2_sqrt=ob.bias_correction2_sqrt)
        return payload


class OneBitAdamWorkerMoments(OneBitAdam):
    """async/ssp, moments on the workers: pushes are Adam directions (Efficient-Adam)."""

    def _warmup_push(self, clock):
        # a push computed before the switch holds a gradient, not a direction: a late one (a
        # slower async worker's) gets a warmup step even after the switch
        return clock < self.cfg.freeze_step

    def _compressed(self, slot, grad, grad_scale, lr_scale):
        ob = slot.onebit
        self.direction_delta(slot.param, grad, ob.delta, grad_scale=grad_scale,
                             lr_scale=lr_scale)
        payload = ob.server.encode(ob.delta)
        ob.codec.decode_add(payload, slot.length, slot.writable())
        return payload


class OneBitAdamShardMoments(OneBitAdam):
    """async/ssp, moments on the shard: pushes are gradients; m is updated and v frozen."""

    def _compressed(self, slot, grad, grad_scale, lr_scale):
        ob = slot.onebit
        self.delta(slot.param, grad, slot.state, ob.delta, grad_scale=grad_scale,
                   lr_scale=lr_scale, bias_correction2_sqrt=ob.bias_correction2_sqrt)
        payload = ob.server.encode(ob.delta)
        ob.codec.decode_add(payload, slot.length, slot.writable())
        return payload
