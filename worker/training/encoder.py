"""``Encoder``: what a worker pushes for its gradients, and the state that takes.

The transport (``worker.transport.client.PSClient``) moves bytes; the encoder decides them. Per
push it owns:

- the **codec per clock**: the configured push codec, or the one the push policy calls for
  (1-bit Adam: bf16 during the warmup, then sign1), for every key of a tensor of at least
  ``compress_min_bytes``; smaller tensors go raw;
- **error feedback**: one ``proto.codecs.Compressor`` per key and codec, whose residual carries
  what the last payload missed (``residual = u - decode(code(u))``);
- **clipping** and its correction (``worker.training.clip``): a push's clip factor goes into the
  encoding, and :meth:`Encoder.clip_correct` folds the difference to the step's exact factor
  into the residuals;
- the **finiteness check**: a NaN or Inf is refused before it reaches any residual or moment
  (``NON_FINITE``, counted; nothing sent);
- the **threads** (``EncoderConfig.threads``, ``native.keypool``): a push's keys are checked
  and encoded on several threads at once, each key's state touched by one thread, the same bits
  as on one;
- the **push policy** (``worker.push_policy``) that the shards' registration replies
  call for, which may push something else than the gradients (1-bit Adam's momenta or Adam
  directions) and adds published codes its own way.

    encoder = Encoder(EncoderConfig(push_codec=CodecConfig(name="sign1")), client)
    encoder.register(plan, values, copies=copies)     # the client's Register, with the pull codec
    encoder.push_pull(keys, grads, outs, clock=0).wait()

Its state (residuals and the policy's) is one ``state_dict()`` (layout in :meth:`state_dict`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np

from bitps import native
from bitps.native.keypool import KeyPool
from bitps.native.preload import preload
from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import RAW, Codec, Compressor
from bitps.proto.keyplan import KeyPlan
from bitps.proto.wire import PSError
from bitps.worker.config import EncoderConfig
from bitps.worker.metrics import CodecSnapshot
from bitps.worker.push_policy import CODEC_PUSH, PushPolicy, for_registration
from bitps.worker.training.payload import ClipCorrection, refused_nonfinite
from bitps.worker.transport.client import Encoded, Handle, PSClient
from bitps.worker.transport.messages import COPY, check_array

__all__ = ["STATE_VERSION", "Encoder"]

_F32 = np.dtype("<f4")
_U64 = (1 << 64) - 1
STATE_VERSION = 1
"""Version of :meth:`Encoder.state_dict`'s layout."""
PRELOAD_JOIN_S = 60.0
"""The longest :meth:`Encoder.close` waits for numba's set-up (about 0.5 s on an idle core)."""


class Encoder:
    """The push side of one worker: codecs, error feedback, clipping and the push policy, in
    front of ``client``."""

    def __init__(self, cfg: EncoderConfig, client: PSClient) -> None:
        self.cfg = cfg
        self.client = client
        self.metrics = client.metrics
        self._push_codec = Codec.from_config(cfg.push_codec)
        self.pull_codec = Codec.from_config(cfg.pull_codec or cfg.push_codec)
        """What the shards publish for this worker's pulls (registered; ``ps.publish``)."""
        self._compressors: dict[tuple[int, int], Compressor] = {}
        self._shifts: list[int] = []  # the client's shifts the policy last heard of
        self._large: dict[int, bool] = {}
        self._large_for: KeyPlan | None = None
        self.policy: PushPolicy = CODEC_PUSH
        """What pushes carry, set at registration: the gradients through the push codec,
        unless the shards' rule calls for another (1-bit Adam)."""
        self.pushers: int | None = None
        """How many workers push each registered key (:meth:`register`; ``None``: unknown)."""
        self._pool = KeyPool(cfg.threads)
        self.metrics.watch_codecs(self._codec_snapshot)
        # numba's set-up while the model registers, not inside the first step
        self._preload = preload()

    def close(self) -> None:
        """Stop the encoder's helper threads (``EncoderConfig.threads``) and wait for numba's
        set-up (``bitps.native.preload``) if it still runs; the client is the caller's to
        close."""
        self._pool.close()
        # A run of a few fast steps can end before numba's set-up does. Left running, that
        # daemon thread meets the interpreter's exit: a garbage collection it triggers there
        # frees torch tensors, whose dealloc releases the GIL, and retaking it during
        # finalization ends the thread by an unwind through torch's noexcept code: SIGABRT,
        # "terminate called without an active exception", after the work was done (a stage
        # worker's core dump, 2026-12-05; pytorch/pytorch#38228).
        self._preload.join(timeout=PRELOAD_JOIN_S)

    @property
    def plan(self) -> KeyPlan | None:
        return self.client.plan

    @property
    def chooses_codecs(self) -> bool:
        """Whether the push policy picks the codecs by clock (``PushPolicy.chooses_codecs``:
        set once registered)."""
        return self.policy.chooses_codecs

    def register(self, plan: KeyPlan, values: Mapping[int, np.ndarray] | None = None, *,
                 copies: Mapping[int, np.ndarray] | None = None,
                 pushers: int | None = None) -> list[pb.RegisterReply]:
        """``client.register`` with this encoder's pull codec for the keys it compresses, then
        take the push policy the shards' replies call for (a policy that survives a rejoin and
        is called for again keeps its state). ``pushers``: how many workers push each key of
        ``plan`` (``None``: the client's world size for a whole plan, unknown for a part), kept
        as :attr:`pushers`."""
        large = self._large_keys(plan)
        compressed = frozenset(k for k, big in large.items() if big)
        replies = self.client.register(plan, values, copies=copies, pull_codec=self.pull_codec,
                                       compressed_pulls=compressed)
        for reply in replies:
            fresh = for_registration(reply)
            if fresh is not None and not (type(fresh) is type(self.policy)
                                          and self.policy.survives_rejoin):
                self.policy = fresh
        if pushers is None and not plan.partial:
            pushers = self.client.cfg.world_size
        self.pushers = pushers
        self.policy.bind(functools.partial(self.client.control.rule_state, plan=plan,
                                           versions=self.client.versions), plan, pushers=pushers)
        self.client.codes = self.policy.codes
        self._shifts = list(self.client.shift)
        return replies

    def follow_shards(self, clock: int) -> None:
        """Before a push for ``clock`` is encoded: re-register the shards a heartbeat found
        restarted (the client would at its next request, after this push was encoded at the
        step that shard is no longer at), then tell the push policy of the keys whose shard's
        step moved against this worker's (``PushPolicy.moved``)."""
        self.client.rejoin_restarted(clock)
        shifts = self.client.shift
        if self._shifts != shifts and self.plan is not None:
            moved = [s for s, (a, b) in enumerate(zip(self._shifts, shifts)) if a != b]
            self.policy.moved([k.key for s in moved for k in self.plan.for_shard(s)])
            self._shifts = list(shifts)

    # -- what a push is -----------------------------------------------------------------------
    def codec_at(self, clock: int) -> Codec:
        """The codec pushes for ``clock`` use: the configured push codec, or the push
        policy's (1-bit Adam: bf16 during warmup, then sign1)."""
        return self.policy.codec_at(clock, self._push_codec)

    def compressing(self, clock: int) -> bool:
        """Whether this run's pushes are compressed: a push codec at ``clock``, or a policy
        that picks codecs by clock (1-bit Adam). What the clip norm's default and the clip
        hold's ``sync`` go by (``EncoderConfig.clip_norm``, ``OverlapConfig``)."""
        return not self.codec_at(clock).is_raw or self.chooses_codecs

    def compresses(self, key: int, clock: int) -> bool:
        """Whether a push of ``key`` for ``clock`` goes compressed: a push codec is in force and
        the key's tensor (all its keys together) has at least ``compress_min_bytes``."""
        return not self.codec_at(clock).is_raw and self._large_keys(self.plan)[key]

    def _large_keys(self, plan: KeyPlan) -> dict[int, bool]:
        """By key id, per key of the plan: its tensor has at least ``compress_min_bytes``. The
        problem statement's rule is about one communication's size, so every key of such a
        tensor is compressed, however the plan cut it."""
        if self._large_for is not plan:
            tensor_bytes: dict[str, int] = {}
            for k in plan.keys:
                tensor_bytes[k.name] = tensor_bytes.get(k.name, 0) + k.nbytes
            self._large = {k.key: tensor_bytes[k.name] >= self.cfg.compress_min_bytes
                           for k in plan.keys}
            self._large_for = plan
        return self._large

    def push(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int,
             encoded: Mapping[int, np.ndarray] | None = None, scale: float | None = None,
             corrections: Sequence[ClipCorrection] = (), exact: float = 1.0) -> Handle:
        """Encode the gradients of ``keys`` for step ``clock`` (:meth:`encode`) and push
        them; then make the ``corrections`` of the step's earlier pushes (:meth:`clip_correct`
        with the step's ``exact`` factor)."""
        self.follow_shards(clock)
        handle = self.client.push(keys, self.encode(keys, grads, clock=clock, encoded=encoded,
                                                    scale=scale), clock=clock)
        self._correct(corrections, exact)
        return handle

    def push_pull(self, keys: Sequence[int], grads: Sequence[np.ndarray],
                  outs: Sequence[np.ndarray], *, clock: int,
                  encoded: Mapping[int, np.ndarray] | None = None, scale: float | None = None,
                  corrections: Sequence[ClipCorrection] = (), exact: float = 1.0) -> Handle:
        """:meth:`push`, and pull the parameters for ``clock + 1`` into ``outs``."""
        self.follow_shards(clock)
        handle = self.client.push_pull(keys, self.encode(keys, grads, clock=clock,
                                                         encoded=encoded, scale=scale),
                                       outs, clock=clock)
        self._correct(corrections, exact)
        return handle

    def _correct(self, corrections: Sequence[ClipCorrection], exact: float) -> None:
        for c in corrections:
            self.clip_correct(c.keys, c.grads, clock=c.clock, used=c.used, exact=exact)

    def encode(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int,
               encoded: Mapping[int, np.ndarray] | None = None,
               scale: float | None = None) -> Encoded | Sequence[np.ndarray]:
        """What the client sends for ``grads`` (float32, one per key) at ``clock``: the
        gradients themselves when nothing is compressed, clipped or made by the policy, else an
        :class:`~bitps.worker.transport.client.Encoded` push.

        ``encoded`` maps keys to payloads already compressed with :meth:`codec_at` (``clock``)
        by the caller, who then keeps their error feedback (``PSModel``'s device codec); those
        keys' ``grads`` are not read. ``scale``: a clip factor the gradients are multiplied by
        before error feedback. Every key then keeps error feedback, raw ones too, so that
        :meth:`clip_correct` can fold the difference to the step's exact factor into the next
        push; the caller has checked the gradients (their sum of squares for the factor is also
        their NaN/Inf check, ``worker.training.staging``).

        ``clock`` is this worker's step; each key is encoded at its shard's, ``clock`` plus the
        client's shift there (``PSClient.shift``: a shard back from an older checkpoint, or
        one that went on without this worker), which is what that shard reads the push by:
        the codec and what the policy pushes (1-bit Adam's warmup or compression) follow it."""
        if self.plan is None:
            raise RuntimeError("register() before push/pull")
        if len(grads) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(grads)} grads")
        steps = self._by_step(keys, clock)
        if len(steps) == 1:
            return self._encode(keys, grads, clock=next(iter(steps)), encoded=encoded,
                                scale=scale)
        payloads: list = [None] * len(keys)
        codecs: list = [None] * len(keys)
        owners: list = [None] * len(keys)
        for step, idx in steps.items():
            part = self._encode([keys[i] for i in idx], [grads[i] for i in idx], clock=step,
                                encoded={keys[i]: encoded[keys[i]] for i in idx
                                         if keys[i] in encoded} if encoded else None,
                                scale=scale)
            if not isinstance(part, Encoded):  # raw, as they are
                part = Encoded(list(part), [RAW] * len(idx), [None] * len(idx))
            for j, i in enumerate(idx):
                payloads[i], codecs[i], owners[i] = part.payloads[j], part.codecs[j], \
                    part.owners[j]
        return Encoded(payloads, codecs, owners)

    def _by_step(self, keys: Sequence[int], clock: int) -> dict[int, list[int]]:
        """Positions in ``keys`` by the step their shard is at for this worker's ``clock``."""
        shift = self.client.shift
        if not any(shift):
            return {clock: list(range(len(keys)))}
        steps: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            steps.setdefault(clock + shift[self.plan.key(key).shard], []).append(i)
        return steps

    def _encode(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int,
                encoded: Mapping[int, np.ndarray] | None,
                scale: float | None) -> Encoded | Sequence[np.ndarray]:
        """:meth:`encode` of keys whose shards are all at step ``clock``."""
        codec = self.codec_at(clock)
        if encoded:
            self._check_encoded(encoded, codec, clock)
        if scale is None and (not codec.is_raw or self.policy.keeps_state):
            self._check_finite(keys, grads, skip=encoded or {})
        fused = self._fused(keys, grads, codec, clock, 1.0 if scale is None else scale,
                            skip=encoded or {})
        if fused:  # the policy made these payloads itself; it prepares the others
            rest = [i for i in range(len(keys)) if i not in fused]
            prepared, clip, own = self.policy.prepare([keys[i] for i in rest],
                                                      [grads[i] for i in rest], clock,
                                                      1.0 if scale is None else scale)
            grads = list(grads)
            for i, g in zip(rest, prepared):
                grads[i] = g
        else:
            grads, clip, own = self.policy.prepare(keys, grads, clock,
                                                   1.0 if scale is None else scale)
        if codec.is_raw and scale is None and not own:
            return grads  # as they are, zero-copy (the client checks them against the plan)
        self._check_shapes(keys, grads)
        large = self._large_keys(self.plan)
        seed = (self.cfg.codec_seed * 1_000_003 + clock) * 65_537 + self.client.cfg.rank
        payloads: list = [None] * len(keys)
        owners: list = [None] * len(keys)  # how each goes: as it is, by copy, or held
        codecs, todo, raw_bytes = [], [], 0
        for i, (key, grad) in enumerate(zip(keys, grads)):
            compressed = not codec.is_raw and large[key]
            if compressed or own or scale is not None:
                owners[i] = COPY  # a buffer reused next push (a compressor's: set below)
            if i in fused:
                payloads[i] = fused[i]
                comp = self._compressors.get((key, codec.id))
                if comp is not None and comp.owns(fused[i]):
                    owners[i] = comp
            elif compressed and encoded and key in encoded:
                payloads[i] = memoryview(encoded[key]).cast("B")
            elif compressed or scale is not None:  # clipped raw keys: a raw compressor keeps
                # their residual; compressors are made here, on this thread (a dict of them)
                todo.append((i, self._compressor(key, clock, grad.shape[0]),
                             (seed * 131 + key) & _U64 if compressed else 0))
            else:
                payloads[i] = grad
            raw_bytes += grad.nbytes if compressed else 0
            codecs.append(codec if compressed else RAW)

        def one(item: tuple[int, Compressor, int]) -> None:  # one key: its own compressor
            i, comp, key_seed = item
            payloads[i], owners[i] = comp.encode(grads[i], seed=key_seed, scale=clip), comp

        self._pool.map(one, todo, sum(grads[i].nbytes for i, _, _ in todo))
        if raw_bytes:
            wire = sum(p.nbytes for p, c in zip(payloads, codecs) if c is codec)
            with self.metrics.lock:
                self.metrics.codec_raw_bytes.labels(codec.name).inc(raw_bytes)
                self.metrics.codec_wire_bytes.labels(codec.name).inc(wire)
        return Encoded(payloads, codecs, owners)

    def _fused(self, keys: Sequence[int], grads: Sequence[np.ndarray], codec: Codec,
               clock: int, clip: float, skip: Mapping[int, object]) -> dict[int, memoryview]:
        """By position in ``keys``: the payloads the push policy makes in one pass from the
        gradients (``PushPolicy.encode``: 1-bit Adam's momentum or direction, error feedback
        and code together), for the keys ``codec`` compresses, not in ``skip``."""
        if codec.is_raw:
            return {}
        large, todo = self._large_keys(self.plan), []
        for i, (key, grad) in enumerate(zip(keys, grads)):
            if large.get(key) and key not in skip:
                # every key checked before any is encoded: a bad one changes no state
                check_array(self.plan, key, grad, "gradient")
                todo.append((i, key, self._compressor(key, clock, grad.shape[0])))
        fused: dict[int, memoryview] = {}

        def one(item: tuple[int, int, Compressor]) -> None:  # one key: its own state
            i, key, comp = item
            payload = self.policy.encode(key, grads[i], comp, clock=clock, clip=clip)
            if payload is not None:
                fused[i] = payload

        self._pool.map(one, todo, sum(grads[i].nbytes for i, _, _ in todo))
        return fused

    def _check_shapes(self, keys: Sequence[int], grads: Sequence[np.ndarray]) -> None:
        for k, g in zip(keys, grads):
            check_array(self.plan, k, g, "gradient")

    def _check_encoded(self, encoded: Mapping[int, np.ndarray], codec: Codec,
                       clock: int) -> None:
        for key, data in encoded.items():
            if not self.compresses(key, clock):
                raise ValueError(f"key {key} is pushed raw at clock {clock}; only keys the "
                                 f"push codec compresses may come encoded")
            problem = codec.check(data, self.plan.key(key).length)
            if problem:
                raise ValueError(f"encoded key {key}: {problem}")

    def _compressor(self, key: int, clock: int, n: int) -> Compressor:
        """The error feedback ``key``'s pushes for ``clock`` go through: the push codec's when
        it compresses the key, else a raw one (only clipping adds to its residual)."""
        codec = self.codec_at(clock) if self.compresses(key, clock) else RAW
        comp = self._compressors.get((key, codec.id))
        if comp is None or comp.codec != codec:
            comp = self._compressors[key, codec.id] = Compressor(codec, n)
        return comp

    # -- checks and corrections ---------------------------------------------------------------
    def _check_finite(self, keys: Sequence[int], grads: Sequence[np.ndarray],
                      skip: Mapping[int, object]) -> None:
        """Refuse the push here when a gradient holds NaN or Inf: error feedback and 1-bit Adam
        moments would fold it into state that every later push carries (the shard refuses raw
        pushes itself, with the same code). Keys in ``skip`` arrive encoded (device codec):
        their host gradient is not read."""
        todo = [i for i, (key, grad) in enumerate(zip(keys, grads)) if key not in skip
                and grad.dtype == _F32 and grad.flags.c_contiguous]
        finite = [True] * len(keys)

        def one(i: int) -> None:
            finite[i] = native.all_finite(grads[i])

        self._pool.map(one, todo, sum(grads[i].nbytes for i in todo))
        for i in todo:  # the first such key, as one thread finds it
            if not finite[i]:
                raise self.refuse_nonfinite(keys[i])

    def refuse_nonfinite(self, key: int) -> PSError:
        """Count a push refused on this worker because ``key``'s gradient holds NaN or Inf, and
        return the error to raise (callers that keep their own error feedback, such as
        ``PSModel``'s device codec, use it too)."""
        return refused_nonfinite(self.metrics, key)

    def clip_correct(self, keys: Sequence[int], grads: Sequence[np.ndarray], *, clock: int,
                     used: float, exact: float) -> None:
        """``grads`` of ``keys`` were pushed for ``clock`` with clip factor ``used`` and the
        step's exact factor is ``exact`` (``worker.training.clip``): add what those pushes
        missed, ``(exact - used) * grads`` in the units they carried, to the keys' error
        feedback (and, with worker moments, move Adam's moments to what ``exact`` gives), so
        the next push delivers it. Call before the keys are pushed again; ``grads`` unchanged
        since."""
        if used == exact:
            return
        shift = self.client.shift
        for key, grad in zip(keys, grads):
            step = clock + shift[self.plan.key(key).shard]  # as it was encoded (encode)
            residual = self._compressor(key, step, grad.shape[0]).residual
            self.policy.correct(key, grad, residual, clock=step, used=used, exact=exact)

    def _codec_snapshot(self) -> CodecSnapshot:
        norms: dict[int, float] = {}
        if self.plan is not None:
            for (key, _), comp in list(self._compressors.items()):
                shard = self.plan.key(key).shard
                norms[shard] = float(np.hypot(norms.get(shard, 0.0), comp.residual_norm()))
        return CodecSnapshot(residual_norms=norms,
                             families=tuple(self.policy.collect(self.client.clock)))

    # -- state --------------------------------------------------------------------------------
    def residuals(self, *, clock: int | None = None) -> dict[int, np.ndarray]:
        """Every key's error-feedback residual for the codec its pushes use at ``clock``
        (default: the client's clock; raw keys' only when clipping gave them one). Arrays owned
        by the encoder, updated by each push."""
        clock = self.client.clock if clock is None else clock
        codec = self.codec_at(clock)
        return {k: c.residual for (k, _), c in self._compressors.items()
                if c.codec == (codec if self.compresses(k, clock) else RAW)}

    def load_residuals(self, residuals: Mapping[int, np.ndarray], *,
                       clock: int | None = None) -> None:
        """Restore residuals saved by :meth:`residuals` (same plan, same codec at ``clock``),
        checked whole before any is copied."""
        clock = self._check_residuals(residuals, clock)
        for key, r in residuals.items():
            np.copyto(self._compressor(key, clock, r.shape[0]).residual, r)

    def _check_residuals(self, residuals: Mapping[int, np.ndarray], clock: int | None) -> int:
        """Refuse residuals that do not fit the plan and the codec at ``clock``; the clock."""
        if self.plan is None:
            raise RuntimeError("register() before loading residuals")
        clock = self.client.clock if clock is None else clock
        if self.codec_at(clock).is_raw:
            raise ValueError("raw pushes keep no residuals; set a push codec")
        for key, r in residuals.items():
            n = self.plan.key(key).length if key in self.plan else None
            if r.shape != (n,) or r.dtype != _F32:
                raise ValueError(f"residual of key {key} is {r.dtype}{r.shape}; expected "
                                 f"float32[{n}] (a key of the plan)")
        return clock

    def policy_state(self) -> dict:
        """The push policy's part of :meth:`state_dict` by key (async/ssp 1-bit Adam with
        worker moments: every key's ``(step, m, v)`` pushed so far); empty for policies that
        keep none."""
        return self.policy.state_dict()["keys"]

    def load_policy_state(self, state) -> None:
        """Restore :meth:`policy_state` (same plan; after register()); a policy that keeps
        none, or state that does not fit the plan, is refused with nothing loaded."""
        if self.plan is None:
            raise RuntimeError("register() before load_policy_state()")
        self.policy.load_state_dict({"version": 1, "keys": state})

    def state_dict(self, *, clock: int | None = None) -> dict:
        """Layout version 1: ``{"version": 1, "residuals": {key: float32[length]}, "policy":
        PushPolicy.state_dict()}``, the residuals of the codec pushes use at ``clock``
        (:meth:`residuals`) and the push policy's state; copies."""
        return {"version": STATE_VERSION,
                "residuals": {k: r.copy() for k, r in self.residuals(clock=clock).items()},
                "policy": _copied(self.policy.state_dict())}

    def load_state_dict(self, state: Mapping, *, clock: int | None = None) -> None:
        """Restore a :meth:`state_dict` (same plan, same codec at ``clock``; after
        register())."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"encoder state of version {state.get('version')!r}; expected "
                             f"{STATE_VERSION}")
        if state["residuals"]:
            self._check_residuals(state["residuals"], clock)  # before the policy loads
        elif self.plan is None:
            raise RuntimeError("register() before load_state_dict()")
        self.policy.load_state_dict(state["policy"])
        if state["residuals"]:
            self.load_residuals(state["residuals"], clock=clock)


def _copied(value):
    """``value`` with every array in it copied (dicts, tuples and lists walked)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_copied(v) for v in value)
    return value
