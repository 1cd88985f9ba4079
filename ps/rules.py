"""Update rules: the optimizer a shard runs on each key, one class per rule, registered by its
``OptimizerConfig.name``.

A rule owns no arrays. It makes a key's state (:meth:`UpdateRule.setup` puts it in
``Slot.rule_state``, which nothing but the rule looks inside; :meth:`UpdateRule.new_state` is the
moments and step count of the rules here), does the arithmetic (:meth:`UpdateRule.apply` updates
``param`` from a gradient and that state, over the kernels in ``native``), and runs a key's updates
on the shard (:meth:`UpdateRule.update`, with the phase hooks :meth:`~UpdateRule.arrived` and
:meth:`~UpdateRule.aggregated`), including what the key publishes for compressed pulls. A key's
state saves and restores itself (a ``proto.state.Stateful``: :class:`KeyState`'s state dict). The
rule says what workers need to know of it at registration (:meth:`~UpdateRule.rule_params`) and what
its state is (:meth:`~UpdateRule.rule_state`, the RuleState call), and exports its own metrics
(:meth:`~UpdateRule.collect`). A rule with settings of its own names their section
(:attr:`UpdateRule.config`, a ``ps.config.RuleConfig``) and their flags
(:attr:`UpdateRule.settings`). Rules with layouts and phases of their own are plug-ins in modules of
their own (``ps/__init__.py`` imports them); the shard core calls rules only through this interface.

Each key is a partition of one tensor and is updated once per optimizer step, so per-key step counts
equal torch's per-parameter ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from bitps import native
from bitps.proto import bitps_pb2 as pb
from bitps.proto.wire import PSError
from bitps.ps.config import RULES, OptimizerConfig, RuleConfig, ServerConfig
from bitps.ps.pushcode import PushCode

if TYPE_CHECKING:
    from google.protobuf.message import Message
    from prometheus_client.metrics_core import Metric

    from bitps.proto.codecs import Codec
    from bitps.proto.settings import Setting
    from bitps.ps.store import Slot

__all__ = ["RULES", "Adam", "AdamW", "KeyState", "Momentum", "SGD", "UpdateRule", "make_rule",
           "publish_update", "raw_array", "register"]

_EMPTY = np.empty(0, dtype=np.float32)


@dataclass
class KeyState:
    """Optimizer state of one key: step count and moment buffers (empty when unused), the
    ``Slot.rule_state`` of the rules here. A ``proto.state.Stateful``; its state dict, layout
    version 1::

        {"version": 1, "step": int64[1], "buf1": float32[n], "buf2": float32[n]}

    with ``buf1`` and ``buf2`` only as far as :attr:`buffers` goes (SGD: neither; momentum and
    nesterov: ``buf1``, the momentum buffer; Adam: ``buf1`` = m, ``buf2`` = v). A checkpoint
    keeps them as ``<key>/rule/<name>``."""

    step: int = 0
    buf1: np.ndarray = field(default_factory=lambda: _EMPTY)
    buf2: np.ndarray = field(default_factory=lambda: _EMPTY)
    buffers: int = 0
    """How many of ``buf1``, ``buf2`` the rule uses (``UpdateRule.buffers``)."""

    LAYOUTS: ClassVar[tuple[int, ...]] = (1,)
    """The state-dict versions :meth:`load_state_dict` takes."""

    def state_dict(self) -> dict:
        out = {"version": 1, "step": np.array([self.step], np.int64)}
        for i, buf in enumerate((self.buf1, self.buf2)[:self.buffers], 1):
            out[f"buf{i}"] = buf.copy()
        return out

    def check_state(self, state: dict, extra: dict[str, tuple] | None = None) -> None:
        """Refuse (:class:`PSError`) a state dict that does not fit: another version, other
        names than :meth:`state_dict`'s and ``extra``'s (name -> allowed shapes), a shape that
        differs. Subclasses that add entries check them through ``extra``."""
        if state.get("version") not in self.LAYOUTS:
            raise PSError(pb.BAD_HEADER, f"{type(self).__name__} state layout version "
                          f"{state.get('version')!r}; expected one of {list(self.LAYOUTS)}")
        want = {name: (np.shape(a),) for name, a in self.state_dict().items() if name != "version"}
        want.update(extra or {})
        if set(state) - {"version"} != set(want):
            raise PSError(pb.BAD_HEADER, f"{type(self).__name__} state has {sorted(want)}; got "
                          f"{sorted(set(state) - {'version'})}")
        for name, shapes in want.items():
            if np.shape(state[name]) not in shapes:
                raise PSError(pb.BAD_LENGTH, f"{type(self).__name__} state {name} of shape "
                              f"{np.shape(state[name])}; expected {' or '.join(map(str, shapes))}")

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; :class:`PSError` (nothing changed) when a name, a shape
        or the version does not match."""
        self.check_state(state)
        self._load(state)

    def _load(self, state: dict) -> None:
        self.step = int(state["step"][0])
        for i, buf in enumerate((self.buf1, self.buf2)[:self.buffers], 1):
            np.copyto(buf, state[f"buf{i}"], casting="same_kind")


def publish_update(slot: Slot, apply: Callable[[np.ndarray], None], seed: int) -> None:
    """Make one update of ``slot`` through its publisher (``ps.publish``): ``apply(dst)``
    writes the parameters the rule would give into ``dst``; their difference to the current
    ones is compressed, added to the parameters and published as the next version."""
    pub = slot.publisher
    target = slot.writable()
    apply(pub.delta)
    # the difference, its code and the decode added, in one pass where the codec fuses them
    payload = pub.server.publish(pub.delta, target, seed=seed)
    slot.version += 1
    pub.publish(slot.version, payload)


def raw_array(name: str, values: np.ndarray) -> pb.StateArray:
    """A float32 array of a key's rule state as the RuleState call sends it."""
    return pb.StateArray(name=name, dtype=pb.FLOAT32, codec=pb.CODEC_RAW, length=values.size,
                         data=np.ascontiguousarray(values, np.float32).tobytes())


class UpdateRule:
    """One optimizer: the arithmetic (``native.update_rules`` has it exactly) and a key's life on
    a shard. Subclass, set :attr:`name` and :attr:`buffers`, implement :meth:`_step`, and
    :func:`register` it; a rule with phases or published codes overrides the key hooks too."""

    name: ClassVar[str]
    buffers: ClassVar[int] = 0
    """Moment buffers per key (``KeyState.buf1``, ``buf2``)."""
    state_names: ClassVar[tuple[str, ...]] = ()
    """What the RuleState call names the buffers (torch's names: ``exp_avg``, ...)."""
    config: ClassVar[type[RuleConfig] | None] = None
    """The rule's own config section (``OptimizerConfig.rule_config``); ``None``: none."""
    settings: ClassVar[Sequence[Setting]] = ()
    """``bitps-server``'s flags for :attr:`config`'s fields (``proto.settings.from_field``)."""
    takes_hyperparameters: ClassVar[bool] = True
    """Whether a push may carry its own lr and weight decay per key (``DataHeader.lr``,
    ``weight_decay``: ``bitps.Optimizer``'s param groups), which :meth:`update` then applies
    in place of ``cfg.lr`` x schedule and ``cfg.weight_decay``. A rule whose learning rate
    is not the config's alone (1-bit Adam's workers apply it too, local SGD's outer rule is
    another optimizer's) says ``False``, and shards refuse such pushes."""

    def __init__(self, cfg: OptimizerConfig, server: ServerConfig | None = None) -> None:
        self.cfg = cfg
        self.server = server
        """The shard's configuration (``None`` for the arithmetic alone, as in tests)."""
        f32 = np.float32
        self._lr, self._wd = f32(cfg.lr), f32(cfg.weight_decay)
        # Complements are taken in float64 before the cast, as torch does.
        self._momentum, self._keep = f32(cfg.momentum), f32(1 - cfg.dampening)
        self._one_minus_beta1, self._beta2 = f32(1 - cfg.beta1), f32(cfg.beta2)
        self._one_minus_beta2, self._eps = f32(1 - cfg.beta2), f32(cfg.eps)

    @classmethod
    def create(cls, cfg: OptimizerConfig, server: ServerConfig | None = None) -> UpdateRule:
        """The rule for ``cfg`` on a shard configured by ``server`` (a rule with several
        layouts picks one here)."""
        return cls(cfg, server)

    # -- arithmetic ---------------------------------------------------------------------------
    def new_state(self, length: int) -> KeyState:
        """Fresh state for a key of ``length`` elements (zeros, as torch initialises it)."""
        bufs = [np.zeros(length, np.float32) for _ in range(self.buffers)]
        return KeyState(0, *bufs, buffers=self.buffers)

    def apply(self, param: np.ndarray, grad: np.ndarray, state: KeyState, *,
              grad_scale: float = 1.0, lr_scale: float = 1.0,
              weight_decay: float | None = None, dst: np.ndarray | None = None) -> None:
        """One optimizer step with gradient ``grad * grad_scale``; the new parameters go to
        ``dst`` (default: ``param``, in place). ``lr_scale`` scales the learning rate (the
        schedule or a push's own lr, the split over workers, staleness damping);
        ``weight_decay``: a push's own (``DataHeader.weight_decay``), else the config's."""
        if dst is not None:
            if dst.shape != param.shape:
                raise ValueError(f"dst has shape {dst.shape}; expected {param.shape}")
            # The kernels update in place (that is what lets them vectorize): copy, then update.
            np.copyto(dst, param)
            param = dst
        lr = self._lr if lr_scale == 1.0 else np.float32(self.cfg.lr * lr_scale)
        wd = self.cfg.weight_decay if weight_decay is None else float(weight_decay)
        state.step += 1
        self._step(param, grad, state, np.float32(grad_scale), lr, lr_scale, wd)

    def _step(self, param: np.ndarray, grad: np.ndarray, state: KeyState, scale: np.float32,
              lr: np.float32, lr_scale: float, wd: float) -> None:
        """The arithmetic of one step, in place on ``param``: ``lr`` is the float32 learning
        rate (``cfg.lr * lr_scale``), ``wd`` the weight decay as a double (torch takes its
        complements in float64 before the cast)."""
        raise NotImplementedError

    # -- a key on a shard ---------------------------------------------------------------------
    def setup(self, slot: Slot) -> None:
        """A new key's state on this shard: ``slot.rule_state`` (by default
        :meth:`new_state`), and its publisher when the rule publishes codes of its own."""
        slot.rule_state = self.new_state(slot.length)

    def update(self, slot: Slot, grad: np.ndarray, *, clock: int, grad_scale: float = 1.0,
               lr_scale: float = 1.0, weight_decay: float | None = None) -> None:
        """One update of ``slot`` from a push (sync: the sum of a step's pushes, with
        ``grad_scale`` 1/W) computed by a worker at ``clock``: in place unless the current
        parameters are being sent; through the key's publisher when its pulls are compressed;
        recording the update for lookahead pulls. ``weight_decay``: the push's own (only for
        a rule that :attr:`takes_hyperparameters`), else the config's."""
        if slot.publisher is not None:
            # the version number seeds sparse's sampling: every update draws afresh
            return publish_update(slot, lambda dst: self.apply(
                slot.param, grad, slot.rule_state, grad_scale=grad_scale, lr_scale=lr_scale,
                weight_decay=weight_decay, dst=dst), seed=(slot.spec.key << 32) + slot.version)
        target = slot.writable()
        slot.before_update(target)
        self.apply(target, grad, slot.rule_state, grad_scale=grad_scale, lr_scale=lr_scale,
                   weight_decay=weight_decay)
        slot.version += 1

    def takes_code(self, codec: Codec) -> bool:
        """Whether :meth:`update` takes a push of ``codec`` as its code (``ps.pushcode``),
        decoding it in its own kernel; by default no: it gets float32 values."""
        return False

    def check_push(self, header: pb.DataHeader, slots: Sequence[Slot], codec: Codec) -> None:
        """A push of ``slots`` with ``codec`` for ``header.clock``, before anything changes:
        raise :class:`PSError` when this rule cannot take it (a rule whose pushes mean
        different things by phase); by default every push is taken."""

    def arrived(self, slot: Slot, clock: int) -> None:
        """async/ssp: a push computed at ``clock`` is about to be applied to ``slot``."""

    def aggregated(self, slot: Slot) -> None:
        """sync: a step's mean was applied to ``slot``."""

    def published_codec(self) -> Codec | None:
        """The codec of the codes this rule publishes for every key, or ``None``: the pull
        codec is then the first registration's."""
        return None

    def rule_params(self) -> Message | None:
        """What a RegisterReply tells workers about this rule: the rule's own protobuf
        message, which the shard packs into ``RegisterReply.rule_params``; ``None``: nothing."""
        return None

    def rule_state(self, slots: dict[int, Slot]) -> list[pb.KeyRuleState]:
        """The state of ``slots`` as the RuleState call sends it, one message per key: the
        rule's buffers under :attr:`state_names` (float32) and its step count (field
        ``step``). A rule that cannot share its state now raises :class:`PSError`."""
        out = []
        for key, slot in sorted(slots.items()):
            st = slot.rule_state
            msg = pb.KeyRuleState(key=key, version=slot.version, arrays=[
                raw_array(name, buf) for name, buf in zip(self.state_names, (st.buf1, st.buf2))])
            msg.fields.update({"step": st.step})
            out.append(msg)
        return out

    def collect(self, slots: Sequence[Slot]) -> Iterable[Metric]:
        """The rule's own Prometheus metric families over the shard's keys ``slots``, read at
        scrape time (``ps.metrics``); none by default."""
        return ()

    # -- shared scalars -----------------------------------------------------------------------
    def neg_lr(self, lr_scale: float = 1.0) -> np.float32:
        """``-lr * lr_scale`` as the float32 the kernels take; sync 1-bit Adam workers compute
        the same scalar from the same doubles (``worker.algorithms.onebit``)."""
        return np.float32(-(self.cfg.lr * lr_scale))

    @property
    def ratio_clip(self) -> float:
        """The largest ``|m| / sqrt(v)`` Adam can reach with these betas (bias corrections
        aside): ``(1-beta1) / (sqrt(1-beta2) * (1 - beta1/sqrt(beta2)))``; 1-bit Adam clips its
        frozen-v ratio there (``native.onebit_adam_delta``)."""
        b1, b2 = self.cfg.beta1, self.cfg.beta2
        if b1 >= b2 ** 0.5:
            return float("inf")  # Adam's ratio is unbounded then; nothing to clip to
        return (1 - b1) / ((1 - b2) ** 0.5 * (1 - b1 / b2 ** 0.5))

    def bias_correction2_sqrt(self, state: KeyState) -> float:
        """``sqrt(1 - beta2**t)`` at the key's current step (frozen with v at the switch)."""
        return (1 - self.cfg.beta2 ** max(state.step, 1)) ** 0.5


register = RULES.register


@register
class SGD(UpdateRule):
    name = "sgd"

    def _step(self, param, grad, state, scale, lr, lr_scale, wd):
        native.sgd_step(param, grad, scale, lr, np.float32(wd))


@register
class Momentum(UpdateRule):
    name, buffers, state_names = "momentum", 1, ("momentum_buffer",)

    def _step(self, param, grad, state, scale, lr, lr_scale, wd):
        native.momentum_step(param, grad, state.buf1, scale, lr, self._momentum,
                             self._keep, np.float32(wd), self.cfg.nesterov, state.step == 1)


@register
class Adam(UpdateRule):
    """Adam with L2 weight decay (``decoupled`` False) or AdamW's decoupled decay."""

    name, buffers, state_names = "adam", 2, ("exp_avg", "exp_avg_sq")
    decoupled: ClassVar[bool] = False

    def _step(self, param, grad, state, scale, lr, lr_scale, wd):
        cfg, f32 = self.cfg, np.float32
        # torch computes the bias corrections in float64 Python scalars, then casts.
        t = state.step
        neg_step_size = -(cfg.lr * lr_scale) / (1 - cfg.beta1**t)
        bc2_sqrt = (1 - cfg.beta2**t) ** 0.5
        tail = (state.buf1, state.buf2, scale, self._one_minus_beta1, self._beta2,
                self._one_minus_beta2, self._eps, f32(wd), self.decoupled,
                f32(1 - cfg.lr * lr_scale * wd), f32(neg_step_size), f32(bc2_sqrt))
        if isinstance(grad, PushCode):  # decoded block by block inside the step
            native.adam_step_code(param, *grad.sign1_sections(), *tail)
        else:
            native.adam_step(param, grad, *tail)

    def takes_code(self, codec):
        # a sign1 push is read by the step itself (native.coded), not decoded first
        return codec.id == pb.CODEC_SIGN1


@register
class AdamW(Adam):
    name, decoupled = "adamw", True


def make_rule(cfg: OptimizerConfig, server: ServerConfig | None = None) -> UpdateRule:
    """The registered rule ``cfg.name`` names, for a shard configured by ``server`` (``None``:
    the arithmetic alone)."""
    return RULES.lookup(cfg.name).create(cfg, server)
