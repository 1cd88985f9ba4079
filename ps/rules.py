"""Update rules: the optimizer a shard runs on each key, over the kernels in ``native``.

A rule owns no arrays: :meth:`UpdateRule.new_state` makes a key's state (moments, step count),
:meth:`UpdateRule.apply` updates ``param`` in place from a gradient and that state. Each key is a
partition of one tensor and is updated once per optimizer step, so per-key step counts equal
torch's per-parameter ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bitps import native
from bitps.ps.config import OptimizerConfig

__all__ = ["KeyState", "UpdateRule", "make_rule"]

_EMPTY = np.empty(0, dtype=np.float32)


@dataclass
class KeyState:
    """Optimizer state of one key: step count and moment buffers (empty when unused)."""

    step: int = 0
    buf1: np.ndarray = field(default_factory=lambda: _EMPTY)
    buf2: np.ndarray = field(default_factory=lambda: _EMPTY)


class UpdateRule:
    """Applies ``cfg``'s optimizer; see ``native.update_rules`` for the exact arithmetic."""

    def __init__(self, cfg: OptimizerConfig) -> None:
        self.cfg = cfg
        f32 = np.float32
        self._lr, self._wd = f32(cfg.lr), f32(cfg.weight_decay)
        # Complements are taken in float64 before the cast, as torch does.
        self._momentum, self._keep = f32(cfg.momentum), f32(1 - cfg.dampening)
        self._one_minus_beta1, self._beta2 = f32(1 - cfg.beta1), f32(cfg.beta2)
        self._one_minus_beta2, self._eps = f32(1 - cfg.beta2), f32(cfg.eps)

    def new_state(self, length: int) -> KeyState:
        """Fresh state for a key of ``length`` elements (zeros, as torch initialises it)."""
        name = self.cfg.name
        if name == "momentum":
            return KeyState(buf1=np.zeros(length, np.float32))
        if name in ("adam", "adamw", "onebit_adam"):
            return KeyState(buf1=np.zeros(length, np.float32), buf2=np.zeros(length, np.float32))
        return KeyState()

    def apply(self, param: np.ndarray, grad: np.ndarray, state: KeyState, *,
              grad_scale: float = 1.0, lr_scale: float = 1.0,
              dst: np.ndarray | None = None) -> None:
        """One optimizer step with gradient ``grad * grad_scale``; the new parameters go to
        ``dst`` (default: ``param``, in place). ``lr_scale`` damps the learning rate
        (staleness-aware damping)."""
        cfg, f32 = self.cfg, np.float32
        if dst is not None:
            if dst.shape != param.shape:
                raise ValueError(f"dst has shape {dst.shape}; expected {param.shape}")
            # The kernels update in place (that is what lets them vectorize): copy, then update.
            np.copyto(dst, param)
            param = dst
        lr = self._lr if lr_scale == 1.0 else f32(cfg.lr * lr_scale)
        scale = f32(grad_scale)
        state.step += 1
        if cfg.name == "sgd":
            native.sgd_step(param, grad, scale, lr, self._wd)
        elif cfg.name == "momentum":
            native.momentum_step(param, grad, state.buf1, scale, lr, self._momentum,
                                 self._keep, self._wd, cfg.nesterov, state.step == 1)
        else:
            # torch computes the bias corrections in float64 Python scalars, then casts.
            t = state.step
            neg_step_size = -(cfg.lr * lr_scale) / (1 - cfg.beta1**t)
            bc2_sqrt = (1 - cfg.beta2**t) ** 0.5
            native.adam_step(param, grad, state.buf1, state.buf2, scale,
                             self._one_minus_beta1, self._beta2, self._one_minus_beta2,
                             self._eps, self._wd, cfg.name != "adam",
                             f32(1 - cfg.lr * lr_scale * cfg.weight_decay), f32(neg_step_size),
                             f32(bc2_sqrt))

    @property
    def onebit(self) -> bool:
        """True for 1-bit Adam: Adam (decoupled decay) during warmup, then :meth:`delta`."""
        return self.cfg.name == "onebit_adam"

    def delta(self, param: np.ndarray, grad: np.ndarray, state: KeyState, out: np.ndarray, *,
              bias_correction2_sqrt: float, grad_scale: float = 1.0,
              lr_scale: float = 1.0) -> None:
        """1-bit Adam after warmup: update the momentum with ``grad * grad_scale`` and write
        the parameter update ``-lr * (m / (sqrt(v)/bc2 + eps) + wd * param)`` to ``out`` (v and
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
        """sync 1-bit Adam: ``state.buf1`` holds the published momentum; apply it with the
        frozen v, exactly as workers do (``native.onebit_adam_apply``)."""
        f32 = np.float32
        state.step += 1
        native.onebit_adam_apply(param, state.buf1, state.buf2, self._eps, self._wd,
                                 self.neg_lr(lr_scale), f32(bias_correction2_sqrt),
                                 f32(self.ratio_clip))

    def direction_delta(self, param: np.ndarray, direction: np.ndarray, out: np.ndarray, *,
                        grad_scale: float = 1.0, lr_scale: float = 1.0) -> None:
        """1-bit Adam with worker moments after warmup: write ``-lr * (clip(direction) + wd *
        param)`` to ``out``, ``direction`` being a worker's decoded Adam direction."""
        native.onebit_direction_delta(param, direction, out, np.float32(grad_scale), self._wd,
                                      self.neg_lr(lr_scale), np.float32(self.ratio_clip))

    def neg_lr(self, lr_scale: float = 1.0) -> np.float32:
        """``-lr * lr_scale`` as the float32 the kernels take; sync 1-bit Adam workers compute
        the same scalar from the same doubles (``worker.onebit``)."""
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


def make_rule(cfg: OptimizerConfig) -> UpdateRule:
    """The update rule for ``cfg``."""
    return UpdateRule(cfg)
