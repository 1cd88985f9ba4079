"""Push policies: what a worker pushes for its gradients, chosen at registration.

The encoder (``worker.training.encoder``) asks the policy the shards' registration replies call
for, per push, which codec the clock calls for (:meth:`PushPolicy.codec_at`), what is pushed for
the gradients (:meth:`PushPolicy.prepare`: the gradients themselves, or a 1-bit Adam momentum or
direction made from them; :meth:`PushPolicy.encode`: the same made and compressed in one pass),
how an inexact clip factor is made good (:meth:`PushPolicy.correct`), and how the codes a shard
publishes are added to the worker's copy (:attr:`PushPolicy.codes`, which the transport's
channels use). Neither the encoder nor the transport holds an algorithm's code; a policy that
needs the shards' rule state gets a fetch function (:meth:`PushPolicy.bind`), not the client.

- :class:`CodecPush` (every shard rule but ``onebit_adam``): the gradients, raw or through the
  configured push codec, with error feedback per key.
- Algorithms register factories that claim a registration reply (:func:`register_policy`):
  ``worker.algorithms.onebit.SyncMomenta`` and ``MomentsPush`` are sync 1-bit Adam's momenta
  and async/ssp 1-bit Adam's worker-side Adam directions (bf16 gradients during the warmup).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Metric

from bitps import native
from bitps.proto.codecs import Codec, Compressor
from bitps.worker.transport.channel import DECODE_ADD, CodeApplier

if TYPE_CHECKING:
    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.keyplan import KeyPlan

__all__ = ["CODEC_PUSH", "POLICIES", "CodecPush", "PushPolicy", "RuleStateFetch",
           "for_registration", "register_policy"]

RuleStateFetch = Callable[[Sequence[int], Callable[["pb.KeyRuleState", int], None]], None]
"""``fetch(keys, load)``: each key's rule state from its shard, handed to ``load(message,
length)``; a state of another version than the worker's copy is refused (``BAD_CLOCK``)."""


class PushPolicy:
    """How one worker turns gradients into pushes; one per encoder, set at registration."""

    chooses_codecs = False
    """Whether the policy picks the push codec by clock itself (1-bit Adam: bf16, then sign1)
    and may push something made from the gradients instead of them. Such pushes are clipped
    even without a configured push codec, are encoded on the host (no device codec), and
    cannot carry local SGD's pseudo-gradients."""
    keeps_state = False
    """Whether pushes fold the gradients into state (moments): a NaN must be refused first."""
    codes: CodeApplier = DECODE_ADD
    """How the transport adds a published code to this worker's copy."""
    survives_rejoin = False
    """Whether a registration again (a rejoin) keeps this policy and its state, or takes the
    fresh one the shards' replies call for."""

    def bind(self, fetch: RuleStateFetch, plan: KeyPlan, *, pushers: int | None = None
             ) -> None:
        """Called once the policy is chosen (at each registration): how to fetch the shards'
        rule state, the plan registered, and how many workers push each of its keys
        (``None``: not known, a pipeline stage's part of a plan); the policies that use them
        keep them."""
        self.plan = plan

    def codec_at(self, clock: int, configured: Codec) -> Codec:
        """The codec pushes for ``clock`` use (``configured``: the encoder's push codec)."""
        return configured

    def prepare(self, keys: Sequence[int], grads: Sequence[np.ndarray],
                clock: int, clip: float) -> tuple[Sequence[np.ndarray], float, bool]:
        """What to push for ``grads`` of ``keys`` at ``clock``, with clip factor ``clip``:
        ``(arrays, clip factor still to apply, whether the arrays are this policy's own
        buffers)`` (own buffers change with the next push: they go by copy)."""
        return grads, clip, False

    def encode(self, key: int, grad: np.ndarray, comp: Compressor, *, clock: int,
               clip: float) -> memoryview | None:
        """The payload of a compressed ``key`` made in one pass from the gradient ``grad``
        (clip factor ``clip``) with the policy's own arithmetic fused into ``comp``'s encode
        (its buffer and error feedback), or ``None``: :meth:`prepare` and ``comp`` make it. The
        encoder asks before :meth:`prepare`, which then sees only the keys answered
        ``None``."""
        return None

    def correct(self, key: int, grad: np.ndarray, residual: np.ndarray, *, clock: int,
                used: float, exact: float) -> None:
        """A push of ``grad`` for ``clock`` went with clip factor ``used`` where ``exact`` was
        right: add the difference to ``residual`` (the key's error feedback) in the units the
        push carried."""
        native.add_scaled(residual, grad, np.float32(exact - used))

    def moved(self, keys: Sequence[int]) -> None:
        """The shard of ``keys`` is at another step than before (``PSClient.shift``: it came
        back from an older checkpoint, or went on without this worker): forget what was taken
        from it for them; nothing by default."""

    def collect(self, clock: int) -> Iterator[Metric]:
        """The policy's own Prometheus metric families at the worker's ``clock``, read at
        scrape time (``WorkerMetrics.watch_codecs``); none by default."""
        return iter(())

    def state_dict(self) -> dict:
        """The state this policy keeps on the worker (a ``proto.state.Stateful``): layout
        version 1, ``{"version": 1, "keys": {key: ...}}``, each key's entry the policy's own
        (1-bit Adam's worker moments: ``(step, m, v)``); no keys by default. Arrays are the
        policy's own, updated by each push."""
        return {"version": 1, "keys": {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` for the plan it was bound to, validated whole before
        anything changes; a policy that keeps no state refuses any."""
        if state.get("version") != 1:
            raise ValueError(f"push policy state of version {state.get('version')!r}; "
                             f"expected 1")
        if state.get("keys"):
            raise RuntimeError(f"the {type(self).__name__} push policy keeps no worker state: "
                               "register() with shards whose rule calls for a policy that "
                               "keeps some first")


class CodecPush(PushPolicy):
    """The gradients, through the configured push codec with error feedback (raw: as they are,
    and clipped raw keys through a raw compressor that keeps what clipping missed)."""


CODEC_PUSH = CodecPush()


PolicyFactory = Callable[["pb.RegisterReply"], "PushPolicy | None"]
POLICIES: list[PolicyFactory] = []
"""Factories that may claim a shard's ``RegisterReply``, in registration order; an algorithm
module adds its own with :func:`register_policy` (``bitps.worker.algorithms`` does, on import)."""


def register_policy(factory: PolicyFactory) -> PolicyFactory:
    """Add ``factory`` (reply -> policy, or ``None`` when the reply is not its algorithm's);
    usable as a decorator."""
    if factory in POLICIES:
        raise ValueError(f"push policy factory {factory.__qualname__!r} is already registered")
    POLICIES.append(factory)
    return factory


def for_registration(reply) -> PushPolicy | None:
    """The policy a shard's ``RegisterReply`` calls for (the first registered factory that
    claims it, e.g. 1-bit Adam's), or ``None``: the encoder's codec push."""
    for factory in POLICIES:
        policy = factory(reply)
        if policy is not None:
            return policy
    return None
