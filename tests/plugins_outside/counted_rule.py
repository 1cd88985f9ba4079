"""An update-rule plug-in: ``counted_sgd``, SGD with a heavy-ball velocity, whose per-key state
is a class of its own and whose one setting is a config section with a flag of its own.

Per key and update, with ``g = grad * grad_scale``::

    velocity = decay * velocity + g
    param   -= lr * lr_scale * velocity

and the state counts what it saw: the step, the sum of mean |g| over the updates, the last
``lr_scale`` the shard applied (its consistency mode's split and scale). The shard checkpoints
the state through its state dict (``proto.state``), arrays and scalars alike, and the RuleState
call reports it. Load it on the shards::

    bitps-server --plugin counted_rule.py --optimizer counted_sgd --counted-decay 0.5 ...
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bitps.proto import bitps_pb2 as pb
from bitps.proto.settings import from_field
from bitps.ps.config import RuleConfig
from bitps.ps.rules import UpdateRule, raw_array, register

STATE_VERSION = 1


@dataclass(kw_only=True, frozen=True)
class CountedConfig(RuleConfig):
    """``counted_sgd``'s own settings (``OptimizerConfig.rule_config``)."""

    decay: float = 0.5
    """How much of the velocity each update keeps, in [0, 1)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"counted_sgd decay must be in [0, 1), got {self.decay}")


@dataclass
class CountedState:
    """One key's state. Its state dict, layout version 1::

        {"version": 1, "step": int, "velocity": float32[n],
         "stats": {"version": 1, "grad_abs_sum": float, "last_lr_scale": float}}
    """

    velocity: np.ndarray
    step: int = 0
    grad_abs_sum: float = 0.0
    last_lr_scale: float = 0.0

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "step": self.step, "velocity": self.velocity.copy(),
                "stats": {"version": STATE_VERSION, "grad_abs_sum": self.grad_abs_sum,
                          "last_lr_scale": self.last_lr_scale}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a ``ValueError`` naming what does not fit, and no
        change, otherwise."""
        stats = state.get("stats")
        if state.get("version") != STATE_VERSION or not isinstance(stats, dict) \
                or stats.get("version") != STATE_VERSION:
            raise ValueError(f"counted_sgd state of version {state.get('version')!r} (stats "
                             f"{stats!r}); expected version {STATE_VERSION} with stats of "
                             f"version {STATE_VERSION}")
        velocity = np.asarray(state.get("velocity"))
        if velocity.shape != self.velocity.shape or velocity.dtype != np.float32:
            raise ValueError(f"counted_sgd velocity is {velocity.dtype}{list(velocity.shape)}; "
                             f"expected float32{list(self.velocity.shape)}")
        if not isinstance(state.get("step"), int):
            raise ValueError(f"counted_sgd step {state.get('step')!r}; expected an int")
        np.copyto(self.velocity, velocity)
        self.step = state["step"]
        self.grad_abs_sum = float(stats["grad_abs_sum"])
        self.last_lr_scale = float(stats["last_lr_scale"])


@register
class CountedSGD(UpdateRule):
    """SGD with a heavy-ball velocity and counters (the module docstring)."""

    name = "counted_sgd"
    config = CountedConfig
    settings = (from_field(CountedConfig, "decay", name="counted-decay",
                           help="counted_sgd: how much of the velocity each update keeps"),)

    def __init__(self, cfg, server=None) -> None:
        super().__init__(cfg, server)
        self._decay = np.float32(cfg.rule_config.decay)

    def new_state(self, length: int) -> CountedState:
        return CountedState(velocity=np.zeros(length, np.float32))

    def _step(self, param, grad, state, scale, lr, lr_scale, wd):
        g = grad * scale
        state.velocity *= self._decay
        state.velocity += g
        param -= lr * state.velocity
        state.grad_abs_sum += float(np.abs(g).mean()) if g.size else 0.0
        state.last_lr_scale = float(lr_scale)

    def rule_state(self, slots):
        out = []
        for key, slot in sorted(slots.items()):
            st = slot.rule_state
            msg = pb.KeyRuleState(key=key, version=slot.version,
                                  arrays=[raw_array("velocity", st.velocity)])
            msg.fields.update({"step": st.step, "grad_abs_sum": st.grad_abs_sum,
                               "last_lr_scale": st.last_lr_scale})
            out.append(msg)
        return out
