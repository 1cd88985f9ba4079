"""The worker's part of 1-bit Adam (``ps.onebit``): the momentum of sync 1-bit Adam
(:class:`OneBitMomentum`) and the Adam moments of async/ssp 1-bit Adam with worker moments
(:class:`WorkerMoments`).

sync (DeepSpeed's compressed-allreduce math):

After the warmup a worker keeps, per key, the momentum ``m`` (the last published one, the same on
every replica: kept as that code, which decodes to it) and the frozen second moment ``v`` it
fetched once from the shard (kept as the denominator ``sqrt(v)/bc2 + eps``, which is all the
apply reads). It pushes its own momentum ``lerp(m, g, 1 - beta1)`` (the encoder compresses it
with error feedback) and, for every published code in a pull reply, sets ``m = decode(code)``
and applies ``x -= lr * (m / (sqrt(v)/bc2 + eps) + wd * x)`` with the shard's kernel, so its
copy stays bit-identical to the shard's.

``async``/``ssp`` with worker moments (the default): a worker keeps m and v of its own gradients
for every key, advances them with each push from the first step on, and from the switch on
pushes the Adam direction ``m/bc1 / (sqrt(v)/bc2 + eps)`` (the encoder compresses it with error
feedback, or sends it raw below ``compress_min_bytes``). The shard publishes parameter updates
that the channel adds, as with shard moments (``onebit_moments=shard``), where nothing here is
used.

The shard's registration reply names the rule (``RegisterReply.rule``, :data:`RULE`) and packs
its :class:`OneBitParams` (``proto/onebit.proto``) in ``RegisterReply.rule_params``; the
momenta and frozen v come from the generic RuleState call (``ControlClient.rule_state``)
in the layout ``proto/onebit.proto`` documents.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
from prometheus_client.core import GaugeMetricFamily

from bitps import native
from bitps.native import casts, push, sign1
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import MEAN_ABS, Codec, Compressor
from bitps.proto.onebit_pb2 import OneBitParams
from bitps.proto.schedule import LRSchedule
from bitps.proto.wire import PSError
from bitps.worker.push_policy import PushPolicy, register_policy

__all__ = ["RULE", "MomentsPush", "OneBitMomentum", "OneBitParams", "SyncMomenta",
           "WorkerMoments", "push_policy"]

RULE = "onebit_adam"
"""The shard's update rule (``RegisterReply.rule``) whose replies these policies claim."""
_WARMUP_CODEC = Codec(pb.CODEC_BF16)


class OneBitMomentum:
    """Per-key momentum and frozen second moment of one worker (sync 1-bit Adam)."""

    def __init__(self, params: OneBitParams) -> None:
        f32 = np.float32
        self.params = params
        self._one_minus_beta1 = f32(1 - params.beta1)
        # the same float32 scalars as the shard's UpdateRule, from the same doubles
        self._eps, self._wd = f32(params.eps), f32(params.weight_decay)
        self._lr = params.lr
        self._schedule = LRSchedule(warmup_steps=params.lr_warmup_steps,
                                    decay_steps=params.lr_decay_steps,
                                    min_ratio=params.lr_min_ratio)
        self._ratio_clip = f32(params.ratio_clip)
        self.m: dict[int, np.ndarray] = {}
        """m as fetched at the switch, until the key's first published momentum replaces it."""
        self.m_code: dict[int, np.ndarray] = {}
        """The last published momentum per key (its sign1 code, uint8, of the shard's chunk
        ``OneBitParams.chunk``): m is its decode, which the kernels make chunk by chunk
        (``native.push``) instead of keeping m."""
        self.denominator: dict[int, np.ndarray] = {}
        """Per key, ``sqrt(v)/bc2 + eps`` of the frozen v fetched (0 where v is 0;
        ``native.onebit_denominator``, the shard's own): what every apply divides by, made once
        instead of a square root every step. v itself is not kept."""
        self._spare: dict[int, np.ndarray] = {}
        """Per key not loaded yet, the zeroed array its denominators will be loaded into
        (:meth:`reserve`)."""
        self._u: dict[int, np.ndarray] = {}

    def reserve(self, lengths: Mapping[int, int]) -> None:
        """Make and write (fault in) the zeroed arrays that the keys' denominators will be
        loaded into, 4 bytes per element, now rather than at the switch: there, while both ranks
        run backward, the page faults of fresh arrays made the load of the LM's denominators
        take 0.5-0.6 s of CPU per worker, against 0.02 s for the decode into memory already
        written (docs/benchmarks.md, asynchrony on the LM). Keys loaded or reserved already are
        left as they are."""
        for key, n in lengths.items():
            if key not in self.denominator and key not in self._spare:
                spare = self._spare[key] = np.empty(n, np.float32)
                spare.fill(0.0)  # np.zeros maps pages lazily: the faults would come at the load

    def loaded(self, key: int) -> bool:
        return key in self.m or key in self.m_code

    def forget(self, key: int) -> None:
        """Drop ``key``'s m and v: fetched again at its next compressed push."""
        for held in (self.m, self.m_code, self.denominator, self._u):
            held.pop(key, None)

    def momentum_of(self, key: int) -> np.ndarray:
        """``key``'s m as float32 (the decode of its last published momentum, or as fetched)."""
        code = self.m_code.get(key)
        if code is None:
            return self.m[key]
        n = self.denominator[key].shape[0]
        return sign1.decode(code, n, np.empty(n, np.float32), chunk=self.params.chunk)

    def load(self, state: pb.KeyRuleState, n: int) -> None:
        """Take one key's state (``n`` elements) from the RuleState call, in one of two layouts
        (``proto/onebit.proto``): float32 arrays ``exp_avg`` and ``exp_avg_sq`` with the field
        ``bias_correction2_sqrt``, from which the denominators are made; or (the shard's
        ``onebit_compact_state``) ``exp_avg`` as the sign1 code m decodes from and the shard's
        own ``denominator`` in bf16, both kept as they are: no decode, no square root, the
        least CPU at a switch where backward wants it too. :class:`PSError` ``BAD_LENGTH`` when
        the bytes do not fit ``n``, ``BAD_HEADER`` when an array or the field is missing."""
        arrays = {a.name: a for a in state.arrays}
        m = arrays.get("exp_avg")
        den = arrays.get("denominator")
        v = arrays.get("exp_avg_sq")
        if m is None or (den is None and (v is None or "bias_correction2_sqrt"
                                          not in state.fields)):
            raise PSError(pb.BAD_HEADER, f"key {state.key}: rule state of arrays "
                          f"{sorted(arrays)} and fields {sorted(state.fields)}; expected "
                          f"exp_avg with exp_avg_sq and bias_correction2_sqrt, or with "
                          f"denominator")
        compact = m.codec == pb.CODEC_SIGN1
        second = den if den is not None else v
        chunk = (m.codec_chunk or self.params.chunk) if compact else self.params.chunk
        sizes = (sign1.payload_bytes(n, chunk) if compact else 4 * n,
                 2 * n if second.dtype == pb.BFLOAT16 else 4 * n)
        if (len(m.data), len(second.data)) != sizes or m.length != n or second.length != n:
            raise PSError(pb.BAD_LENGTH, f"key {state.key}: optimizer state of "
                          f"{len(m.data)} + {len(second.data)} bytes; expected "
                          f"{sizes[0]} + {sizes[1]} for {n} elements"
                          + (" (compact)" if compact else ""))
        out = self._spare.pop(state.key, None)
        if out is None or out.shape[0] != n:
            out = np.zeros(n, np.float32)
        if second.dtype == pb.BFLOAT16:
            casts.bf16_decode_add(second.data, n, out)
        else:
            np.copyto(out, np.frombuffer(second.data, np.float32))
        if den is None:  # v: the denominators made here, the shard's kernel (in place)
            native.onebit_denominator(out, np.float32(state.fields["bias_correction2_sqrt"]),
                                      self._eps, out)
        self.denominator[state.key] = out
        # m last: :meth:`loaded` reads it, so an encoder thread that sees the key loaded finds
        # the denominators in place too
        if compact and chunk == self.params.chunk:
            self.m_code[state.key] = np.frombuffer(m.data, np.uint8).copy()
        elif compact:
            self.m[state.key] = sign1.decode(m.data, n, np.empty(n, np.float32), chunk=chunk)
        else:
            self.m[state.key] = np.frombuffer(m.data, np.float32).copy()

    def momentum(self, key: int, grad: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """This worker's momentum ``m + (1 - beta1) * (g - m)`` for ``g = grad * scale`` (the
        clip factor; float32; an array reused per key: send it before the next call)."""
        m = self.momentum_of(key)
        u = self._u.get(key)
        if u is None:
            u = self._u[key] = np.empty_like(m)
        if scale != 1.0:
            np.multiply(grad, np.float32(scale), out=u)
            grad = u
        np.subtract(grad, m, out=u)
        np.multiply(u, self._one_minus_beta1, out=u)
        np.add(u, m, out=u)
        return u

    def encode(self, key: int, grad: np.ndarray, comp: Compressor, scale: float = 1.0
               ) -> memoryview:
        """:meth:`momentum` for ``grad * scale`` through ``comp`` (sign1, with its error
        feedback) in one pass (``native.push.onebit_momentum_encode``): the payload, bit for bit
        what ``comp.encode(momentum(key, grad, scale))`` gives; valid until ``comp``'s next
        encode."""
        codec = comp.codec
        scales, bits, size = sign1.payload_views(comp.buffer, grad.shape[0], codec.chunk)
        tail = (np.float32(scale), self._one_minus_beta1, comp.residual, scales, bits,
                np.int64(codec.chunk), bool(codec.flags & MEAN_ABS))
        code = self.m_code.get(key)
        if code is not None and codec.chunk == self.params.chunk:
            push.onebit_momentum_encode_coded(grad, code, *tail)  # m decoded chunk by chunk
        else:
            push.onebit_momentum_encode(grad, self.momentum_of(key), *tail)
        return memoryview(comp.buffer)[:size]

    def is_momentum(self, version: int) -> bool:
        """Whether the code that made ``version`` is a published momentum: every update after
        the warmup's ``freeze_step`` ones (sync mode makes one update per clock). A warmup
        update's code (``onebit_warmup_codes``) is a parameter change, added as it is."""
        return version > self.params.freeze_step

    def add(self, key: int, code, out: np.ndarray, codec, version: int) -> None:
        """The transport's ``CodeApplier``: a published momentum goes through :meth:`apply`,
        a warmup code is decoded and added."""
        if self.is_momentum(version):
            self.apply(key, code, out, codec.chunk, version)
        else:
            codec.decode_add(code, out.shape[0], out)

    def apply(self, key: int, code, out: np.ndarray, chunk: int, version: int) -> None:
        """One published momentum ``code`` (a sign1 payload), the update that made the key's
        ``version``: update ``out`` (this worker's copy of the key) exactly as the shard updated
        its own, with the learning rate of clock ``version - 1``, and keep the code as m
        (``ps.rules.UpdateRule.neg_lr``: the same float32 from the same doubles)."""
        neg_lr = np.float32(-(self._lr * self._schedule.factor(version - 1)))
        # one pass: each chunk's m decoded from the code in L1, then applied; the code is
        # kept as m (was m.fill(0), decode_add into m, the apply)
        push.onebit_code_apply(code, self.denominator[key], out, chunk, self._wd, neg_lr,
                               self._ratio_clip)
        if chunk != self.params.chunk:  # not the chunk the push decodes m with: keep m itself
            self.m_code.pop(key, None)
            self.m[key] = sign1.decode(code, out.shape[0], np.empty(out.shape[0], np.float32),
                                       chunk=chunk)
            return
        kept = self.m_code.get(key)
        if kept is None or kept.shape[0] != len(code):
            kept = self.m_code[key] = np.empty(len(code), np.uint8)
        kept[:] = np.frombuffer(code, np.uint8)
        self.m.pop(key, None)  # the fetched m is spent: the code is m from now on


class WorkerMoments:
    """Adam's first and second moments of this worker's own gradients, per key (async/ssp 1-bit
    Adam with worker moments): float32 arrays and a step count per key, the arithmetic of the
    shard's Adam (``native.adam_direction``)."""

    def __init__(self, params: OneBitParams) -> None:
        f32 = np.float32
        self.beta1, self.beta2 = params.beta1, params.beta2  # beta1: m's decay per push
        # float32 scalars from the shard's doubles, complements in float64 as torch takes them
        self._beta2 = f32(params.beta2)
        self._one_minus_beta2, self._eps = f32(1 - params.beta2), f32(params.eps)
        self.m: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.steps: dict[int, int] = {}
        self._out: dict[int, np.ndarray] = {}

    @property
    def beta1(self) -> float:
        """m's decay per push (``OneBitParams.beta1``, or its W-th power: ``MomentsPush``)."""
        return self._beta1

    @beta1.setter
    def beta1(self, beta1: float) -> None:
        if not 0 <= beta1 < 1:
            raise ValueError(f"beta1 {beta1}; expected 0 <= beta1 < 1")
        self._beta1, self._one_minus_beta1 = beta1, np.float32(1 - beta1)

    def direction(self, key: int, grad: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """Advance ``key``'s moments with ``grad * scale`` (the clip factor) and return Adam's
        direction for it (float32; an array reused per key: send it before the next call)."""
        m = self.m.get(key)
        if m is None:
            m = self.m[key] = np.zeros_like(grad)
            self.v[key] = np.zeros_like(grad)
            self._out[key] = np.empty_like(grad)
        t = self.steps[key] = self.steps.get(key, 0) + 1
        out = self._out[key]
        native.adam_direction(grad, m, self.v[key], out, self._one_minus_beta1, self._beta2,
                              self._one_minus_beta2, self._eps,
                              *self._corrections(t), np.float32(scale))
        return out

    def encode(self, key: int, grad: np.ndarray, comp: Compressor, scale: float = 1.0
               ) -> memoryview:
        """:meth:`direction` for ``grad * scale`` through ``comp`` (sign1, with its error
        feedback) in one pass (``native.push.adam_direction_encode``): the payload, bit for bit
        what ``comp.encode(direction(key, grad, scale))`` gives; valid until ``comp``'s next
        encode."""
        if key not in self.m:
            self.m[key], self.v[key] = np.zeros_like(grad), np.zeros_like(grad)
            self._out[key] = np.empty_like(grad)
        t = self.steps[key] = self.steps.get(key, 0) + 1
        codec = comp.codec
        scales, bits, size = sign1.payload_views(comp.buffer, grad.shape[0], codec.chunk)
        push.adam_direction_encode(grad, self.m[key], self.v[key], self._one_minus_beta1,
                                   self._beta2, self._one_minus_beta2, self._eps,
                                   *self._corrections(t), np.float32(scale), comp.residual,
                                   scales, bits, np.int64(codec.chunk),
                                   bool(codec.flags & MEAN_ABS))
        return memoryview(comp.buffer)[:size]

    def _corrections(self, t: int) -> tuple[np.float32, np.float32]:
        """``1 / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)`` as float32, as torch takes them."""
        return np.float32(1 / (1 - self.beta1**t)), np.float32((1 - self.beta2**t) ** 0.5)

    def correct(self, key: int, grad: np.ndarray, residual: np.ndarray, used: float,
                exact: float, *, directions: bool) -> None:
        """The last :meth:`direction` of ``key`` used clip factor ``used``; the step's exact one
        is ``exact`` (``worker.training.clip``): move m and v to what ``exact`` gives and add what
        the push missed to its error-feedback ``residual`` (the direction's change when
        ``directions``, else the gradient's)."""
        f32 = np.float32
        native.adam_direction_correct(
            grad, self.m[key], self.v[key], residual,
            f32((1 - self.beta1) * (exact - used)),
            f32((1 - self.beta2) * (exact * exact - used * used)), f32(exact - used),
            self._eps, *self._corrections(self.steps[key]), directions)

    def state(self) -> dict[int, tuple[int, np.ndarray, np.ndarray]]:
        """Every key's ``(step, m, v)``: the state to save (arrays owned by this object)."""
        return {k: (self.steps[k], self.m[k], self.v[k]) for k in self.m}

    def load(self, key: int, step: int, m: np.ndarray, v: np.ndarray) -> None:
        """Restore one key's moments (shapes and dtypes checked by the caller)."""
        self.m[key], self.v[key] = m.copy(), v.copy()
        self.steps[key] = step
        self._out[key] = np.empty_like(m)


# -- push policies (``worker.push_policy``)
# ------------------------------------------------------

class _OneBitPush(PushPolicy):
    """bf16 gradients before ``freeze_step``, sign1 from it on, with the shard's chunk."""

    keeps_state = True
    chooses_codecs = True

    def __init__(self, params: OneBitParams) -> None:
        self.params = params
        self.freeze_step = params.freeze_step

    def codec_at(self, clock, configured):
        if clock < self.freeze_step:
            return _WARMUP_CODEC
        # the shard's chunk: one knob for both directions
        return Codec(pb.CODEC_SIGN1, self.params.chunk, configured.flags & MEAN_ABS)

    def fuses(self, comp: Compressor, clock: int) -> bool:
        """Whether a push of ``comp``'s key at ``clock`` is made in one fused pass: after the
        warmup, through a sign1 compressor."""
        return clock >= self.freeze_step and comp.codec.id == pb.CODEC_SIGN1

    def collect(self, clock):
        yield GaugeMetricFamily("bitps_worker_onebit_phase",
                                "1-bit Adam: 0 = warmup (bf16 pushes), 1 = compression",
                                value=int(clock >= self.freeze_step))


class SyncMomenta(_OneBitPush):
    """sync 1-bit Adam: from the switch on, push this worker's momentum (fetched once with the
    frozen v through the encoder's rule-state fetch), and apply published momenta."""

    def __init__(self, params: OneBitParams) -> None:
        super().__init__(params)
        self.momentum = OneBitMomentum(params)
        self.codes = self.momentum
        self._fetching = threading.Lock()
        """The encoder's threads encode keys at once (``EncoderConfig.threads``): one of them
        fetches a shard's m and v, the others wait for it instead of fetching them again."""

    def bind(self, fetch, plan, *, pushers=None):
        super().bind(fetch, plan, pushers=pushers)
        self._fetch = fetch
        self.momentum.reserve({k.key: k.length for k in plan.keys})

    def prepare(self, keys, grads, clock, clip):
        if not grads or clock < self.freeze_step:
            return grads, clip, False
        if not all(self.momentum.loaded(k) for k in keys):
            with self._fetching:
                self._fetch_missing()
        # the clip factor goes into the momentum
        return [self.momentum.momentum(k, g, clip) for k, g in zip(keys, grads)], 1.0, True

    def moved(self, keys):
        # the shard's m and v are not those fetched (it restored older ones, or it is before
        # the switch again): fetched anew once its keys push momenta
        for key in keys:
            self.momentum.forget(key)

    def encode(self, key, grad, comp, *, clock, clip):
        if not self.fuses(comp, clock):
            return None
        if not self.momentum.loaded(key):
            with self._fetching:
                if not self.momentum.loaded(key):
                    self._fetch_missing()
        return self.momentum.encode(key, grad, comp, clip)

    def _fetch_missing(self) -> None:
        """m and v of every key of the plan not loaded yet, from all their shards at once (the
        call streams the shards together), at the first compressed push: a worker needs
        them all within the step, and one key at a time would wait for each shard in turn."""
        self._fetch([k.key for k in self.plan.keys if not self.momentum.loaded(k.key)],
                    self.momentum.load)

    def correct(self, key, grad, residual, *, clock, used, exact):
        # the pushed momentum lerp(m, g, 1 - beta1) is linear in g
        after = clock >= self.freeze_step
        native.add_scaled(residual, grad, np.float32(
            (exact - used) * (1 - self.params.beta1 if after else 1)))


class MomentsPush(_OneBitPush):
    """async/ssp 1-bit Adam with worker moments: every push advances this worker's Adam
    moments; from the switch on it carries the Adam direction, not the gradient."""

    survives_rejoin = True  # the moments are this worker's own state, not the shards'

    def __init__(self, params: OneBitParams) -> None:
        super().__init__(params)
        self.worker_moments = WorkerMoments(params)

    def bind(self, fetch, plan, *, pushers=None):
        super().bind(fetch, plan, pushers=pushers)
        if self.params.momentum_per_update:
            # the momentum window in the shard's updates (OneBitConfig.momentum_window): W
            # workers' m decaying by beta1**W each span the last 1/(1-beta1) updates
            if pushers is None or pushers < 1:
                raise ValueError(f"onebit_momentum_window updates needs how many workers push "
                                 f"each key; got {pushers!r} (pass PSModel(pushers=...) for a "
                                 f"pipeline stage's keys)")
            self.worker_moments.beta1 = self.params.beta1 ** pushers

    def prepare(self, keys, grads, clock, clip):
        if not grads:
            return grads, clip, False
        adam = [self.worker_moments.direction(k, g, clip) for k, g in zip(keys, grads)]
        if clock < self.freeze_step:
            return grads, clip, False
        return adam, 1.0, True  # the clip factor went into the direction

    def encode(self, key, grad, comp, *, clock, clip):
        return self.worker_moments.encode(key, grad, comp, clip) if self.fuses(comp, clock) \
            else None

    def correct(self, key, grad, residual, *, clock, used, exact):
        self.worker_moments.correct(key, grad, residual, used, exact,
                                    directions=clock >= self.freeze_step)

    def state_dict(self):
        """Every key's ``(step, m, v)`` this worker has pushed (arrays owned by the policy)."""
        return {"version": 1, "keys": self.worker_moments.state()}

    def load_state_dict(self, state):
        if state.get("version") != 1:
            raise ValueError(f"worker moments of version {state.get('version')!r}; expected 1")
        plan = self.plan
        for key, (step, m, v) in state["keys"].items():
            if key not in plan:
                raise ValueError(f"key {key} is not in the plan ({len(plan.keys)} of the "
                                 f"model's {plan.model_keys} keys)")
            n = plan.key(key).length
            for name, a in (("m", m), ("v", v)):
                if a.shape != (n,) or a.dtype != np.float32:
                    raise ValueError(f"{name} of key {key} is {a.dtype}{a.shape}; expected "
                                     f"float32[{n}]")
            if step < 1:
                raise ValueError(f"step of key {key} is {step}; expected >= 1")
        for key, (step, m, v) in state["keys"].items():
            self.worker_moments.load(key, step, m, v)


@register_policy
def push_policy(reply: pb.RegisterReply) -> PushPolicy | None:
    """The push policy a ``onebit_adam`` shard's registration reply calls for, or ``None`` for
    another rule's reply."""
    params = OneBitParams()
    if reply.rule != RULE or not reply.rule_params.Unpack(params):
        return None
    if reply.mode == "sync":  # the shard's layout follows its mode (ps.onebit.OneBitAdam)
        return SyncMomenta(params)
    if params.worker_moments:
        return MomentsPush(params)
    return _OneBitPush(params)  # shard moments: gradients, 1-bit after the switch
