"""The outer rules of local SGD / DiLoCo: SGD with Nesterov momentum on pseudo-gradients
(``--optimizer nesterov``), and its delayed form for asynchronous rounds
(``--optimizer delayed_nesterov``).

A local-SGD worker (``worker.algorithms.local_sgd``) runs H inner steps on its own, then pushes
``delta = theta_pulled - theta_now``. The shard treats ``delta`` as a gradient (summed over the
step's workers with weight 1/W in sync) and steps, per element::

    b     = momentum * b + delta        (b = delta on the key's first step, as torch)
    theta = theta - lr * (delta + momentum * b)

DiLoCo (Douillard et al. 2023) uses lr 0.7 and momentum 0.9 (``bitps-launch --algorithm
diloco``); momentum 0 with lr 1 is plain averaging of the workers' models. The arithmetic is
``torch.optim.SGD(nesterov=True)``'s (the ``momentum`` rule's kernel, bit for bit); this rule
exists so that the outer optimizer is named and checked on its own: no dampening (Nesterov
needs none) and no weight decay (the inner optimizer applies it; decaying twice would shrink the
model at every outer step).

**Delayed Nesterov** (DN; Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135). In ``async`` and ``ssp`` every pseudo-gradient is applied on
arrival, and Nesterov momentum applied to each would count every stale delta into the
momentum, which then pushes on with it for many more arrivals. DN applies each arriving
``delta`` with a plain, momentum-free step and updates the momentum only every N arrivals of
the key, from the mean of those N deltas::

    theta   = theta - lr_t * delta                        (each arrival)
    pending = pending + delta
    every N-th arrival:  b = momentum * b + pending / N;  pending = 0
                         theta = theta - lr_t * N * momentum * b   (with that arrival's step)

``lr_t`` is the arrival's learning rate as the mode gives it (the schedule, split over the key's
W live pushers: ``split_lr``). With N = W (the default, ``--outer-momentum-delay 0``) the N
arrivals together move theta by ``lr * (mean delta + momentum * b)``: one Nesterov step on the
mean, as a sync round would. The paper's ``c`` (a fraction of the momentum applied between
activations) is 0 here. ``--outer-momentum-delay 1`` is Nesterov on every arrival. In ``sync``
each step's mean is one arrival with N = 1: the rule is ``nesterov``, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bitps import native
from bitps.proto.settings import from_field
from bitps.ps.config import OptimizerConfig, RuleConfig, ServerConfig
from bitps.ps.rules import UpdateRule, register

__all__ = ["DelayedNesterov", "DelayedNesterovConfig", "Nesterov"]


@register
class Nesterov(UpdateRule):
    """SGD with Nesterov momentum, for pseudo-gradients (see the module docstring)."""

    name, buffers, state_names = "nesterov", 1, ("momentum_buffer",)
    takes_hyperparameters = False  # the outer learning rate is not the inner optimizer's

    @classmethod
    def create(cls, cfg: OptimizerConfig, server: ServerConfig | None = None) -> UpdateRule:
        if cfg.dampening != 0:
            raise ValueError(f"optimizer nesterov takes no dampening; got dampening "
                             f"{cfg.dampening} (Nesterov momentum needs 0)")
        if cfg.weight_decay != 0:
            raise ValueError(f"optimizer nesterov takes no weight decay; got weight_decay "
                             f"{cfg.weight_decay} (the inner optimizer applies it: "
                             f"--inner-weight-decay)")
        if not 0 <= cfg.momentum < 1:
            raise ValueError(f"optimizer nesterov momentum {cfg.momentum}; expected 0 <= "
                             f"momentum < 1")
        return cls(cfg, server)

    def _step(self, param, grad, state, scale, lr, lr_scale, wd):
        native.momentum_step(param, grad, state.buf1, scale, lr, self._momentum,
                             self._keep, self._wd, True, state.step == 1)


@dataclass(kw_only=True, frozen=True)
class DelayedNesterovConfig(RuleConfig):
    """Delayed Nesterov's settings (``OptimizerConfig.rule_config`` of ``delayed_nesterov``)."""

    momentum_delay: int = 0
    """async/ssp: arrivals of a key's pseudo-gradients between two momentum updates (N); 0 =
    the number of workers pushing the key. Each arrival in between is a plain step; sync is
    always N = 1 (``nesterov`` bit for bit)."""

    def __post_init__(self) -> None:
        if self.momentum_delay < 0:
            raise ValueError(f"outer_momentum_delay must be >= 0 (0: the number of workers), "
                             f"got {self.momentum_delay}")


SETTINGS = (
    from_field(DelayedNesterovConfig, "momentum_delay", name="outer-momentum-delay",
               help="delayed_nesterov in async/ssp: arrivals of a key between momentum updates "
                    "(N); 0 = the number of workers"),
)
"""``bitps-server``'s flags of :class:`DelayedNesterovConfig` (``DelayedNesterov.settings``)."""


@register
class DelayedNesterov(Nesterov):
    """Delayed Nesterov momentum for asynchronous local SGD (see the module docstring). The
    key's state: ``buf1`` the momentum, ``buf2`` the sum of the arrivals since its last update,
    ``step`` the arrivals (async/ssp) or steps (sync)."""

    name, buffers = "delayed_nesterov", 2
    state_names = ("momentum_buffer", "pending_sum")
    config, settings = DelayedNesterovConfig, SETTINGS

    def __init__(self, cfg: OptimizerConfig, server: ServerConfig | None = None) -> None:
        super().__init__(cfg, server)
        opts = cfg.rule_config or DelayedNesterovConfig()
        self._delay = opts.momentum_delay
        self._arrival: int | None = None
        """N of the push being applied, set by :meth:`arrived` (async/ssp only)."""

    def arrived(self, slot, clock):
        self._arrival = self._delay or max(len(slot.pushers), 1)

    def _step(self, param, grad, state, scale, lr, lr_scale, wd):
        n, self._arrival = self._arrival, None
        if n is None:  # sync: a step's mean is one arrival of N = 1, which is Nesterov
            return super()._step(param, grad, state, scale, lr, lr_scale, wd)
        native.delayed_nesterov_step(param, grad, state.buf1, state.buf2, scale, lr,
                                     self._momentum, np.float32(1.0 / n),
                                     np.float32(n * self.cfg.momentum), state.step % n == 0)
