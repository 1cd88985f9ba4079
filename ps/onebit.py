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
kernel and the same frozen v (workers fetch m and v once, with the RuleState call).

A worker whose copy of the key is at version ``b`` gets, in its pull reply, the payloads of
versions ``b+1 .. now`` (``frame_codecs`` = CODEC_SIGN1) and adds each to its copy exactly as the
shard did, so worker and shard hold bit-identical parameters; a worker further behind than the
history (or behind a warmup update, which has no payload) gets the float32 parameters instead
(CODEC_RAW). Both directions carry about one bit per element. docs/design.md (1-bit Adam) sets out
the shard-moment and sync layouts. With a frozen v, coordinates whose v is 0 never move
(``native.onebit_adam_delta``).

This module is the whole of 1-bit Adam on a shard, a plug-in: its settings (:class:`OneBitConfig`,
the ``OptimizerConfig.rule_config`` of ``onebit_adam``, and their ``bitps-server`` flags, kept in
``ps.onebit_config`` and re-exported here), a key's state (:class:`OneBitState`,
``Slot.rule_state``), what workers are told at registration (``proto/onebit.proto``
``OneBitParams``, packed into ``RegisterReply.rule_params``), its RuleState answer (sync: m and the
frozen v) and its gauges (``bitps_onebit_compressing_keys``, ``bitps_onebit_residual_norm``). The
worker's half is ``worker.algorithms.onebit``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client.core import GaugeMetricFamily

from bitps import native
from bitps.native import casts, sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import MEAN_ABS, Codec, Compressor
from bitps.proto.wire import PSError
from bitps.ps.config import ServerConfig
from bitps.ps.onebit_config import (
    MOMENTS,
    SCALES,
    SETTINGS,
    OneBitConfig,
    params,
    published_codec,
    uses_mean_abs,
    uses_worker_moments,
    warmup_codec,
)
from bitps.ps.publish import Publisher
from bitps.ps.pushcode import PushCode, PushCodes
from bitps.ps.rules import AdamW, KeyState, publish_update, raw_array, register

if TYPE_CHECKING:
    from bitps.ps.store import Slot

__all__ = ["MOMENTS", "SCALES", "OneBitAdam", "OneBitAdamShardMoments", "OneBitAdamSync",
           "OneBitAdamWorkerMoments", "OneBitConfig", "OneBitState", "SETTINGS", "new_state",
           "params", "published_codec", "uses_worker_moments"]


def new_state(adam: KeyState, cfg: ServerConfig) -> OneBitState:
    """A key's 1-bit Adam state around its Adam moments ``adam``, as ``cfg`` sets it up."""
    opts = cfg.optimizer.rule_config
    return OneBitState(adam, chunk=opts.chunk, history=cfg.optimizer.delta_history,
                       mean_abs=uses_mean_abs(cfg), sync=cfg.mode == "sync",
                       warmup_codec=warmup_codec(cfg), compact_state=opts.compact_state)


class OneBitState(KeyState):
    """One key's 1-bit Adam state (``Slot.rule_state``): the Adam moments and step count of
    ``KeyState``, and the switch, the frozen bias correction, m's code and the published
    codes."""

    def __init__(self, adam: KeyState, *, chunk: int, history: int, mean_abs: bool,
                 sync: bool, warmup_codec: Codec | None = None,
                 compact_state: bool = False) -> None:
        super().__init__(adam.step, adam.buf1, adam.buf2, adam.buffers)
        self.n = n = adam.buf1.size
        self.codec = Codec(pb.CODEC_SIGN1, chunk, MEAN_ABS if mean_abs else 0)
        self.sync = sync
        """Momentum lives on the workers (DeepSpeed's math): pushes are worker momenta, the
        published codes are the averaged momentum, every replica applies it."""
        self.warmup_codec = warmup_codec
        """Warmup updates are published as codes of the parameter change in this codec
        (``onebit_warmup_codes``, ``onebit_warmup_codec``); ``None``: workers pull the
        parameters."""
        self.compact_state = compact_state
        """sync: the state workers fetch at the switch is m's sign1 code and the denominators
        in bf16 (``onebit_compact_state``), both rounded so on the shard as well."""
        self._message: pb.KeyRuleState | None = None
        """The compact state message of the key's current version, made for the first worker
        that fetches it and sent as it is to the others (the switch is CPU-bound)."""
        self.compressing = False
        """False during warmup; True from the first compressed push on (v is frozen then,
        unless the workers keep the moments)."""
        self.bias_correction2_sqrt = 1.0
        self.m_code = b""
        """sync, after the switch: the sign1 code the shard's m is the decode of."""
        self.denominator: np.ndarray | None = None
        """After the switch (sync, shard moments): ``sqrt(v)/bc2 + eps`` of the frozen v, 0
        where v is 0 (``native.onebit_denominator``), made once by the rule at its first
        compressed update (:meth:`OneBitAdam.denominator`) instead of a square root every
        step; ``None`` until then and after anything that may change v (the switch, a load).
        Not saved: made again from v."""
        self.denominator_bits: np.ndarray | None = None
        """With ``onebit_compact_state``: the bf16 bits of :attr:`denominator` (uint16), as the
        RuleState call sends them, kept from where they are made."""
        self.mean_abs = mean_abs
        self.pub = Publisher(warmup_codec or self.codec, n, history=history)
        """The published codes (``ps.publish``): what pull replies carry; in the warmup's
        codec until the first compressed update (:meth:`OneBitAdam.update`)."""

    @property
    def server(self) -> Compressor:
        """The publisher's encoder: its residual is the shard's error feedback."""
        return self.pub.server

    def code_views(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Where a fused kernel writes the next published code (``native.publish``): the
        scales and sign bytes of the shard's encoder's buffer, and the code's size."""
        return sign1.payload_views(self.server.buffer, self.n, self.codec.chunk)

    def freeze(self, bias_correction2_sqrt: float) -> None:
        """Enter the compression stage: v and its bias correction stop changing.

        In sync mode the published codes become momenta, so the residual of the warmup's
        parameter-update codes is dropped (it is in other units); with
        ``onebit_compact_state`` m becomes the decode of its own sign1 code (as every later m
        is), the code workers fetch (the denominators they fetch are rounded to bf16 where
        they are made: :meth:`OneBitAdam.denominator`)."""
        self.compressing = True
        self.bias_correction2_sqrt = bias_correction2_sqrt
        self.denominator = self.denominator_bits = None
        if not self.sync:
            return
        self.server.residual.fill(0.0)
        if self.compact_state:
            self.m_code = bytes(Compressor(self.codec, self.n).encode(self.buf1))
            self._m_is_code = True  # m is that code's decode from now on (buf1)

    def state_message(self, key: int, version: int) -> pb.KeyRuleState:
        """The key's m and frozen v as the RuleState call sends them: with
        ``onebit_compact_state`` m's sign1 code and the shard's own bf16 denominators
        (:attr:`denominator_bits`, made first: :meth:`OneBitAdam.denominator`), exact; else
        float32 m and v (also when a checkpoint of a shard without it left no code of m),
        always exact."""
        if self._message is not None and self._message.version == version:
            return self._message  # one key per state: the version tells them apart
        msg = pb.KeyRuleState(key=key, version=version)
        if not (self.compact_state and self.m_code):
            msg.arrays.extend([raw_array("exp_avg", self.buf1), raw_array("exp_avg_sq",
                                                                          self.buf2)])
        else:
            bits = self.denominator_bits
            if bits is None:
                raise RuntimeError(f"key {key}: its denominators are not made yet "
                                   f"(OneBitAdam.denominator comes first)")
            _, chunk, flags = self.codec.wire_fields()
            msg.arrays.extend([
                pb.StateArray(name="exp_avg", codec=pb.CODEC_SIGN1, codec_chunk=chunk,
                              codec_flags=flags, length=self.n, data=self.m_code),
                pb.StateArray(name="denominator", dtype=pb.BFLOAT16, codec=pb.CODEC_RAW,
                              length=self.n, data=bits.tobytes())])
        msg.fields.update({"bias_correction2_sqrt": self.bias_correction2_sqrt,
                           "step": self.step})
        if self.compact_state and self.m_code:
            self._message = msg  # until the next update or load: the version then differs
        return msg

    def state_dict(self) -> dict:
        """``KeyState``'s layout (version 1) and ``compressing`` (int64[1]),
        ``bias_correction2_sqrt`` (float64[1]) and ``m_code`` (uint8: sign1 bytes, or none
        before sync's switch). The published codes and their residual are the publisher's
        (``ps.publish.Publisher.state_dict``)."""
        out = super().state_dict()
        out["compressing"] = np.array([self.compressing], np.int64)
        out["bias_correction2_sqrt"] = np.array([self.bias_correction2_sqrt], np.float64)
        out["m_code"] = np.frombuffer(self.m_code, np.uint8).copy()
        return out

    def load_state_dict(self, state: dict) -> None:
        size = self.codec.max_bytes(self.n)
        # the switch flags: one value each; m's code: none yet, or one code of the key
        self.check_state(state, {"compressing": ((1,),), "bias_correction2_sqrt": ((1,),),
                                 "m_code": ((0,), (size,))})
        self._m_is_code = False  # m comes whole from the state
        self._load(state)
        self.denominator = self.denominator_bits = None
        self.compressing = bool(state["compressing"][0])
        self.bias_correction2_sqrt = float(state["bias_correction2_sqrt"][0])
        self.m_code = np.asarray(state["m_code"], np.uint8).tobytes()
        self._message = None

    def publish(self, version: int, payload: memoryview) -> None:
        """Keep the payload that took the key to ``version`` (sync: the code m decodes from;
        the update's kernel did not write m, :attr:`buf1` decodes it when read)."""
        self._message = None
        self.pub.publish(version, payload)
        if self.sync:
            self.m_code = self.pub.history[-1][1]
            self._m_is_code = True

    @property
    def buf1(self) -> np.ndarray:
        """m (``KeyState.buf1``). sync, after a compressed update: the decode of
        :attr:`m_code`, made here at the first read after the update (reads, like every access
        to a key's state, under the shard core's lock). The update's kernel
        (``native.onebit_sync_publish``) keeps m in one chunk of scratch: a key-long m written
        every step, and read only by a checkpoint or a worker's fetch, cost each update a write
        of the key's length and the read for ownership before it (about 15 % of the kernel's
        time, docs/benchmarks.md)."""
        if self._m_is_code:
            self._m.fill(0.0)
            self.codec.decode_add(self.m_code, self.n, self._m)
            self._m_is_code = False
        return self._m

    @buf1.setter
    def buf1(self, value: np.ndarray) -> None:
        self._m, self._m_is_code = value, False

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
    config, settings = OneBitConfig, SETTINGS
    takes_hyperparameters = False  # sync workers apply the shard's lr x schedule themselves

    def __init__(self, cfg, server=None):
        super().__init__(cfg, server)
        self.opts: OneBitConfig = cfg.rule_config

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
        slot.rule_state = new_state(self.new_state(slot.length), self.server)
        slot.publisher = slot.rule_state.pub

    def update(self, slot, grad, *, clock, grad_scale=1.0, lr_scale=1.0):
        """Full Adam during the warmup; then the compressed update, added to the parameters
        exactly as workers will add it, and published."""
        ob = slot.rule_state
        if not ob.compressing or self._warmup_push(clock):
            if isinstance(grad, (PushCode, PushCodes)):  # sign1 pushes read as values
                grad = grad.decoded(slot.decode_buffer())
            if ob.warmup_codec is not None:
                # full Adam, published as the code of the parameter change
                return publish_update(slot, lambda dst: self.apply(
                    slot.param, grad, ob, grad_scale=grad_scale, lr_scale=lr_scale,
                    dst=dst), seed=0)
            self.apply(slot.writable(), grad, ob, grad_scale=grad_scale, lr_scale=lr_scale)
            slot.version += 1
            ob.forget()
            return
        # bf16 warmup codes end here, not at the switch: the pull of the warmup's last update
        # still gets its code (workers behind this update then pull the parameters)
        ob.pub.recode(ob.codec)
        payload = self._compressed(slot, grad, grad_scale, lr_scale)
        slot.version += 1
        ob.publish(slot.version, payload)

    def denominator(self, ob: OneBitState) -> np.ndarray:
        """``ob``'s frozen denominators (:attr:`OneBitState.denominator`), made at the first
        compressed update that needs them: v and its bias correction no longer change."""
        if ob.denominator is None:
            ob.denominator = np.empty(ob.n, np.float32)
            native.onebit_denominator(ob.buf2, np.float32(ob.bias_correction2_sqrt), self._eps,
                                      ob.denominator)
            if ob.compact_state and ob.sync:
                # what workers fetch (state_message), so what the shard applies with too: the
                # step size of each coordinate moves by at most 2**-9 of itself
                bits = ob.denominator_bits = np.empty(ob.n, np.uint16)
                casts.bf16_encode(ob.denominator, None, bits)
                ob.denominator.fill(0.0)
                casts.bf16_decode_add(bits, ob.n, ob.denominator)
        return ob.denominator

    def _warmup_push(self, clock: int) -> bool:
        """Whether a push computed at ``clock`` still gets a warmup step after the switch."""
        return False

    def takes_code(self, codec):
        # every layout's compressed update reads a pushed sign1 code in its kernel
        # (native.publish's _code kernels); a warmup step decodes it (update)
        return codec.id == pb.CODEC_SIGN1

    def check_push(self, header, slots, codec):
        """A push's meaning follows its clock: bf16 gradients before ``freeze_step``, sign1
        codes (momenta in sync, Adam directions with worker moments, gradients with shard
        moments) from it on, as the worker's codec schedule makes them. A push of the other
        phase's codec means the worker's step and this shard's disagree (the shard came back
        from an older checkpoint, or went on without a dropped worker, across the switch):
        read as the other kind it would corrupt the parameters without a trace, so it is
        refused (``BAD_DTYPE``) before anything changes. Raw pushes (keys below
        ``compress_min_bytes``) are both phases'."""
        warmup = header.clock < self.opts.freeze_step
        wrong = pb.CODEC_SIGN1 if warmup else pb.CODEC_BF16
        if codec.id == wrong:
            keys = [s.spec.key for s in slots][:8]
            raise PSError(pb.BAD_DTYPE, f"1-bit Adam push from worker {header.worker} for "
                          f"clock {header.clock}, keys {keys}: {codec.name} codes "
                          f"{'before' if warmup else 'after'} freeze_step "
                          f"{self.opts.freeze_step}; expected "
                          f"{'bf16 gradients' if warmup else 'sign1 codes'} (the worker's step "
                          f"and this shard's are on two sides of the switch)")

    def _compressed(self, slot: Slot, grad: np.ndarray, grad_scale: float,
                    lr_scale: float) -> memoryview:
        """One compression-stage update of ``slot``; returns the published payload."""
        raise NotImplementedError(f"{type(self).__name__} is the arithmetic alone; a shard "
                                  f"uses a layout (create)")

    def arrived(self, slot, clock):
        # async/ssp: pushes for clocks >= freeze_step are compression-stage pushes
        ob = slot.rule_state
        if clock >= self.opts.freeze_step and not ob.compressing:
            ob.freeze(self.bias_correction2_sqrt(ob))

    def aggregated(self, slot):
        ob = slot.rule_state
        if not ob.compressing and slot.version >= self.opts.freeze_step:
            # the warmup is complete: workers now fetch m and v (RuleState) and push momenta
            ob.freeze(self.bias_correction2_sqrt(ob))

    def published_codec(self):
        return published_codec(self.server)

    def rule_params(self):
        return params(self.server, self.ratio_clip)

    def collect(self, slots: Sequence[Slot]):
        states = [s.rule_state for s in slots]
        yield GaugeMetricFamily("bitps_onebit_compressing_keys",
                                "Keys past the 1-bit Adam warmup (v frozen, 1-bit traffic)",
                                value=sum(st.compressing for st in states))
        # a pass over every residual, at scrape time: a residual updated meanwhile only moves
        # the reading
        yield GaugeMetricFamily("bitps_onebit_residual_norm",
                                "L2 norm of the shard's error-feedback residuals",
                                value=float(np.sqrt(sum(st.server.residual_norm() ** 2
                                                        for st in states))))

    # -- arithmetic of the compression stage --------------------------------------------------
    def direction_delta(self, param: np.ndarray, direction: np.ndarray, out: np.ndarray, *,
                        grad_scale: float = 1.0, lr_scale: float = 1.0) -> None:
        """Worker moments, after warmup: write ``-lr * (clip(direction) + wd * param)`` to
        ``out``, ``direction`` being a worker's decoded Adam direction."""
        native.onebit_direction_delta(param, direction, out, np.float32(grad_scale), self._wd,
                                      self.neg_lr(lr_scale), np.float32(self.ratio_clip))


class OneBitAdamSync(OneBitAdam):
    """sync: pushes are worker momenta; their compressed mean is published as m and every
    replica applies it with the frozen v (DeepSpeed's compressed allreduce)."""

    def setup(self, slot):
        super().setup(slot)
        slot.sums_codes = True  # a step's pushed codes are summed in _compressed's kernel

    def _compressed(self, slot, grad, grad_scale, lr_scale):
        ob = slot.rule_state
        # grad is the sum of the workers' momenta: publish their compressed mean as m and
        # apply it with the frozen v as workers do (native.onebit_adam_apply_den), in one pass
        # (native.publish); a step's pushed codes are decoded and summed block by block in
        # that pass, and m stays the published code until read (OneBitState.publish)
        scales, bits, size = ob.code_views()
        f32 = np.float32
        ob.step += 1
        tail = (f32(grad_scale), ob.server.residual, scales, bits, self.denominator(ob),
                slot.writable(), np.int64(ob.codec.chunk), ob.mean_abs, self._wd,
                self.neg_lr(lr_scale), f32(self.ratio_clip))
        if isinstance(grad, PushCode):
            code_scales, code_bits, code_chunk = grad.sign1_sections()
            native.onebit_sync_publish_code((code_scales,), (code_bits,), code_chunk, *tail)
        elif isinstance(grad, PushCodes):
            native.onebit_sync_publish_code(*grad.sign1_sections(), *tail)
        else:
            native.onebit_sync_publish(grad, *tail)
        return memoryview(ob.server.buffer)[:size]

    def rule_state(self, slots):
        """Every key's m and frozen v, for workers at the switch; ``BAD_CLOCK`` while a key
        is still in its warmup."""
        out = []
        for key, slot in sorted(slots.items()):
            if not slot.rule_state.compressing:
                raise PSError(pb.BAD_CLOCK, f"key {key} is still in warmup (version "
                              f"{slot.version}, freeze_step {self.opts.freeze_step})")
            ob = slot.rule_state
            self.denominator(ob)
            out.append(ob.state_message(key, slot.version))
        return out

    def aggregated(self, slot):
        ob = slot.rule_state
        warmup = not ob.compressing
        super().aggregated(slot)
        if warmup and ob.compressing:
            # what workers fetch in the next step's backward, made now, while they wait for
            # this step's pull: at the fetch, each shard's build competed with both ranks'
            # backward for the CPU and took 0.5-1.2 s (docs/benchmarks.md, asynchrony on the LM)
            self.denominator(ob)
            if ob.compact_state:
                ob.state_message(slot.spec.key, slot.version)


class OneBitAdamWorkerMoments(OneBitAdam):
    """async/ssp, moments on the workers: pushes are Adam directions (Efficient-Adam)."""

    def _warmup_push(self, clock):
        # a push computed before the switch holds a gradient, not a direction: a late one (a
        # slower async worker's) gets a warmup step even after the switch
        return clock < self.opts.freeze_step

    def rule_state(self, slots):
        raise PSError(pb.BAD_HEADER, f"shard {self.server.shard_id} runs onebit_adam in "
                      f"{self.server.mode} mode with the moments on the workers: it keeps no "
                      f"Adam state to share")

    def _compressed(self, slot, grad, grad_scale, lr_scale):
        # direction_delta, its code and the code added to the parameters, in one pass (the
        # pushed code decoded in it, block by block, where it came as one)
        ob = slot.rule_state
        scales, bits, size = ob.code_views()
        tail = (np.float32(grad_scale), ob.server.residual, scales, bits,
                np.int64(ob.codec.chunk), ob.mean_abs, self._wd, self.neg_lr(lr_scale),
                np.float32(self.ratio_clip))
        if isinstance(grad, PushCode):
            native.onebit_direction_publish_code(slot.writable(), *grad.sign1_sections(), *tail)
        else:
            native.onebit_direction_publish(slot.writable(), grad, *tail)
        return memoryview(ob.server.buffer)[:size]


class OneBitAdamShardMoments(OneBitAdam):
    """async/ssp, moments on the shard: pushes are gradients; m is updated and v frozen."""

    def _compressed(self, slot, grad, grad_scale, lr_scale):
        # delta (m updated), its code and the code added to the parameters, in one pass
        ob, f32 = slot.rule_state, np.float32
        scales, bits, size = ob.code_views()
        ob.step += 1
        tail = (ob.buf1, self.denominator(ob), f32(grad_scale), ob.server.residual, scales,
                bits, np.int64(ob.codec.chunk), ob.mean_abs, self._one_minus_beta1, self._wd,
                self.neg_lr(lr_scale), f32(self.ratio_clip))
        if isinstance(grad, PushCode):
            native.onebit_moments_publish_code(slot.writable(), *grad.sign1_sections(), *tail)
        else:
            native.onebit_moments_publish(slot.writable(), grad, *tail)
        return memoryview(ob.server.buffer)[:size]

