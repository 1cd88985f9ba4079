"""The outer rule of local SGD / DiLoCo (``--optimizer nesterov``): SGD with Nesterov momentum on
pseudo-gradients.

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
"""

from __future__ import annotations

from bitps import native
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.ps.rules import UpdateRule, register

__all__ = ["Nesterov"]


@register
class Nesterov(UpdateRule):
    """SGD with Nesterov momentum, for pseudo-gradients (see the module docstring)."""

    name, buffers, state_names = "nesterov", 1, ("momentum_buffer",)

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

    def _step(self, param, grad, state, scale, lr, lr_scale):
        native.momentum_step(param, grad, state.buf1, scale, lr, self._momentum,
                             self._keep, self._wd, True, state.step == 1)
