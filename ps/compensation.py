"""Staleness compensation: how an async/ssp shard adjusts a stale push before its rule applies
it. One class per method, registered by its ``ServerConfig.compensation`` name; the mode
(``ps.consistency.Async``) holds one and asks it for every push (:meth:`Compensation.lr_scale`,
:meth:`Compensation.gradient`) and, when it keeps what pulls handed out
(:attr:`Compensation.snapshots`), for every answered pull (:meth:`Compensation.handed`). Sync
never asks, so sync training is the same with any of them.

The methods (docs/algorithms.md, Staleness, has what each measured):

- :class:`NoCompensation` (``none``, the default): the push as it came. The lookahead
  (``ServerConfig.lookahead``, and the worker's weight prediction for compressed pulls) is the
  compensation that is on.
- :class:`Damping` (``damping``): learning rate / (1 + version gap), the gap being the updates
  the key took since the version the gradient was computed on (Zhang et al. 2016,
  staleness-aware async SGD).
- :class:`GapAware` (``gap_aware``): learning rate / max(1, gap / (pushers - 1)): with ``W``
  pushers a gradient is about ``W - 1`` updates old anyway, which the lookahead accounts for;
  only what is staler is damped (after Barkai et al. 2019, gap-aware mitigation, with the gap
  counted in updates).
- :class:`DelayCompensation` (``dc_asgd``): DC-ASGD (Zheng et al. 2017):
  ``g + lambda * g * g * (w_now - w_read)``, the first-order Taylor correction of the gradient
  from the parameters it was computed at (``w_read``, kept per worker and key when a pull is
  answered: the values it handed out, or for codes the shard's exact values) to the current
  ones, with the Hessian approximated by ``g * g``; adaptive ``lambda = lambda_0 / sqrt(ms)``,
  ``ms`` a per-element running mean of ``g * g`` (momentum 0.95). Memory: one float32 copy per
  worker and key, plus ``ms``. Pushes that are no gradients (1-bit Adam's worker-moment
  directions) should not use it.

Everything here runs under the shard core's lock, from the data loop's thread.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from bitps.ps.config import COMPENSATIONS, ServerConfig
from bitps.ps.store import Slot

__all__ = ["Compensation", "Damping", "DelayCompensation", "GapAware", "NoCompensation",
           "make_compensation", "register_compensation"]

register_compensation = COMPENSATIONS.register


class Compensation:
    """One method. Subclass, set :attr:`name`, and :func:`register_compensation` it."""

    name: ClassVar[str]
    snapshots: ClassVar[bool] = False
    """Whether :meth:`handed` wants the values of every answered pull."""
    reads_gradient: ClassVar[bool] = False
    """Whether :meth:`gradient` reads the pushed values (then every push reaches it decoded;
    a method that returns the push as it is lets a rule take it as a code, ``ps.pushcode``)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg

    def lr_scale(self, *, version_gap: int, pushers: int) -> float:
        """The factor on one push's learning rate: ``version_gap`` updates of the key since the
        version the push names, ``pushers`` live pushers of the key."""
        return 1.0

    def gradient(self, slot: Slot, grad: np.ndarray, worker: int) -> np.ndarray:
        """The push ``worker`` sent for ``slot`` (float32, read only: a frame may be a view
        of a received message), as the rule is to apply it; an array the caller may not
        keep past the update."""
        return grad

    def handed(self, slot: Slot, worker: int, values: np.ndarray) -> None:
        """A pull of ``worker`` was answered with ``values`` (the key's parameters, moved ahead
        or not) for ``slot`` (:attr:`snapshots` only)."""


def make_compensation(cfg: ServerConfig) -> Compensation:
    """The method ``cfg.compensation`` names (``cfg.staleness_damping``: ``damping``)."""
    name = "damping" if cfg.staleness_damping else cfg.compensation
    return COMPENSATIONS.lookup(name)(cfg)


@register_compensation
class NoCompensation(Compensation):
    name = "none"


@register_compensation
class Damping(Compensation):
    name = "damping"

    def lr_scale(self, *, version_gap, pushers):
        return 1.0 / (1 + max(version_gap, 0))


@register_compensation
class GapAware(Compensation):
    name = "gap_aware"

    def lr_scale(self, *, version_gap, pushers):
        expected = max(pushers - 1, 1)
        return 1.0 / max(1.0, version_gap / expected)


@register_compensation
class DelayCompensation(Compensation):
    name = "dc_asgd"
    snapshots = reads_gradient = True
    _MOMENTUM = np.float32(0.95)
    _EPS = np.float32(1e-7)

    def __init__(self, cfg: ServerConfig) -> None:
        super().__init__(cfg)
        self._read: dict[tuple[int, int], np.ndarray] = {}  # (worker, key) -> w_read
        self._mean_square: dict[int, np.ndarray] = {}
        self._out: dict[int, np.ndarray] = {}
        self._lambda = np.float32(cfg.dc_lambda)

    def handed(self, slot, worker, values):
        read = self._read.get((worker, slot.spec.key))
        if read is None or read.shape != values.shape:
            read = self._read[(worker, slot.spec.key)] = np.empty_like(values)
        np.copyto(read, values)

    def gradient(self, slot, grad, worker):
        key = slot.spec.key
        ms = self._mean_square.get(key)
        if ms is None:
            ms = self._mean_square[key] = np.zeros_like(grad)
            self._out[key] = np.empty_like(grad)
        out = self._out[key]
        # ms = m * ms + (1 - m) * g * g, through the scratch array (no temporaries per push)
        np.multiply(grad, np.float32(1) - self._MOMENTUM, out=out)
        out *= grad
        ms *= self._MOMENTUM
        ms += out
        read = self._read.get((worker, key))
        if read is None:  # no pull answered yet (the first push): nothing to correct
            return grad
        # out = g + lambda_0 / sqrt(ms + eps) * g * g * (w_now - w_read)
        np.subtract(slot.param, read, out=out)
        out *= grad
        out *= grad
        out *= self._lambda / np.sqrt(ms + self._EPS)
        out += grad
        return out
