"""``bitps.Optimizer``: a ``torch.optim.Optimizer`` whose step is the shards', one line away from
a training loop that already works.

    client = PSClient(ClientConfig(servers=servers, rank=rank, world_size=world_size))
    optimizer = bitps.Optimizer(model, client, lr=1e-3, weight_decay=0.01)  # was torch.optim.AdamW
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                  # push the gradients, pull the shards' parameters
        scheduler.step()                  # the next pushes carry the new lr
    optimizer.close()

**What is whose.** The update rule and its constants (``--optimizer adamw``, the betas, eps,
momentum) are the shards' (``bitps-server``). The param groups hold each parameter's ``lr`` and
``weight_decay``; every push carries them, one of each per key (``DataHeader.lr``,
``weight_decay``; a key lies inside one parameter), and the shards apply them in place of their
``--lr`` times schedule and ``--weight-decay``. So whatever sets ``param_groups[i]["lr"]`` (any
``torch.optim.lr_scheduler``, Hugging Face's schedules, a hand-written warm-up) is the schedule.
In async/ssp a push's lr is still split over the key's pushers and damped for staleness as the
shard is configured (``ServerConfig.split_lr``, ``compensation``); in sync every rank's push of
a step must carry the same values, else the shard refuses it (``PSError``
``BAD_HYPERPARAMETERS``, naming both). A group may set only ``params``, ``lr`` and
``weight_decay`` (other keys, such as ``betas``, are the shards' and are refused here); keys a
scheduler adds later are ignored. Rules whose learning rate is not the shard's alone
(``onebit_adam``, ``nesterov``) refuse such pushes with the same code.

**When gradients are read.** At :meth:`step`, as any torch optimizer: what the loop does to
``param.grad`` between ``backward()`` and ``step()`` (``clip_grad_norm_``, ``GradScaler``'s
unscale) is what is pushed. That is overlap ``off``, the default here; ``overlap=
OverlapConfig(mode="on")`` pushes buckets from backward's hooks instead (faster when the
network is the bottleneck), and then clipping belongs in ``EncoderConfig.clip_norm``
(``bitps.PSModel``'s contracts). With overlap off ``step()`` leaves the gradients as torch's
optimizers do, so ``zero_grad(set_to_none=False)`` zeroes them in place and a loop that skips
``zero_grad`` accumulates; under overlap the communication thread may still be reading them
when ``step()`` returns, so it leaves them ``None``.

**Checkpoints.** :meth:`state_dict` is torch's (the param groups, so schedules resume) plus
``"bitps"``: the worker's part, ``PSModel.state_dict`` (clock, error feedback, policy state).
The parameters and the rule's state are the shards' own checkpoints (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from bitps.worker.config import EncoderConfig, OverlapConfig
from bitps.worker.training.model import PSModel
from bitps.worker.transport.client import PSClient

__all__ = ["GROUP_KEYS", "Optimizer"]

GROUP_KEYS = frozenset({"params", "lr", "weight_decay"})
"""What a param group given to :class:`Optimizer` may set."""


class Optimizer(torch.optim.Optimizer):
    """A torch optimizer over ``params_or_model`` whose updates the shards behind ``client``
    make (module docstring)."""

    def __init__(self, params_or_model: torch.nn.Module | Iterable[torch.Tensor] | Iterable[dict],
                 client: PSClient, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 model: torch.nn.Module | None = None, overlap: OverlapConfig | None = None,
                 encoder: EncoderConfig | None = None) -> None:
        """``params_or_model``: a module (all its trainable parameters, one group), or
        parameters or param groups as ``torch.optim`` takes them, then of ``model`` (every
        trainable parameter of it in exactly one group; without ``model`` the parameters
        alone are bound, in the order given, and overlap must stay off: there is no forward
        to wait in). ``lr`` and ``weight_decay``: the groups' defaults. ``overlap``: default
        off (gradients are read at :meth:`step`); ``encoder``: how gradients are pushed
        (``PSModel``)."""
        if isinstance(params_or_model, torch.nn.Module):
            if model is not None and model is not params_or_model:
                raise ValueError("give the model once: as params_or_model or as model=")
            model = params_or_model
            params_or_model = [p for p in model.parameters() if p.requires_grad]
        _check_value("lr", lr, positive=True)
        _check_value("weight_decay", weight_decay, positive=False)
        super().__init__(params_or_model, {"lr": lr, "weight_decay": weight_decay})
        params = [p for g in self.param_groups for p in g["params"]]
        overlap = overlap or OverlapConfig(mode="off")
        if model is None:
            if overlap.mode != "off":
                raise ValueError(f"overlap mode {overlap.mode!r} needs the module whose forward "
                                 f"reads the parameters: pass model=")
            model = torch.nn.ParameterList(params)  # names 0, 1, ...: the same on every rank
        else:
            _check_covers(model, params)
        self.ps_model = PSModel(model, client, overlap=overlap, encoder=encoder)
        """The binding to the shards (``bitps.PSModel``): clock, keys, synchronize."""
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        by_name = {name: group_of[id(p)] for name, p in self.ps_model.params}
        self._group = {k.key: by_name[k.name] for k in self.ps_model.plan.keys}
        self._stepped: dict[int, list[tuple[float, float]]] = {}
        """Per clock whose :meth:`step` has begun: each group's (lr, weight decay) then."""
        client.hyperparameters = self._hyperparameters

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, for the groups given at construction; a group added later would hold
        parameters the shards do not know (``RuntimeError``)."""
        if hasattr(self, "ps_model"):
            raise RuntimeError("bitps.Optimizer binds its parameters to the shards when it is "
                               "made; give every param group then")
        extra = sorted(set(param_group) - GROUP_KEYS)
        if extra:
            raise ValueError(f"param group sets {extra}; bitps.Optimizer's groups set only "
                             f"{sorted(GROUP_KEYS)} (the rule's other constants, such as betas, "
                             f"are the shards': bitps-server --optimizer, --beta1, ...)")
        for name in ("lr", "weight_decay"):
            if name in param_group:
                _check_value(name, param_group[name], positive=name == "lr")
        super().add_param_group(param_group)

    def _hyperparameters(self, keys: Sequence[int], clock: int
                         ) -> tuple[list[float], list[float]]:
        """``PSClient.hyperparameters``: each key's group's lr and weight decay for the push
        of step ``clock``: as they were when that :meth:`step` began (under overlap a push may
        be sent after it returned and a scheduler moved the lr on), or, for a push made
        before it (backward's hooks), as they are now."""
        snapshot = self._stepped.get(clock)
        if snapshot is None:
            snapshot = self._snapshot()
        values = [snapshot[self._group[k]] for k in keys]
        return [lr for lr, _ in values], [wd for _, wd in values]

    def _snapshot(self) -> list[tuple[float, float]]:
        return [(float(g["lr"]), float(g["weight_decay"])) for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Push this step's gradients with each group's lr and weight decay, pull the shards'
        new parameters (``PSModel.step``); the gradients are left as they were (overlap off)
        or ``None`` (overlap on: still being read). ``closure``: as torch's, evaluated first
        (with gradients on) and its loss returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # a scheduler could have set a bad value
            _check_value("lr", group["lr"], positive=True)
            _check_value("weight_decay", group["weight_decay"], positive=False)
        clock = self.ps_model.clock
        self._stepped[clock] = self._snapshot()
        self._stepped.pop(clock - 4, None)  # a step's pushes are long sent by then
        # overlap off: the exchange is over when PSModel.step returns, so the gradients go
        # back where torch's optimizers leave them (PSModel leaves them None)
        kept = () if self.ps_model.overlapping else [(p, p.grad) for _, p in
                                                      self.ps_model.params]
        self.ps_model.step()
        for p, grad in kept:
            p.grad = grad
        return loss

    @property
    def clock(self) -> int:
        """The step this worker is at (``PSModel.clock``)."""
        return self.ps_model.clock

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation under overlap (``PSModel.no_sync``)."""
        with self.ps_model.no_sync():
            yield

    def synchronize(self) -> None:
        """Wait for what is in flight (``PSModel.synchronize``)."""
        self.ps_model.synchronize()

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (``state`` empty: the rule's state is the shards'; the param
        groups, with what schedulers put there) plus ``"bitps"``: ``PSModel.state_dict()``."""
        state = super().state_dict()
        state["bitps"] = self.ps_model.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same model and settings: the param groups
        (lr, weight decay, a scheduler's keys), then the worker's part. Nothing changes when
        ``"bitps"`` is missing or does not fit (``ValueError``)."""
        state = dict(state_dict)
        ours = state.pop("bitps", None)
        if ours is None:
            raise ValueError("not a bitps.Optimizer state dict: it has no 'bitps' entry "
                             "(the worker's part: clock, error feedback)")
        groups = [dict(g) for g in self.param_groups]
        super().load_state_dict(state)
        try:
            self.ps_model.load_state_dict(ours)
        except Exception:
            for group, saved in zip(self.param_groups, groups):  # take the groups back
                group.update(saved)
            raise

    def close(self) -> None:
        """Finish what is in flight, leave the shards, stop the client (``PSModel.close``)."""
        self.ps_model.client.hyperparameters = None
        self.ps_model.close()


def _check_value(name: str, value: Any, *, positive: bool) -> None:
    """lr must be a finite number > 0, weight decay a finite number >= 0 (``ValueError``)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or (x <= 0 if positive else x < 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")


def _check_covers(model: torch.nn.Module, params: list[torch.Tensor]) -> None:
    """Every trainable parameter of ``model`` in exactly one group, and nothing else: the
    shards update every key of the model's plan each step."""
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    given = {id(p) for p in params}
    missing = [n for i, n in trainable.items() if i not in given]
    foreign = sum(1 for i in given if i not in trainable)
    if missing or foreign:
        raise ValueError(f"the param groups must hold every trainable parameter of the model "
                         f"once; missing {missing[:8]}"
                         + (f", and {foreign} parameters not of the model (or frozen)"
                            if foreign else ""))
