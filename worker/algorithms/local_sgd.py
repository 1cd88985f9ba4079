"""Local SGD / DiLoCo on a worker: H inner steps with a local optimizer, then one exchange of the
pseudo-gradient through the parameter server, whose update rule is the outer optimizer.

One round on every worker::

    theta_pulled                         the global parameters this worker holds
    H x (forward, backward, inner step)  on the model, starting from theta_pulled
    delta = theta_pulled - theta_now     the pseudo-gradient: what the H steps moved, negated
    push_pull(delta) -> theta_pulled     the shards apply the outer rule to the mean delta
                                         (sync) or to each delta (async, ssp); the reply is
                                         the new theta_pulled
    theta_now := theta_pulled

The outer rule is whichever update rule the shards run. DiLoCo's is SGD with Nesterov momentum
(lr 0.7, momentum 0.9: ``bitps-server --optimizer momentum --nesterov --lr 0.7 --momentum
0.9``); ``bitps-launch --algorithm diloco`` sets it up. The delta goes with the client's push
codec and error feedback (DiLoCo in bitps defaults to sign1), the new parameters with its pull
codec. One clock is one round, so the staleness bound of ``ssp`` counts rounds.

Streaming (``fragments`` F > 1, after Streaming DiLoCo, Douillard et al. 2025): the parameters
are cut into F fragments of consecutive tensors, and fragment f exchanges once per H steps at
its own offset ((f + 1) H / F, so the exchanges are spread over the round), each exchange in
flight for ``overlap_steps`` inner steps while training goes on. When the new parameters land,
the fragment keeps the progress made since it was sent: ``theta = theta_new + (theta_now -
theta_sent)``, and that progress goes into the fragment's next pseudo-gradient. Bytes per
step are those of F = 1; the peak message is 1/F of the model.

Dynamic local updates (``adaptive``, after Liu et al. 2024; ``worker.algorithms.dylu``): each
round's inner steps are ``max(1, round(H * v / v_max))``, this worker's measured speed over the
fastest live worker's (reported through the heartbeats), so a slow worker pushes about as often
as a fast one, with fewer steps of progress. Whole rounds only (one fragment, no overlap).

The inner optimizer is any ``torch.optim.Optimizer`` over the model's parameters (AdamW in
DiLoCo); its state stays on this worker and is saved with :meth:`LocalSGD.state_dict`. With
H = 1, raw pushes and an outer SGD of lr 1, a round is exactly one step of the inner
optimizer on the mean of the workers' updates.

Nothing here reaches into the client: it uses ``PSClient.register``, ``pull``, ``push_pull``
and ``complete`` (which recovers a lost shard and redoes its part of an exchange) as any caller
may.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from bitps.proto.keyplan import KeyPlan, ParamSpec, make_plan
from bitps.worker.algorithms.dylu import DynamicSteps
from bitps.worker.config import EncoderConfig
from bitps.worker.training.encoder import Encoder
from bitps.worker.transport.client import PSClient

__all__ = ["LocalSGD"]


class LocalSGD:
    """DiLoCo's worker loop around ``model``: call :meth:`step` after each backward."""

    def __init__(self, model: torch.nn.Module, client: PSClient,
                 inner: torch.optim.Optimizer, *, inner_steps: int, fragments: int = 1,
                 overlap_steps: int = 0, encoder: EncoderConfig | None = None,
                 adaptive: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps is {inner_steps}; expected >= 1")
        if not 1 <= fragments <= inner_steps:
            raise ValueError(f"fragments is {fragments}; expected 1 .. inner_steps "
                             f"({inner_steps}): each fragment exchanges at its own step")
        if not 0 <= overlap_steps < inner_steps // fragments:
            raise ValueError(f"overlap_steps is {overlap_steps}; expected 0 .. "
                             f"{max(inner_steps // fragments - 1, 0)} (an exchange lands "
                             f"before the next fragment's starts)")
        if adaptive and (fragments > 1 or overlap_steps):
            raise ValueError(f"adaptive inner steps size whole rounds; got fragments "
                             f"{fragments}, overlap_steps {overlap_steps} (expected 1 and 0)")
        self.model, self.client, self.inner = model, client, inner
        self.encoder = Encoder(encoder or EncoderConfig.from_client(client.cfg), client)
        """Encodes the pseudo-gradients (a push codec compresses them with error feedback)."""
        self.inner_steps, self.fragments, self.overlap_steps = inner_steps, fragments, \
            overlap_steps
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in self.params:
            if p.dtype != torch.float32 or not p.data.is_contiguous():
                raise ValueError(f"parameter {name!r} is {p.dtype}, contiguous "
                                 f"{p.data.is_contiguous()}; bitps stores contiguous float32")
        if fragments > len(self.params):
            raise ValueError(f"fragments is {fragments}; the model has {len(self.params)} "
                             f"trainable tensors")
        owned = {id(p) for group in inner.param_groups for p in group["params"]}
        if missing := [n for n, p in self.params if id(p) not in owned]:
            raise ValueError(f"the inner optimizer does not update {missing[:4]}; give it "
                             f"every trainable parameter")
        self.plan: KeyPlan = make_plan(
            [ParamSpec(n, tuple(p.shape)) for n, p in self.params],
            num_shards=client.num_shards, partition_bytes=client.cfg.partition_bytes)
        self.keys = [k.key for k in self.plan.keys]
        index = {n: i for i, (n, _) in enumerate(self.params)}
        # theta_pulled per parameter (host float32): the copies compressed pulls update
        self._pulled = [p.detach().reshape(-1).cpu().numpy().copy() for _, p in self.params]
        self._delta = [np.empty_like(a) for a in self._pulled]
        self._sent = [np.empty_like(a) for a in self._pulled] if overlap_steps else None
        self._outs = [self._pulled[index[k.name]][k.offset:k.offset + k.length]
                      for k in self.plan.keys]
        self._grads = [self._delta[index[k.name]][k.offset:k.offset + k.length]
                       for k in self.plan.keys]
        # fragment f: consecutive tensors, and the keys cut from them
        self._tensors = [[i for i in range(len(self.params)) if i * fragments //
                          len(self.params) == f] for f in range(fragments)]
        frag_of = {n: f for f, idx in enumerate(self._tensors) for i in idx
                   for n in (self.params[i][0],)}
        self._frag_keys = [[j for j, k in enumerate(self.plan.keys) if frag_of[k.name] == f]
                           for f in range(fragments)]
        self._offsets = [(f + 1) * inner_steps // fragments for f in range(fragments)]
        self._inflight: dict[int, tuple[object, int]] = {}  # fragment -> (handle, land step)
        copies = self._copies = dict(zip(self.keys, self._outs))
        self.encoder.register(self.plan, copies if client.cfg.rank == 0 else None, copies=copies)
        if self.encoder.chooses_codecs:  # known once the shards answered their registration
            raise ValueError("local SGD pushes pseudo-gradients: run the shards with an outer "
                             "rule (e.g. --optimizer momentum --nesterov), not onebit_adam")
        self.clock = client.start_clock
        """Rounds completed (the clock of the next push)."""
        self.inner_step = 0
        """Inner steps taken in the current round."""
        self.round_steps = inner_steps
        """Inner steps of the current round: ``inner_steps``, or with ``adaptive`` what this
        worker's speed gives (``worker.algorithms.dylu``)."""
        self._rounds = [self.clock] * fragments  # each fragment's next push clock
        stale = [i for i, k in enumerate(self.keys) if k not in client.versions]
        if stale:
            client.pull([self.keys[i] for i in stale], [self._outs[i] for i in stale],
                        clock=self.clock).wait()
        self._copy_in(range(len(self.params)))
        self.dynamic = DynamicSteps(inner_steps, client.control, clock=clock) if adaptive \
            else None
        """Measures the rounds and sizes the next (``adaptive``), else ``None``."""

    def step(self) -> bool:
        """One inner step (the inner optimizer's ``step`` and ``zero_grad``); then any fragment
        exchange due at this step. Returns whether one started."""
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.inner_step += 1
        for f, (_, land) in list(self._inflight.items()):
            if self.inner_step == land:
                self._land(f)
        if self.dynamic is not None and self.inner_step == self.round_steps:
            self.dynamic.finish(self.round_steps)  # before the exchange: its wait is not speed
        started = False
        for f, offset in enumerate(self._offsets):
            if self.inner_step == offset:
                self._send(f)
                started = True
        if self.inner_step == self.round_steps:
            self.inner_step = 0
            self.clock += 1
            self.client.clock = self.clock
            if self.dynamic is not None:
                self.round_steps = self.dynamic.next_steps()
                self._offsets = [self.round_steps]
                self.dynamic.start()
        return started

    def exchange(self) -> None:
        """End the round now (at the end of training, say): land what is in flight, exchange
        every fragment, wait for the new parameters and start a new round from them. Every
        worker must call it at the same step."""
        for f in range(self.fragments):
            if f in self._inflight:
                self._land(f)
            self._send(f)
            if f in self._inflight:
                self._land(f)
        self.inner_step = 0
        self.clock = self.client.clock = max(self._rounds)
        if self.dynamic is not None:
            self.dynamic.start()

    def _send(self, f: int) -> None:
        for i in self._tensors[f]:
            now = self.params[i][1].detach().reshape(-1).cpu().numpy()
            np.subtract(self._pulled[i], now, out=self._delta[i])
            if self._sent is not None:
                np.copyto(self._sent[i], now)
        idx = self._frag_keys[f]
        handle = self.encoder.push_pull([self.keys[j] for j in idx],
                                       [self._grads[j] for j in idx],
                                       [self._outs[j] for j in idx], clock=self._rounds[f])
        self._rounds[f] += 1
        if self.overlap_steps:
            land = (self.inner_step + self.overlap_steps - 1) % self.inner_steps + 1
            self._inflight[f] = (handle, land)
        else:
            self.client.complete(handle, self._copies)  # a lost shard: recovered, redone
            self._copy_in(self._tensors[f])

    def _land(self, f: int) -> None:
        """The exchange of fragment ``f`` completes: its parameters become the new global ones
        plus the progress made since they were sent."""
        handle, _ = self._inflight.pop(f)
        self.client.complete(handle, self._copies)
        with torch.no_grad():
            for i in self._tensors[f]:
                p = self.params[i][1].data.view(-1)
                now = p.cpu().numpy() if p.is_cuda else p.numpy()
                progress = now - self._sent[i]
                p.copy_(torch.from_numpy(self._pulled[i] + progress))

    def _copy_in(self, tensors) -> None:
        with torch.no_grad():
            for i in tensors:
                self.params[i][1].data.view(-1).copy_(torch.from_numpy(self._pulled[i]))

    def state_dict(self) -> dict:
        """What this worker must keep to resume: the inner optimizer's state, where the round
        stands and the encoder's error feedback (the parameters are the shards'):
        ``{"version": 1, "inner": ..., "inner_step": int, "clock": int, "encoder":
        Encoder.state_dict()}``."""
        return {"version": 1, "inner": self.inner.state_dict(), "inner_step": self.inner_step,
                "clock": self.clock, "encoder": self.encoder.state_dict(clock=self.clock)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (same model and inner optimizer; a state without a
        version, from before the encoder's was saved, restores the rest)."""
        if state.get("version", 1) != 1:
            raise ValueError(f"local SGD state of version {state['version']!r}; expected 1")
        if not 0 <= state["inner_step"] < self.inner_steps:
            raise ValueError(f"inner_step {state['inner_step']}; expected 0 .. "
                             f"{self.inner_steps - 1}")
        self.inner.load_state_dict(state["inner"])
        self.inner_step = state["inner_step"]
        if "encoder" in state:
            self.encoder.load_state_dict(state["encoder"], clock=state["clock"])

    def close(self) -> None:
        """Land what is in flight, leave the shards and stop the client."""
        try:
            for f in list(self._inflight):
                self._land(f)
        finally:
            self.encoder.close()
            self.client.close()
