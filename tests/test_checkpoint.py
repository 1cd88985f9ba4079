"""Shard checkpoints (``ps.checkpoint``) and ``bitps-export``: a restored shard continues bit for
bit as the original (every rule and layout, mid sync step, with compressed pulls and lookahead);
a crash mid-write never counts as a checkpoint; the newest ``keep`` are kept; a corrupt,
truncated or manifest-less checkpoint is refused by name and the previous one used; a checkpoint
of another shard, mode, optimizer or plan is refused; the export loads into torch and gives the
live model's loss."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence

import numpy as np
import pytest

from bitps.proto import bitps_pb2 as pb
from bitps.proto.codecs import Codec
from bitps.proto.wire import PROTOCOL
from bitps.ps import checkpoint as ckpt_mod
from bitps.ps.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoints,
    load,
    load_latest,
    restore,
    save,
)
from bitps.ps.config import OptimizerConfig, ServerConfig
from bitps.ps.onebit import OneBitConfig
from bitps.ps.shard import ShardCore

# two tensors, three keys: "w" (24, 50) cut in two, "b" (300,)
KEYS = [("w", (24, 50), 0, 700), ("w", (24, 50), 700, 500), ("b", (300,), 0, 300)]
SIGN1 = Codec(pb.CODEC_SIGN1, 64)


def _specs(compressed: bool) -> list[pb.KeySpec]:
    return [pb.KeySpec(key=i, name=name, offset=off, length=n, dtype=pb.FLOAT32,
                       compressed_pull=compressed, shape=pb.TensorShape(dims=shape))
            for i, (name, shape, off, n) in enumerate(KEYS)]


def _cfg(mode: str, optimizer: OptimizerConfig, **kw) -> ServerConfig:
    return ServerConfig(mode=mode, optimizer=optimizer, metrics_port=-1, **kw)


def _core(cfg: ServerConfig, *, world: int = 2, compressed: bool = False,
          signature: str = "s", register: bool = True) -> ShardCore:
    core = ShardCore(cfg, now=lambda: 0.0)
    if not register:
        return core
    rng = np.random.default_rng(0)
    values = {i: rng.standard_normal(n).astype(np.float32).tobytes()
              for i, (*_, n) in enumerate(KEYS)}
    for rank in range(world):
        req = pb.RegisterRequest(protocol=PROTOCOL, rank=rank, world_size=world,
                                 signature=signature, num_shards=cfg.num_shards,
                                 shard_id=cfg.shard_id, keys=_specs(compressed),
                                 sends_values=rank == 0)
        if compressed:
            req.pull_codec, req.pull_codec_chunk, req.pull_codec_flags = SIGN1.wire_fields()
        core.register(req, values if rank == 0 else {})
    return core


class Driver:
    """Workers in lockstep against one core: each clock every worker pushes, then pulls the
    next one; every reply (the parameters or codes it carries) goes into ``log``."""

    def __init__(self, core: ShardCore, world: int) -> None:
        self.core, self.world, self.log = core, world, []
        self.versions: dict[int, list[int]] = {}
        self.rid = 0

    def _send(self, header: pb.DataHeader, payload: list, request_id: int | None = None) -> None:
        if request_id is None:
            self.rid += 1
        header.request_id, header.protocol = request_id or self.rid, PROTOCOL
        for r in self.core.handle(f"w{header.worker}".encode(),
                                  [header.SerializeToString(), *payload]):
            assert r.header.op == pb.REPLY, r.header.message
            if r.payload:
                self.versions[r.header.worker] = list(r.header.versions)
            self.log.append((r.header.worker, r.header.clock, list(r.header.versions),
                             list(r.header.frame_codecs),
                             [bytes(memoryview(p).cast("B")) for p in r.payload]))

    def push(self, worker: int, clock: int, keys: Sequence[int] = range(len(KEYS)),
             request_id: int | None = None) -> None:
        """``worker``'s push of ``clock`` (of ``keys``; under ``request_id``, the next id
        unless given: a redo keeps its request's id)."""
        grads = [np.random.default_rng([worker, clock, i]).standard_normal(n).astype(np.float32)
                 for i, (*_, n) in enumerate(KEYS)]
        versions = self.versions.get(worker, [])
        # an incarnation, so that every push lands in the exactly-once window too
        self._send(pb.DataHeader(op=pb.PUSH, worker=worker, clock=clock, keys=keys,
                                 dtype=pb.FLOAT32, incarnation=1000 + worker,
                                 versions=[versions[k] for k in keys] if versions else []),
                   [grads[k].tobytes() for k in keys], request_id)

    def pull(self, worker: int, clock: int) -> None:
        self._send(pb.DataHeader(op=pb.PULL, worker=worker, clock=clock, keys=range(len(KEYS)),
                                 versions=self.versions.get(worker, [])), [])

    def steps(self, clocks: range, pushed: tuple[int, ...] = ()) -> None:
        """Clocks ``clocks``; in the first, the workers ``pushed`` have pushed already."""
        for clock in clocks:
            for w in range(self.world):
                if clock != clocks[0] or w not in pushed:
                    self.push(w, clock)
            for w in range(self.world):
                self.pull(w, clock + 1)


def _window(core: ShardCore) -> dict:
    """The exactly-once window's ids by worker (``ShardCore.dedup``'s state dict)."""
    return core.dedup.state_dict()["ids"]


def _state(core: ShardCore) -> dict:
    """Everything a continuation could differ in, as comparable values."""
    out = {"updates": core.updates_applied, "signature": core.signature,
           "clocks": {r: (w.clock, w.registered, w.left, w.dropped)
                      for r, w in core.clocks.workers.items()},
           "codec": {k: c["residual"].tobytes()
                     for k, c in core.codecs.state_dict()["keys"].items()},
           "dedup": _window(core)}
    for k, s in core.slots.items():
        out[k] = {"param": s.param.tobytes(), "version": s.version,
                  "rule": {n: np.asarray(a).tobytes()
                           for n, a in s.rule_state.state_dict().items()},
                  "delta": None if s.last_delta is None else s.last_delta.tobytes(),
                  "history": None if s.publisher is None else list(s.publisher.history),
                  "pushed": sorted(s.pushed), "folded": s.folded}
    return out


CASES = [(mode, OptimizerConfig(name=rule, lr=1e-2, momentum=0.9,
                                weight_decay=0.01 if rule == "adamw" else 0.0), False)
         for rule in ("sgd", "momentum", "adam", "adamw") for mode in ("sync", "async", "ssp")]
CASES += [
    ("sync", OptimizerConfig(name="onebit_adam", lr=1e-2,
                             rule_config=OneBitConfig(freeze_step=3)), False),
    ("sync", OptimizerConfig(name="onebit_adam", lr=1e-2,
                             rule_config=OneBitConfig(freeze_step=6, warmup_codes=True)), False),
    # bf16 warmup codes, restored before the switch (the history is bf16 codes, then sign1),
    # between the switch and the first compressed update (still bf16 codes) and after it (a
    # fresh shard's publisher, in the warmup's codec, takes the saved sign1 one)
    *[(mode, OptimizerConfig(name="onebit_adam", lr=1e-2, rule_config=OneBitConfig(
        freeze_step=freeze, warmup_codes=True, warmup_codec="bf16")), False)
      for mode in ("sync", "async") for freeze in (3, 4, 6)],
    ("async", OptimizerConfig(name="onebit_adam", lr=1e-2,
                              rule_config=OneBitConfig(freeze_step=3)), False),
    ("ssp", OptimizerConfig(name="onebit_adam", lr=1e-2, weight_decay=0.01,
                            rule_config=OneBitConfig(freeze_step=3, moments="shard")), False),
    ("async", OptimizerConfig(name="adam", lr=1e-2), True),   # compressed pulls
    ("sync", OptimizerConfig(name="momentum", lr=1e-2), True),
]


_ONEBIT_DEFAULTS = OneBitConfig()


def _case_id(m: str, o: OptimizerConfig, c: bool) -> str:
    r = o.rule_config or _ONEBIT_DEFAULTS
    return (f"{m}-{o.name}{'-shard' if r.moments == 'shard' else ''}"
            f"{f'-warmupcodes-{r.warmup_codec}' if r.warmup_codes else ''}"
            f"{'-sign1pull' if c else ''}"
            f"-f{r.freeze_step}")


@pytest.mark.parametrize("mode,optimizer,compressed", CASES,
                         ids=[_case_id(m, o, c) for m, o, c in CASES])
def test_a_restored_shard_continues_bit_for_bit(tmp_path, mode, optimizer, compressed):
    """Three workers train 4 clocks and workers 0 and 2 push the 5th (a sync step part in:
    rank 0's push summed, rank 2's kept aside for rank 1's); the shard is checkpointed and
    restored into a fresh core; both take the same further pushes and pulls: every reply,
    parameter, version, rule state, residual and published code agrees, across 1-bit Adam's
    switch."""
    cfg = _cfg(mode, optimizer)
    a = Driver(_core(cfg, world=3, compressed=compressed), world=3)
    a.steps(range(4))
    a.push(0, 4)
    a.push(2, 4)
    if mode == "sync":
        assert all(s.folded == 1 and set(s.held) == {2} for s in a.core.slots.values())
    saved = _state(a.core)
    path = save(a.core, tmp_path, keep=2)

    b = Driver(ShardCore(cfg, now=lambda: 0.0), world=3)
    restore(b.core, load(path))
    b.versions = {w: list(v) for w, v in a.versions.items()}
    b.rid = a.rid  # the workers go on numbering their requests: none is a replay
    assert _state(b.core) == saved
    a.log.clear()
    a.steps(range(4, 8), pushed=(0, 2))
    b.steps(range(4, 8), pushed=(0, 2))
    assert a.log == b.log and len(a.log) == 10 + 12  # acks, pulls
    assert _state(a.core) == _state(b.core)
    if compressed:  # the pulls after the restore were served from the restored history
        assert any(pb.CODEC_SIGN1 in codecs for _, _, _, codecs, _ in b.log)


def test_a_restored_shard_takes_its_workers_back(tmp_path):
    """After a restore the workers' registration (same plan) is accepted and rank 0's initial
    values do not overwrite the trained parameters."""
    cfg = _cfg("sync", OptimizerConfig(name="adam"))
    a = Driver(_core(cfg), world=2)
    a.steps(range(3))
    restored = ShardCore(cfg, now=lambda: 0.0)
    restore(restored, load(save(a.core, tmp_path, keep=1)))
    params = {k: s.param.copy() for k, s in restored.slots.items()}
    req = pb.RegisterRequest(protocol=PROTOCOL, rank=0, world_size=2, signature="s",
                             num_shards=1, shard_id=0, keys=_specs(False), sends_values=True)
    restored.register(req, {i: np.zeros(n, np.float32).tobytes()
                            for i, (*_, n) in enumerate(KEYS)})
    assert all(np.array_equal(s.param, params[k]) for k, s in restored.slots.items())
    assert restored.clocks.workers[0].clock == 3



def _reregister(core: ShardCore, rank: int) -> pb.RegisterReply:
    req = pb.RegisterRequest(protocol=PROTOCOL, rank=rank, world_size=2, signature="s",
                             num_shards=1, shard_id=0, keys=_specs(False),
                             sends_values=rank == 0)
    return core.register(req, {i: np.zeros(n, np.float32).tobytes()
                               for i, (*_, n) in enumerate(KEYS)} if rank == 0 else {})


def test_a_worker_whose_push_the_restored_step_holds_starts_at_the_next_step(tmp_path):
    """Rank 1's push of step 2 was acknowledged, its pull of step 3 never reached the shard,
    and the shard restarted from a checkpoint holding that push (a graceful stop's final
    checkpoint). Re-registering, rank 1 is told to start at step 3, not 2: told 2, it counted
    its push as lost and pushed step 2 again, which every key refused, first as a second push
    of the step and then, once rank 0's push completed it, as a push of a past clock, until
    its deadline (``tests/test_recovery.py``'s held-pull restart, once in a full run). Rank 0,
    which had not pushed, starts at 2; the step then completes as it would have. Where rank 0's
    push completed step 2 before rank 1 came back, rank 1 starts at 3 too."""
    cfg = _cfg("sync", OptimizerConfig(name="momentum", lr=1e-2, momentum=0.9))
    a = Driver(_core(cfg), world=2)
    a.steps(range(2))
    a.push(1, 2)
    b = Driver(ShardCore(cfg, now=lambda: 0.0), world=2)
    restore(b.core, load(save(a.core, tmp_path, keep=1)))
    b.versions, b.rid = dict(a.versions), a.rid
    assert [_reregister(b.core, r).start_clock for r in (1, 0)] == [3, 2]
    assert _reregister(a.core, 1).start_clock == 3  # without a restart alike
    # rank 0's push completes step 2 before rank 1 comes back: still 3 (the step had its push)
    c = Driver(ShardCore(cfg, now=lambda: 0.0), world=2)
    restore(c.core, load(save(a.core, tmp_path, keep=1)))
    c.versions, c.rid = dict(a.versions), a.rid
    c.push(0, 2)
    assert all(s.version == 3 and not s.pushed for s in c.core.slots.values())
    assert c.core.clocks.workers[1].clock == 2 and _reregister(c.core, 1).start_clock == 3
    for d in (a, b):
        d.steps(range(2, 4), pushed=(1,))
    assert all(s.version == 4 for s in b.core.slots.values())
    assert _state(a.core) == _state(b.core)


def test_a_push_split_over_messages_and_cut_by_the_restart_is_redone_once(tmp_path):
    """Rank 1's push of step 2 went out as two messages (the client cuts a shard's keys at
    ``message_bytes``); the shard took the first and was stopped before the second. Restored,
    it names step 2 as rank 1's start (the step lacks its push of the other keys), so rank 1
    redoes both messages under their own request ids: the first is a replay, answered and not
    summed again (the exactly-once window is in the checkpoint), the second completes rank 1's
    push. The shard then ends bit for bit as one that took the two messages without a stop."""
    cfg = _cfg("sync", OptimizerConfig(name="momentum", lr=1e-2, momentum=0.9))
    a = Driver(_core(cfg), world=2)
    a.steps(range(2))
    first, second = a.rid + 1, a.rid + 2
    a.push(1, 2, keys=[0], request_id=first)
    b = Driver(ShardCore(cfg, now=lambda: 0.0), world=2)
    restore(b.core, load(save(a.core, tmp_path, keep=1)))
    b.versions, b.rid = dict(a.versions), a.rid + 2
    assert [_reregister(b.core, r).start_clock for r in (1, 0)] == [2, 2]
    a.push(1, 2, keys=[1, 2], request_id=second)
    a.rid = second
    b.push(1, 2, keys=[0], request_id=first)
    b.push(1, 2, keys=[1, 2], request_id=second)
    assert all(s.pushed == {1} for s in b.core.slots.values())
    assert _state(a.core) == _state(b.core)
    for d in (a, b):
        d.steps(range(2, 4), pushed=(1,))
    assert all(s.version == 4 for s in b.core.slots.values())
    assert _state(a.core) == _state(b.core)


def test_a_leave_not_yet_applied_is_applied_after_the_restore(tmp_path):
    """Rank 1 leaves after rank 0 pushed for a sync step; the checkpoint is taken before the
    next tick, which completes the step with rank 0 alone, on the restored shard too."""
    cfg = _cfg("sync", OptimizerConfig(name="momentum", lr=1e-2))
    a = Driver(_core(cfg), world=2)
    a.steps(range(2))
    a.push(0, 2)
    a.core.leave(1)
    b = ShardCore(cfg, now=lambda: 0.0)
    restore(b, load(save(a.core, tmp_path, keep=1)))
    a.core.tick()
    b.tick()
    assert all(s.version == 3 for s in b.slots.values())
    assert _state(a.core) == _state(b)

def _push(core: ShardCore, request_id: int, *, incarnation: int = 77) -> pb.DataHeader:
    header = pb.DataHeader(op=pb.PUSH, protocol=PROTOCOL, worker=0, clock=0,
                           keys=range(len(KEYS)), dtype=pb.FLOAT32, incarnation=incarnation,
                           request_id=request_id)
    grads = [np.full(n, 0.25, np.float32).tobytes() for *_, n in KEYS]
    (reply,) = core.handle(b"w0", [header.SerializeToString(), *grads])
    return reply.header


def test_a_push_applied_before_the_checkpoint_is_not_applied_again_after_the_restore(tmp_path):
    """The exactly-once window is in the checkpoint, restored as it was: a push applied before
    the checkpoint and replayed after the restore is acknowledged and changes nothing; a new
    request id is applied; a shard restarted with a smaller ``dedup_window`` keeps the newest
    ids."""
    cfg = _cfg("async", OptimizerConfig(name="sgd", lr=0.5), lookahead=False)
    a = _core(cfg, world=1)
    for rid in (5, 6, 7):
        assert _push(a, rid).op == pb.REPLY
    window = {0: [(77, 5), (77, 6), (77, 7)]}
    assert _window(a) == window
    path = save(a, tmp_path, keep=1)
    assert load(path).manifest["dedup"] == {"0": [[77, 5], [77, 6], [77, 7]]}

    b = ShardCore(cfg, now=lambda: 0.0)
    restore(b, load(path))
    assert _window(b) == window
    before = _state(b)
    replay = _push(b, 6)
    assert replay.op == pb.REPLY and replay.request_id == 6
    assert _state(b) == before and b.updates_applied == 3 * len(KEYS)
    assert _push(b, 6, incarnation=78).op == pb.REPLY  # another incarnation: another push
    assert b.updates_applied == 4 * len(KEYS)

    small = ShardCore(dataclasses.replace(cfg, dedup_window=2), now=lambda: 0.0)
    restore(small, load(path))
    assert _window(small) == {0: [(77, 6), (77, 7)]}
    off = ShardCore(dataclasses.replace(cfg, dedup_window=0), now=lambda: 0.0)
    restore(off, load(path))
    assert _window(off) == {}


def test_a_checkpoint_without_a_window_restores_an_empty_one(tmp_path):
    """A manifest written before the window was saved (no ``dedup`` entry) still restores."""
    a = _trained()
    path = save(a.core, tmp_path, keep=1)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("dedup")
    manifest.pop("manifest_sha256")
    manifest["manifest_sha256"] = ckpt_mod._digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    b = ShardCore(a.core.cfg, now=lambda: 0.0)
    restore(b, load(path))
    assert _window(b) == {} and b.updates_applied == a.core.updates_applied


def _old_optimizer_layout(path, **rule_keys) -> None:
    """Rewrite ``path``'s manifest as a checkpoint of before rule config sections: every rule's
    settings at the top level of ``config.optimizer`` under their flag names."""
    manifest = json.loads((path / "manifest.json").read_text())
    opt = manifest["config"]["optimizer"]
    opt.pop("rule_config", None)
    opt.update({"freeze_step": 100, "onebit_chunk": 256, "onebit_scale": "auto",
                "onebit_moments": "auto", "onebit_warmup_codes": False, **rule_keys})
    manifest.pop("manifest_sha256")
    manifest["manifest_sha256"] = ckpt_mod._digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("optimizer", [
    OptimizerConfig(name="adam", lr=1e-2),
    OptimizerConfig(name="onebit_adam", lr=1e-2, rule_config=OneBitConfig(freeze_step=3))])
def test_a_checkpoint_of_the_flat_optimizer_layout_restores(tmp_path, optimizer):
    """A manifest written before update rules had config sections of their own (1-bit Adam's
    settings were fields of every optimizer config) restores into today's config, and one of
    other settings is still refused."""
    a = Driver(_core(_cfg("sync", optimizer), world=1), world=1)
    a.steps(range(4))
    path = save(a.core, tmp_path, keep=1)
    freeze = optimizer.rule_config.freeze_step if optimizer.rule_config else 100
    _old_optimizer_layout(path, freeze_step=freeze)
    b = ShardCore(a.core.cfg, now=lambda: 0.0)
    restore(b, load(path))
    assert _state(b) == _state(a.core)
    if optimizer.rule_config is not None:
        _old_optimizer_layout(path, freeze_step=freeze + 1)
        with pytest.raises(CheckpointError, match="optimizer"):
            restore(ShardCore(a.core.cfg, now=lambda: 0.0), load(path))


def test_a_float32_switch_state_restores_into_a_compact_one(tmp_path):
    """onebit_compact_state may change at a restart, and checkpoints from before it existed
    restore: a sync 1-bit Adam shard past the switch, saved without it and restored with it,
    sends workers m's code and the denominators it applies with itself (rounded to bf16 when
    they are made again after the restore)."""
    from bitps.native import casts, sign1

    def onebit(compact: bool) -> ServerConfig:
        return _cfg("sync", OptimizerConfig(name="onebit_adam", lr=1e-2, rule_config=OneBitConfig(
            freeze_step=3, compact_state=compact)))

    a = Driver(_core(onebit(False), world=1), world=1)
    a.steps(range(5))
    path = save(a.core, tmp_path, keep=1)
    manifest = json.loads((path / "manifest.json").read_text())  # as written before the field
    manifest["config"]["optimizer"]["rule_config"].pop("compact_state")
    manifest.pop("manifest_sha256")
    manifest["manifest_sha256"] = ckpt_mod._digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    b = ShardCore(onebit(True), now=lambda: 0.0)
    restore(b, load(path))
    for msg in b.rule.rule_state(b.slots):
        ob, n = b.slots[msg.key].rule_state, b.slots[msg.key].length
        m, den = msg.arrays
        assert (m.codec, den.name, den.dtype) == (pb.CODEC_SIGN1, "denominator", pb.BFLOAT16)
        m_out, den_out = np.zeros(n, np.float32), np.zeros(n, np.float32)
        sign1.decode_add(m.data, n, m_out, chunk=ob.codec.chunk)
        casts.bf16_decode_add(den.data, n, den_out)
        assert np.array_equal(m_out, ob.buf1)
        assert np.array_equal(den_out, b.rule.denominator(ob))  # what the shard applies
        saved = a.core.rule.denominator(a.core.slots[msg.key].rule_state)
        assert not np.array_equal(saved, den_out)  # rounded after the restore, not before
        assert np.abs(den_out - saved).max() <= 2 ** -8 * np.abs(saved).max()


@pytest.mark.parametrize("compact", [True, False])
def test_the_switch_state_is_made_by_the_update_that_switches(compact):
    """sync 1-bit Adam: the update that ends the warmup makes each key's frozen denominators
    (and with onebit_compact_state the message workers fetch), while workers wait for that
    step's pull, not at their fetch in the next step's backward; the fetch sends them."""
    cfg = _cfg("sync", OptimizerConfig(name="onebit_adam", lr=1e-2, rule_config=OneBitConfig(
        freeze_step=3, compact_state=compact)))
    a = Driver(_core(cfg, world=1), world=1)
    a.steps(range(2))
    assert not any(s.rule_state.compressing or s.rule_state.denominator is not None
                   for s in a.core.slots.values())
    a.steps(range(2, 3))
    made = {k: (s.rule_state.denominator, s.rule_state._message)
            for k, s in a.core.slots.items()}
    assert all(den is not None and (msg is not None) == compact for den, msg in made.values())
    for msg in a.core.rule.rule_state(a.core.slots):
        den, made_msg = made[msg.key]
        assert a.core.slots[msg.key].rule_state.denominator is den
        assert (msg is made_msg) == compact


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bf16_warmup_codes_turn_to_sign1_at_the_first_compressed_update(mode):
    """With bf16 warmup codes the warmup's pulls carry two bytes per element; the pull of the
    warmup's last update still gets its bf16 code (the switch keeps them), and the first
    compressed update turns the publisher to sign1: a worker behind it pulls the
    parameters."""
    cfg = _cfg(mode, OptimizerConfig(name="onebit_adam", lr=1e-2, rule_config=OneBitConfig(
        freeze_step=3, warmup_codes=True, warmup_codec="bf16")))
    a = Driver(_core(cfg, world=1), world=1)
    a.steps(range(3))
    for slot in a.core.slots.values():
        assert slot.rule_state.compressing == (mode == "sync")  # async: at the next push
        assert slot.publisher.codec.id == pb.CODEC_BF16
        assert slot.publisher.reply_frame(2, 3) == (pb.CODEC_BF16, slot.publisher.history[-1][1])
        assert len(slot.publisher.history[-1][1]) == 2 * slot.length
    assert {c for _, _, _, codecs, _ in a.log for c in codecs} == {pb.CODEC_RAW, pb.CODEC_BF16}
    a.steps(range(3, 4))
    for slot in a.core.slots.values():
        assert slot.publisher.codec == slot.rule_state.codec
        assert [v for v, _ in slot.publisher.history] == [4]
        assert slot.publisher.reply_frame(2, 4) == (pb.CODEC_RAW, None)
    assert pb.CODEC_SIGN1 in a.log[-1][3]


# -- on disk ------------------------------------------------------------------------------------
def _trained(steps: int = 2, **cfg_kw) -> Driver:
    d = Driver(_core(_cfg("sync", OptimizerConfig(name="adam"), **cfg_kw), world=1), world=1)
    d.steps(range(steps))
    return d


def test_the_layout_is_safetensors_and_a_json_manifest_with_checksums(tmp_path):
    d = _trained()
    path = save(d.core, tmp_path, keep=1)
    assert path.name.startswith(f"ckpt-{d.core.updates_applied:012d}-")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "params.safetensors",
                                                      "state.safetensors"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["plan"]["keys"][0]["shape"] == [24, 50]
    assert set(manifest["files"]) == {"params.safetensors", "state.safetensors"}
    ckpt = load(path)
    assert sorted(ckpt.params) == ["0", "1", "2"]
    assert {"0/rule/step", "0/rule/buf1", "0/rule/buf2"} <= set(ckpt.state)


def test_a_crash_mid_write_never_counts_as_a_checkpoint(tmp_path, monkeypatch):
    d = _trained()
    first = save(d.core, tmp_path, keep=3)
    d.steps(range(2, 3))

    def crash(src, dst):
        raise OSError("power cut")

    # killed between writing the files and the rename: only a temp directory is left
    monkeypatch.setattr(ckpt_mod.os, "rename", crash)
    with pytest.raises(OSError, match="power cut"):
        save(d.core, tmp_path, keep=3)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert checkpoints(tmp_path) == [first]
    assert load_latest(tmp_path).path == first
    second = save(d.core, tmp_path, keep=3)  # and the next save clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


def test_only_the_newest_keep_checkpoints_are_kept(tmp_path):
    d = _trained(1)
    written = []
    for clock in range(1, 5):
        d.steps(range(clock, clock + 1))
        written.append(save(d.core, tmp_path, keep=2))
    assert checkpoints(tmp_path) == written[:-3:-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written[-2:])
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save(d.core, tmp_path, keep=0)


@pytest.mark.parametrize("damage,problem", [
    ("flip", "state.safetensors: sha256 .* \\(corrupt\\)"),
    ("truncate", "params.safetensors: .* bytes; the manifest records .* \\(truncated\\)"),
    ("no_manifest", "manifest.json: no manifest"),
    ("edit_manifest", "manifest.json: manifest sha256 .* \\(edited or corrupt\\)"),
])
def test_a_damaged_checkpoint_is_refused_by_name_and_the_previous_one_used(
        tmp_path, caplog, damage, problem):
    d = _trained()
    older = save(d.core, tmp_path, keep=3)
    d.steps(range(2, 3))
    newer = save(d.core, tmp_path, keep=3)
    if damage == "flip":
        data = bytearray((newer / "state.safetensors").read_bytes())
        data[-5] ^= 0x40
        (newer / "state.safetensors").write_bytes(bytes(data))
    elif damage == "truncate":
        with (newer / "params.safetensors").open("r+b") as f:
            f.truncate(os.path.getsize(newer / "params.safetensors") // 2)
    elif damage == "no_manifest":
        (newer / "manifest.json").unlink()
    else:
        m = json.loads((newer / "manifest.json").read_text())
        m["keys"]["0"]["version"] += 1
        (newer / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=problem) as err:
        load(newer)
    assert isinstance(err.value, ValueError) and newer in err.value.path.parents
    with caplog.at_level(logging.WARNING, logger="bitps.checkpoint"):
        assert load_latest(tmp_path).path == older
    assert "skipping checkpoint" in caplog.text and newer.name in caplog.text
    (older / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no valid checkpoint among 2"):
        load_latest(tmp_path)
    assert load_latest(tmp_path / "empty") is None


def test_a_checkpoint_of_another_shard_mode_optimizer_or_plan_is_refused(tmp_path):
    opt = OptimizerConfig(name="adam", lr=1e-3)
    src = Driver(_core(_cfg("sync", opt, shard_id=0, num_shards=2), world=1), world=1)
    src.steps(range(2))
    ckpt = load(save(src.core, tmp_path, keep=1))
    refusals = [
        (_cfg("sync", opt, shard_id=1, num_shards=2), "shard_id 0; this shard runs shard_id 1"),
        (_cfg("sync", opt, num_shards=3), "num_shards 2; this shard runs num_shards 3"),
        (_cfg("async", opt, num_shards=2), "mode 'sync'; this shard runs mode 'async'"),
        (_cfg("sync", OptimizerConfig(name="adam", lr=2e-3), num_shards=2), "optimizer"),
        (_cfg("sync", OptimizerConfig(name="sgd", lr=1e-3), num_shards=2), "optimizer"),
    ]
    for cfg, match in refusals:
        core = ShardCore(cfg, now=lambda: 0.0)
        with pytest.raises(CheckpointError, match=match):
            restore(core, ckpt)
        assert not core.slots
    other_plan = _core(_cfg("sync", opt, num_shards=2), world=1, signature="other")
    with pytest.raises(CheckpointError, match="key plan 's' of 3 keys; this shard holds "
                       "'other'"):
        restore(other_plan, ckpt)


def test_the_checkpointer_saves_when_due_and_on_demand(tmp_path):
    t = [0.0]
    d = _trained(1)
    c = Checkpointer(d.core, tmp_path, keep=2, every_updates=6, every_s=100,
                     background=False, now=lambda: t[0])
    assert c.maybe_save() is None  # nothing applied since it started
    d.steps(range(1, 2))  # 3 key updates
    assert not c.due()
    d.steps(range(2, 3))
    first = c.maybe_save()
    assert first is not None and load(first).updates == d.core.updates_applied == 9
    d.steps(range(3, 4))
    assert c.maybe_save() is None
    t[0] = 100.0  # the time trigger
    assert c.maybe_save() is not None
    bg = Checkpointer(d.core, tmp_path, keep=2, every_s=50, now=lambda: t[0])
    d.steps(range(4, 5))
    t[0] = 150.0
    assert bg.maybe_save() is None  # written on its own thread
    bg.close()
    assert bg.error is None and checkpoints(tmp_path)[0] == bg.last_path
    final = c.save_now()
    assert checkpoints(tmp_path) == [final, bg.last_path]
    fresh = Checkpointer(ShardCore(d.core.cfg, now=lambda: 0.0), tmp_path)
    assert fresh.restore_latest().path == final
    assert _state(fresh.core) == _state(d.core)
    assert Checkpointer(ShardCore(d.core.cfg), tmp_path / "none").restore_latest() is None
    with pytest.raises(ValueError, match="nothing to checkpoint"):
        save(ShardCore(d.core.cfg), tmp_path, keep=1)


# -- export -------------------------------------------------------------------------------------
def test_export_rebuilds_the_model_and_torch_loads_it_with_the_live_loss(cluster, tmp_path):
    """The demo model trained a few steps through PSModel on two in-process shards; both shards
    checkpointed; ``bitps-export``'s file loads into a fresh demo model (strict) whose loss
    equals the live model's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from bitps.ps.export import main
    from bitps.worker import ClientConfig, PSClient
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn
    from bitps.worker.training.model import PSModel
    from tests.test_cluster import servers_of

    torch.set_num_threads(1)
    shards = cluster(2, mode="sync", metrics_port=-1,
                     optimizer=OptimizerConfig(name="adam", lr=3e-3))
    demo = DemoConfig(seq_len=32, batch_size=4, corpus_bytes=100_000)
    model = build_model(demo)
    ps_model = PSModel(model, PSClient(ClientConfig(servers=servers_of(shards),
                                                    partition_bytes=64 << 10)))
    data = batches(load_corpus(demo.corpus_bytes), batch_size=4, seq_len=32, rank=0,
                   world_size=1, seed=0)
    for _ in range(3):
        loss_fn(model, *next(data)).backward()
        ps_model.step()
    ps_model.synchronize()
    dirs = [tmp_path / f"shard{s.cfg.shard_id}" for s in shards]
    for shard, d in zip(shards, dirs):
        save(shard.core, d, keep=1)
    ps_model.close()
    out = tmp_path / "model.safetensors"
    assert main(["--checkpoint-dir", *map(str, dirs), "--out", str(out)]) == 0

    fresh = build_model(DemoConfig(**{**demo.__dict__, "seed": 1}))
    fresh.load_state_dict(safetensors_torch.load_file(str(out)))
    x, y = next(data)
    with torch.no_grad():
        assert loss_fn(fresh, x, y).item() == loss_fn(model, x, y).item()
    assert main(["--checkpoint-dir", str(dirs[0]), "--out", str(out)]) == 1  # shard 1 missing


def test_export_rebuilds_tensors_from_their_keys_and_refuses_what_it_cannot(tmp_path):
    """Without torch: one shard's keys are put back into their tensors' shapes; a plan whose
    keys carry no shape (a worker that predates ``KeySpec.shape``) is refused by name."""
    from bitps.ps.export import export

    d = _trained()
    save(d.core, tmp_path / "s0", keep=1)
    tensors = export([tmp_path / "s0"], tmp_path / "m.safetensors")
    params = [d.core.slots[k].param for k in range(len(KEYS))]
    assert tensors["w"].shape == (24, 50) and tensors["b"].shape == (300,)
    np.testing.assert_array_equal(tensors["w"].ravel(), np.concatenate(params[:2]))
    np.testing.assert_array_equal(tensors["b"], params[2])

    shapeless = _core(_cfg("sync", OptimizerConfig(name="adam")), world=1)
    for slot in shapeless.slots.values():
        slot.spec.ClearField("shape")
    save(shapeless, tmp_path / "old", keep=1)
    with pytest.raises(CheckpointError, match="key 0 of 'w' has no tensor shape"):
        export([tmp_path / "old"], tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        export([tmp_path / "none"], tmp_path / "m.safetensors")
