"""Shard checkpoints: a shard's whole state on disk, written atomically, restored bit for bit.

:func:`save` writes one checkpoint of a :class:`~bitps.ps.shard.ShardCore` and keeps the newest
``keep``; :func:`load_latest` finds the newest valid one and :func:`restore` puts it into a fresh
core, which then continues exactly as the original would have. :class:`Checkpointer` is what a
server drives (periodic saves, a final save on SIGTERM). ``bitps-export`` (``ps.export``) turns the
shards' checkpoints into one state dict of the model. No torch, no pickle. Writing, listing,
pruning and verified reading of the files are ``ps.checkpoint_files`` (re-exported here).

On-disk layout, one directory per shard::

    DIR/
      ckpt-<updates:012d>-<unix ns:019d>/  one checkpoint (updates = ShardCore.updates_applied)
        params.safetensors    float32 parameters: tensor "<key>" per key, shape (length,)
        state.safetensors     everything else, tensors "<key>/<what>" (below)
        manifest.json         written last: format, shard config, key plan, clocks, per-key
                              scalars, sha256 and size of both files, its own sha256
      .tmp-...                a checkpoint being written or deleted: never read; the next save
                              removes it

The checkpoint composes the state dicts of the shard's parts (``proto.state.Stateful``: each
``state_dict()`` carries its layout ``"version"``, recorded in the manifest's ``"layouts"``):
each key's rule state (``Slot.rule_state``: ``ps.rules.KeyState``, or a rule's own such as
``ps.onebit.OneBitState``; local SGD's outer rule is one of them), the published codes
(``ShardCore.codecs``, ``ps.publish.PublishedCodes`` of ``Publisher`` state dicts) and the
exactly-once window (``ShardCore.dedup``, ``ps.dedup.ExactlyOnce``); the key store's own arrays
(parameters, lookahead, the sync step's pushes) it copies itself.

``state.safetensors``, per key:

    ``<key>/rule/<name>``   the rule state dict's arrays (step, moments; a rule's own, e.g.
                            1-bit Adam's switch flag, frozen bias correction and m code; a
                            nested dict's as ``<name>/<inner name>``); its other entries
                            (scalars, lists: a plug-in rule's counters) are the manifest's
                            ``keys.<key>.rule``
    ``<key>/residual``      the shard's error feedback of the codes it publishes (the
                            publisher state dict's ``residual``; keys with compressed pulls,
                            rules that publish codes of their own)
    ``<key>/history``       the published payloads still kept, concatenated (uint8; their
                            versions and sizes are in the manifest)
    ``<key>/last_delta``    lookahead pulls: the key's last update
    ``<key>/acc``           sync: the sum of this step's pushes folded so far (when any)
    ``<key>/held/<rank>``   sync: a push kept aside until a lower rank's arrives

``manifest.json``::

    {"format": "bitps-shard-checkpoint", "version": 1, "created_unix": 1718000000.1,
     "bitps_version": "...", "config": {"shard_id", "num_shards", "mode", "lookahead",
     "optimizer": {...}, "staleness", "split_lr", "staleness_damping",
     "compensation"},
     "plan": {"signature", "model_keys", "pull_codec": [id, chunk, flags] | null,
              "keys": [{"key", "name",
              "offset", "length", "compressed_pull", "shape": [dims] | null}]},
     "core": {"updates_applied", "initialized", "membership_changed"},
     "clocks": {"world_size", "workers": [{"rank", "clock", "registered", "left", "dropped"}]},
     "keys": {"<key>": {"version", "pushed": [ranks], "folded", "history": [[version, bytes]],
              "pushers": [ranks whose plan has the key], "initialized",
              "rule": {"<name>": JSON value},
              "published_codec": [id, chunk, flags]}},   (partial plans: each key's pushers;
              absent from older checkpoints: every registered rank. "rule": the rule state's
              entries that are no arrays, flat names as in state.safetensors; absent when none.
              "published_codec": the codec of the history's payloads; absent when the key
              publishes nothing, and from older checkpoints: the publisher's configured one)
     "dedup": {"<rank>": [[incarnation, request_id], ...]},   the exactly-once window
              (ShardCore.dedup's "ids"), oldest first: a push applied before the checkpoint
              and replayed after a restore is answered and not applied again
     "layouts": {"rule", "codec", "codecs", "dedup"},   the state-dict version of each part
              (absent from older checkpoints: every part of version 1)
     "files": {"params.safetensors": {"sha256", "bytes"}, "state.safetensors": {...}},
     "manifest_sha256": "<sha256 of this object without this field, sorted, compact>"}

Guarantees: a checkpoint directory exists under its final name only once every file in it is
written and fsynced (written under a ``.tmp-`` name, renamed, the directory fsynced), so a crash
mid-write never leaves something that counts as a checkpoint. A file whose size or sha256
differs from the manifest, a missing or damaged manifest, is refused with :class:`CheckpointError`
(naming the file and what was wrong); :func:`load_latest` logs it and takes the previous one.

Not saved, by design: held pulls (they name connections that die with the process; the workers'
waits time out and they pull again), admission records and Prometheus metrics (diagnostics),
scratch and spare buffers, and when each worker was last seen (the old process's monotonic time:
restored workers count as seen at the restore and have ``heartbeat_timeout_s`` to speak).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bitps import __version__
from bitps.proto import bitps_pb2 as pb
from bitps.proto.state import join_state, split_state
from bitps.proto.wire import PROTOCOL, PSError
from bitps.ps.checkpoint_files import (  # the files: re-exported, part of this module's API
    FORMAT,
    FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    Snapshot,
    checkpoints,
    load,
    load_latest,
    prune,
    write,
)
from bitps.ps.checkpoint_files import _digest as _digest  # a manifest's sha256, re-exported
from bitps.ps.clocks import WorkerClock

if TYPE_CHECKING:
    from bitps.ps.config import ServerConfig
    from bitps.ps.shard import ShardCore
    from bitps.ps.store import Slot

__all__ = ["Checkpoint", "CheckpointError", "Checkpointer", "Snapshot", "checkpoints", "load",
           "load_latest", "prune", "restore", "save", "snapshot", "write"]

log = logging.getLogger("bitps.checkpoint")

_MUST_MATCH = ("shard_id", "num_shards", "mode", "lookahead", "optimizer")
"""Config a checkpoint is only valid under: which keys, the state's layout and its arithmetic.
``staleness``, ``split_lr``, ``staleness_damping`` and ``compensation`` are recorded but may
change at a restart (the continuation is then bit for bit only where they are equal; a
compensation's own state, such as DC-ASGD's read copies, starts afresh)."""


# -- taking the state ---------------------------------------------------------------------------
def _config(cfg: ServerConfig) -> dict:
    # through JSON so that a saved config and the live one compare as the same types
    return json.loads(json.dumps({
        "shard_id": cfg.shard_id, "num_shards": cfg.num_shards, "mode": cfg.mode,
        "lookahead": cfg.lookahead, "optimizer": dataclasses.asdict(cfg.optimizer),
        "staleness": cfg.staleness, "split_lr": cfg.split_lr,
        "staleness_damping": cfg.staleness_damping, "compensation": cfg.compensation}))


def _spec_dict(spec: pb.KeySpec) -> dict:
    return {"key": spec.key, "name": spec.name, "offset": spec.offset, "length": spec.length,
            "compressed_pull": spec.compressed_pull,
            "shape": list(spec.shape.dims) if spec.HasField("shape") else None}


def _key_state(key: int, slot: Slot, codes: dict | None, params: dict, state: dict,
               layouts: dict) -> dict:
    """Copy one key's arrays into ``params`` and ``state`` (its rule state's and its codes'
    state dicts laid out by name, their versions into ``layouts``); returns its manifest
    entry."""
    params[str(key)] = slot.param.copy()
    rule = dict(slot.rule_state.state_dict())
    if not isinstance(rule.get("version"), int):
        raise ValueError(f"key {key}: {type(slot.rule_state).__name__}.state_dict() has "
                         f"version {rule.get('version')!r}; expected an int (proto.state)")
    layouts["rule"] = rule.pop("version")
    # any rule's state: its arrays go to the tensor file, the rest (a plug-in's counters,
    # nested versions) to the manifest
    arrays, values = split_state(rule)
    for name, arr in arrays.items():
        state[f"{key}/rule/{name}"] = arr
    if slot.previous is not None:
        state[f"{key}/last_delta"] = slot.last_delta
    total, held = slot.step_values()  # copies, codes decoded
    if total is not None:
        state[f"{key}/acc"] = total
    for rank, grad in held.items():
        state[f"{key}/held/{rank}"] = grad
    history = []
    if codes is not None:
        layouts["codec"] = codes["version"]
        state[f"{key}/residual"] = codes["residual"]
        history = codes["history"]
    codec = {} if codes is None else {"published_codec": codes["codec"]}
    if history:
        state[f"{key}/history"] = np.frombuffer(b"".join(p for _, p in history),
                                                np.uint8).copy()
    entry = {"version": slot.version, "pushed": sorted(slot.pushed), "folded": slot.folded,
             "history": [[v, len(p)] for v, p in history], "pushers": sorted(slot.pushers),
             "initialized": slot.initialized, **codec}
    if values:  # the built-in rules' state is all arrays: their manifests are as before
        entry["rule"] = values
    return entry


def snapshot(core: ShardCore) -> Snapshot:
    """Copy ``core``'s whole state, under ``core.lock`` (a pass over every array: the data loop
    waits that long, not for the disk). Raises ``ValueError`` when no worker has registered
    yet: a shard without keys has nothing to restore."""
    with core.lock:
        if not core.slots:
            raise ValueError(f"shard {core.cfg.shard_id} holds no keys yet (no worker has "
                             f"registered): nothing to checkpoint")
        params, state = {}, {}
        codecs, dedup = core.codecs.state_dict(), core.dedup.state_dict()
        layouts = {"codecs": codecs["version"], "dedup": dedup["version"]}
        keys = {str(key): _key_state(key, slot, codecs["keys"].get(key), params, state,
                                     layouts)
                for key, slot in sorted(core.slots.items())}
        clocks = core.clocks
        codec = core.pull_codec
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "created_unix": time.time(),
            "bitps_version": __version__, "config": _config(core.cfg),
            "plan": {"signature": core.signature, "model_keys": core.model_keys,
                     "pull_codec": None if codec is None else list(codec.wire_fields()),
                     "keys": [_spec_dict(s.spec) for _, s in sorted(core.slots.items())]},
            "core": {"updates_applied": core.updates_applied,
                     "initialized": core.initialized.is_set(),
                     # a Leave not yet applied by a tick (ShardCore.leave)
                     "membership_changed": core._membership_changed},
            "clocks": {"world_size": clocks.world_size, "workers": [
                {"rank": w.rank, "clock": w.clock, "registered": w.registered, "left": w.left,
                 "dropped": w.dropped} for _, w in sorted(clocks.workers.items())]},
            "keys": keys,
            # the exactly-once window: a push applied before this checkpoint and replayed
            # after a restart is answered, not applied again
            "dedup": {str(w): [list(pid) for pid in ids]
                      for w, ids in sorted(dedup["ids"].items())},
            # the state-dict versions of the parts (proto.state): absent from older
            # checkpoints, whose parts are all of version 1
            "layouts": layouts,
        }
    return Snapshot(manifest, params, state)


def save(core: ShardCore, directory: str | os.PathLike, *, keep: int) -> Path:
    """Checkpoint ``core`` into ``directory`` (:func:`snapshot` under its lock, then
    :func:`write` without it) and keep the newest ``keep``. Returns the new checkpoint's path.

        >>> path = save(core, "ckpt/shard0", keep=3)            # doctest: +SKIP
    """
    return write(snapshot(core), directory, keep=keep)


# -- restoring ----------------------------------------------------------------------------------
def _saved_optimizer(core: ShardCore, saved: dict) -> dict:
    """A saved optimizer config in today's layout. Checkpoints written before rules had config
    sections of their own (no ``rule_config``) kept every rule's settings at the top level under
    their flag names (``onebit_chunk``): the running rule's become its section, the others'
    are dropped."""
    if "rule_config" in saved:
        return saved
    rule = type(core.rule)
    fields = {s.dest: s.field for s in rule.settings}
    out = {k: v for k, v in saved.items() if k not in fields}
    out = {k: v for k, v in out.items() if k in _config(core.cfg)["optimizer"]}
    out["rule_config"] = None if rule.config is None else {
        fields[k]: v for k, v in saved.items() if k in fields}
    return out


def _defaults(config: type | None, leave: tuple[str, ...]) -> dict:
    """The defaults of a rule config's fields, but ``leave``, as a saved config holds them."""
    if config is None:
        return {}
    return json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(config)
                                  if f.default is not dataclasses.MISSING
                                  and f.name not in leave}))


def _check_config(core: ShardCore, ckpt: Checkpoint) -> None:
    saved, live = dict(ckpt.manifest["config"]), _config(core.cfg)
    if isinstance(saved.get("optimizer"), dict):
        saved["optimizer"] = _saved_optimizer(core, saved["optimizer"])
        # the rule's settings a restore makes the state fit (RuleConfig.restart_free)
        free = getattr(core.rule.config, "restart_free", ())
        for opt in (saved["optimizer"], live["optimizer"]):
            if isinstance(opt.get("rule_config"), dict):
                opt["rule_config"] = {k: v for k, v in opt["rule_config"].items()
                                      if k not in free}
        if isinstance(saved["optimizer"].get("rule_config"), dict):
            # a field the checkpoint predates reads as its default: a rule's new field
            # defaults to the behaviour from before it (RuleConfig)
            saved["optimizer"]["rule_config"] = {
                **_defaults(core.rule.config, free), **saved["optimizer"]["rule_config"]}
    for name in _MUST_MATCH:
        if saved.get(name) != live[name]:
            raise CheckpointError(ckpt.path, f"was saved with {name} {saved.get(name)!r}; this "
                                  f"shard runs {name} {live[name]!r}")


def _plan_slots(core: ShardCore, ckpt: Checkpoint) -> None:
    """Give ``core`` the checkpoint's keys: a fresh core replays the registration that made
    them (the same validation, slots, publishers and pull codec); a registered one must hold
    the same plan."""
    plan, path = ckpt.manifest["plan"], ckpt.path
    specs = [pb.KeySpec(key=d["key"], name=d["name"], offset=d["offset"], length=d["length"],
                        dtype=pb.FLOAT32, compressed_pull=d["compressed_pull"],
                        shape=None if d["shape"] is None else pb.TensorShape(dims=d["shape"]))
             for d in plan["keys"]]
    if core.slots:
        # shapes aside: a worker that predates KeySpec.shape registers none
        held = {k: _spec_dict(s.spec) | {"shape": None} for k, s in core.slots.items()}
        want = {s.key: _spec_dict(s) | {"shape": None} for s in specs}
        if core.signature != plan["signature"] or held != want:
            raise CheckpointError(path, f"key plan {plan['signature']!r} of {len(specs)} keys; "
                                  f"this shard holds {core.signature!r} of {len(core.slots)}")
        return
    cfg = core.cfg
    req = pb.RegisterRequest(protocol=PROTOCOL, rank=0,
                             world_size=max(ckpt.manifest["clocks"]["world_size"], 1),
                             signature=plan["signature"], model_keys=plan.get("model_keys", 0),
                             num_shards=cfg.num_shards,
                             shard_id=cfg.shard_id, keys=specs, token=cfg.token)
    if plan["pull_codec"] is not None:
        req.pull_codec, req.pull_codec_chunk, req.pull_codec_flags = plan["pull_codec"]
    try:
        core.register(req, {})
    except PSError as err:
        raise CheckpointError(path, f"the shard refuses its key plan: {err.message}") from None


def _array(ckpt: Checkpoint, arrays: dict, name: str, shape: tuple, dtype) -> np.ndarray:
    arr = arrays.get(name)
    if arr is None or arr.shape != shape or arr.dtype != dtype:
        found = None if arr is None else f"{arr.dtype}{list(arr.shape)}"
        raise CheckpointError(ckpt.path, f"array {name!r} is {found}; expected "
                              f"{np.dtype(dtype)}{list(shape)}")
    return arr


def _restore_key(core: ShardCore, ckpt: Checkpoint, key: int) -> None:
    slot, st, m = core.slots[key], ckpt.state, ckpt.manifest
    info, n, f32 = m["keys"][str(key)], core.slots[key].length, np.float32
    slot.set_values(_array(ckpt, ckpt.params, str(key), (n,), f32).tobytes())
    slot.version = info["version"]
    # older checkpoints: whole plans, every registered rank pushes every key
    slot.pushers = set(info.get("pushers", [w["rank"] for w in m["clocks"]["workers"]
                                            if w["registered"]]))
    slot.initialized = bool(info.get("initialized", m["core"]["initialized"]))
    prefix = f"{key}/rule/"
    rule = join_state({k[len(prefix):]: v for k, v in st.items() if k.startswith(prefix)},
                      info.get("rule", {}))
    try:
        slot.rule_state.load_state_dict({"version": _layout(ckpt, "rule"), **rule})
    except PSError as err:
        raise CheckpointError(ckpt.path, f"key {key}: {err.message}") from None
    except (ValueError, TypeError, KeyError) as err:  # a plug-in's own refusal
        raise CheckpointError(ckpt.path, f"key {key}: {type(slot.rule_state).__name__} "
                              f"refused the saved state: {type(err).__name__}: {err}") from None
    if slot.previous is not None:
        slot.restore_delta(_array(ckpt, st, f"{key}/last_delta", (n,), f32))
    slot.folded, slot.pushed = info["folded"], set(info["pushed"])
    if slot.folded:
        slot.acc, slot.first = _array(ckpt, st, f"{key}/acc", (n,), f32).copy(), None
    held = f"{key}/held/"
    slot.held = {int(k[len(held):]): _array(ckpt, st, k, (n,), f32).copy() for k in st
                 if k.startswith(held)}


def _layout(ckpt: Checkpoint, part: str) -> int:
    """The state-dict version a part was saved in (1 in checkpoints that predate them)."""
    return ckpt.manifest.get("layouts", {}).get(part, 1)


def _codes(ckpt: Checkpoint, key: int, n: int) -> dict:
    """One key's published-codes state dict (``Publisher.state_dict``), from its residual,
    its concatenated history and the history's sizes in the manifest."""
    st, info = ckpt.state, ckpt.manifest["keys"][str(key)]
    sizes = [size for _, size in info["history"]]
    payloads = _array(ckpt, st, f"{key}/history", (sum(sizes),), np.uint8).tobytes() \
        if sizes else b""
    starts = np.cumsum([0, *sizes])
    codec = {"codec": info["published_codec"]} if "published_codec" in info else {}
    return {"version": _layout(ckpt, "codec"), **codec,
            "residual": _array(ckpt, st, f"{key}/residual", (n,), np.float32),
            "history": [[version, payloads[a:b]] for (version, _), a, b
                        in zip(info["history"], starts[:-1], starts[1:])]}


def restore(core: ShardCore, ckpt: Checkpoint) -> None:
    """Put ``ckpt`` into ``core``, which then continues bit for bit as the checkpointed shard
    would have: parameters, versions, rule state, published codes and residuals, the current
    sync step's pushes, clocks, the exactly-once window. ``core`` should be fresh (no worker
    registered: the checkpoint's registration is replayed) or hold the same key plan.

    Raises :class:`CheckpointError` for a checkpoint of another shard id, shard count, mode,
    lookahead, optimizer config or key plan (``core`` unchanged), or whose arrays do not fit
    (then ``core`` is partly restored: discard it)."""
    _check_config(core, ckpt)
    m = ckpt.manifest
    if set(m["keys"]) != {str(d["key"]) for d in m["plan"]["keys"]}:
        raise CheckpointError(ckpt.path, f"per-key state for {len(m['keys'])} keys; its plan "
                              f"has {len(m['plan']['keys'])}")
    with core.lock:
        _plan_slots(core, ckpt)
        for key in sorted(core.slots):
            _restore_key(core, ckpt, key)
        try:
            core.codecs.load_state_dict({"version": _layout(ckpt, "codecs"), "keys": {
                k: _codes(ckpt, k, s.length) for k, s in core.slots.items()
                if s.publisher is not None}})
        except PSError as err:
            raise CheckpointError(ckpt.path, err.message) from None
        core.updates_applied = m["core"]["updates_applied"]
        # a Leave the old process had not yet applied: the next tick applies it here
        core._membership_changed = m["core"]["membership_changed"]
        core._changed_ranks = None if core._membership_changed else set()  # whose: unknown
        t = core.now()
        core.clocks.workers = {w["rank"]: WorkerClock(
            rank=w["rank"], clock=w["clock"], last_seen=t, registered=w["registered"],
            left=w["left"], dropped=w["dropped"]) for w in m["clocks"]["workers"]}
        core.clocks.world_size = m["clocks"]["world_size"]
        core.model_keys = m["plan"].get("model_keys", 0)
        core._check_partial()
        core.check_initialized()
        # absent from checkpoints written before the window was saved: an empty window
        core.dedup.load_state_dict({"version": _layout(ckpt, "dedup"), "ids": {
            int(w): [tuple(pid) for pid in ids] for w, ids in m.get("dedup", {}).items()}})


# -- what a server drives -----------------------------------------------------------------------
class Checkpointer:
    """Periodic checkpoints of one shard into ``directory``, the newest ``keep`` kept: a save is
    due once ``every_updates`` key updates were applied since the last one, or ``every_s``
    seconds passed with at least one update (0 turns a trigger off).

    How a server uses it (``ps.server`` does so with ``--checkpoint-dir``)::

        ckpt = Checkpointer(core, directory, keep=3, every_updates=10_000, every_s=300)
        ckpt.restore_latest()      # at start, before the data loop and gRPC serve
        ...                        # data loop thread: after each core.handle() / core.tick()
        ckpt.maybe_save()          # cheap when not due
        ...                        # SIGTERM: stop gRPC and the data loop (no more updates), then
        ckpt.save_final()          # the final checkpoint, synchronously, unless nothing changed
        ckpt.close()

    Locking: a save copies the state under ``core.lock`` (the RLock the data loop holds in
    ``handle``/``tick`` and gRPC threads in ``register``/``leave``), so any thread may call
    these, holding the lock or not; the disk write happens without it. With ``background``
    the write runs on a thread of its own, one at a time (a save falling due meanwhile first
    waits for it), so the data loop usually waits only for the copy. A failed background
    write is logged and kept in :attr:`error`; the next save tries again. One Checkpointer per
    directory."""

    def __init__(self, core: ShardCore, directory: str | os.PathLike, *, keep: int = 3,
                 every_updates: int = 0, every_s: float = 0.0, background: bool = True,
                 now: Callable[[], float] = time.monotonic) -> None:
        if keep < 1 or every_updates < 0 or every_s < 0:
            raise ValueError(f"keep must be >= 1 and every_updates, every_s >= 0; got keep "
                             f"{keep}, every_updates {every_updates}, every_s {every_s}")
        self.core, self.directory, self.keep = core, Path(directory), keep
        self.every_updates, self.every_s, self.background = every_updates, every_s, background
        self.now = now
        self.last_path: Path | None = None
        self.error: BaseException | None = None
        self._saved_updates = core.updates_applied
        self._saved_at = now()
        self._saved_revision: tuple[int, int] | None = None
        """``core.revision`` when the newest checkpoint's copy was taken (or restored)."""
        self._writer: threading.Thread | None = None

    def restore_latest(self) -> Checkpoint | None:
        """Restore the newest valid checkpoint into the (fresh) core; ``None`` when the
        directory holds none. Raises :class:`CheckpointError` as :func:`load_latest` and
        :func:`restore` do."""
        ckpt = load_latest(self.directory)
        if ckpt is not None:
            restore(self.core, ckpt)
            self._saved_updates, self._saved_at, self.last_path = ckpt.updates, self.now(), \
                ckpt.path
            self._saved_revision = self.core.revision
            log.info("restored %s (%d updates applied)", ckpt.path, ckpt.updates)
        return ckpt

    def due(self) -> bool:
        """Whether :meth:`maybe_save` would save now."""
        # an int read without the lock: at worst one call late
        done = self.core.updates_applied - self._saved_updates
        if done <= 0 or not self.core.slots:
            return False
        return (self.every_updates > 0 and done >= self.every_updates) or \
            (self.every_s > 0 and self.now() - self._saved_at >= self.every_s)

    def maybe_save(self) -> Path | None:
        """Save when :meth:`due`; returns the new checkpoint's path when written here
        (``None`` when not due or written in the background). A save due while the previous
        background write still runs waits for it first, so snapshots are taken exactly when
        due: a kill loses fewer than ``every_updates`` updates once the newest write is
        done, fewer than twice that while one is being written."""
        if not self.due():
            return None
        # backpressure, not a skipped save: a skipped one would let the loss grow unbounded
        # on a disk slower than the interval
        self.close()
        snap = self._snapshot()
        if not self.background:
            return self._write(snap)
        self._writer = threading.Thread(target=self._write_logged, args=(snap,),
                                        name="bitps-checkpoint", daemon=True)
        self._writer.start()
        return None

    def save_now(self) -> Path:
        """Save at once and wait for it (after any background write); raises what the write
        raises."""
        self.close()
        return self._write(self._snapshot())

    def save_final(self) -> Path | None:
        """The final checkpoint (:meth:`save_now`), unless the newest one already holds this
        state (nothing changed since its copy was taken, and it was written): then ``None``,
        so that a stop after a periodic save does not fill one of the ``keep`` places with a
        copy of it."""
        self.close()
        if (self.last_path is not None and self.error is None
                and self._saved_revision == self.core.revision):
            return None
        return self._write(self._snapshot())

    def close(self) -> None:
        """Wait for a background write to finish."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _snapshot(self) -> Snapshot:
        # read before the copy: a change made meanwhile makes the next final save write again
        self._saved_revision = self.core.revision
        snap = snapshot(self.core)
        self._saved_updates, self._saved_at = snap.updates, self.now()
        return snap

    def _write(self, snap: Snapshot) -> Path:
        self.last_path = write(snap, self.directory, keep=self.keep)
        self.error = None
        log.info("checkpoint %s (%d updates applied)", self.last_path, snap.updates)
        return self.last_path

    def _write_logged(self, snap: Snapshot) -> None:
        try:
            self._write(snap)
        except Exception as err:  # a full disk must not kill the shard; the next save retries
            self.error = err
            # due again at the next maybe_save
            self._saved_updates, self._saved_at, self._saved_revision = -1, float("-inf"), None
            log.error("checkpoint into %s failed: %s", self.directory, err)
