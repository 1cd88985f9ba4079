"""The shard checkpoint's files: one checkpoint directory written atomically, listed, pruned,
read back and verified (``ps.checkpoint`` takes and restores the state, and documents the
layout; this module moves it to and from disk, with no torch and no pickle).

A checkpoint directory exists under its final name only once every file in it is written and
fsynced (written under a ``.tmp-`` name, renamed, the directory fsynced), so a crash mid-write
never leaves something that counts as a checkpoint. A file whose size or sha256 differs from
the manifest, a missing or damaged manifest, is refused with :class:`CheckpointError` (naming
the file and what was wrong); :func:`load_latest` logs it and takes the previous one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "PARAMS", "STATE", "Checkpoint",
           "CheckpointError", "Snapshot", "checkpoints", "load", "load_latest", "prune", "write"]

log = logging.getLogger("bitps.checkpoint")

FORMAT, FORMAT_VERSION = "bitps-shard-checkpoint", 1
MANIFEST, PARAMS, STATE = "manifest.json", "params.safetensors", "state.safetensors"
_NAME = re.compile(r"^ckpt-(\d{12})-(\d{19})$")
_TMP = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: ``path`` names the file or directory, ``problem`` what
    was wrong (with the value found and what was expected)."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(f"checkpoint {self.path}: {problem}")


@dataclass(frozen=True)
class Snapshot:
    """A shard's state copied out under its lock, ready to be written without it."""

    manifest: dict
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]

    @property
    def updates(self) -> int:
        return int(self.manifest["core"]["updates_applied"])


@dataclass(frozen=True)
class Checkpoint(Snapshot):
    """One verified checkpoint read back: a snapshot and the directory it was read from (see
    the module docstring for the names)."""

    path: Path


# -- writing ------------------------------------------------------------------------------------
def _digest(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def _file_sha256(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(snap: Snapshot, directory: str | os.PathLike, *, keep: int) -> Path:
    """Write ``snap`` as a new checkpoint in ``directory`` (created if needed), atomically, then
    keep the newest ``keep`` checkpoints (:func:`prune`). Returns the checkpoint's directory.
    One writer per directory: leftovers of an interrupted write are removed first."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 checkpoints, got {keep}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for leftover in directory.glob(f"{_TMP}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    stamp = time.time_ns()
    while (directory / (name := f"ckpt-{snap.updates:012d}-{stamp:019d}")).exists():
        stamp += 1  # two checkpoints within one nanosecond's resolution
    tmp = directory / f"{_TMP}{name}"
    tmp.mkdir()
    files = {}
    for fname, arrays in ((PARAMS, snap.params), (STATE, snap.state)):
        safetensors.numpy.save_file(arrays, str(tmp / fname))
        _fsync(tmp / fname)
        digest, size = _file_sha256(tmp / fname)
        files[fname] = {"sha256": digest, "bytes": size}
    manifest = {**snap.manifest, "files": files}
    manifest["manifest_sha256"] = _digest(manifest)
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    final = directory / name
    os.rename(tmp, final)
    _fsync(directory)
    prune(directory, keep)
    return final



def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoint directories in ``directory``, newest first (by updates applied, then by
    time written); nothing being written or deleted is listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m[1]), int(m[2]), p) for p in directory.iterdir()
             if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for *_, p in sorted(found, reverse=True)]


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; returns those deleted. Each is renamed
    out of the checkpoint names first, so a crash mid-delete leaves no half checkpoint."""
    gone = checkpoints(directory)[keep:]
    for path in gone:
        doomed = path.with_name(f"{_TMP}del-{path.name}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return gone


# -- reading ------------------------------------------------------------------------------------
def _read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(mpath, "no manifest: an incomplete or damaged checkpoint")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(mpath, f"manifest is not readable JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != FORMAT_VERSION:
        found = (manifest.get("format"), manifest.get("version")) \
            if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(mpath, f"format {found}; expected ({FORMAT!r}, {FORMAT_VERSION})")
    recorded = manifest.pop("manifest_sha256", None)
    if recorded != (digest := _digest(manifest)):
        raise CheckpointError(mpath, f"manifest sha256 {digest}; it records {recorded} "
                              f"(edited or corrupt)")
    return manifest


def load(path: str | os.PathLike) -> Checkpoint:
    """Read and verify the checkpoint in ``path``: the manifest's own sha256, then each file's
    size and sha256 against the manifest. Raises :class:`CheckpointError` naming the file and
    what was wrong (missing, truncated, corrupt, not safetensors)."""
    path = Path(path)
    manifest = _read_manifest(path)
    arrays = {}
    for fname in (PARAMS, STATE):
        fpath, entry = path / fname, manifest.get("files", {}).get(fname)
        if entry is None:
            raise CheckpointError(path / MANIFEST, f"records no {fname}")
        if not fpath.is_file():
            raise CheckpointError(fpath, "missing")
        digest, size = _file_sha256(fpath)
        if size != entry["bytes"]:
            raise CheckpointError(fpath, f"{size} bytes; the manifest records "
                                  f"{entry['bytes']} (truncated)")
        if digest != entry["sha256"]:
            raise CheckpointError(fpath, f"sha256 {digest}; the manifest records "
                                  f"{entry['sha256']} (corrupt)")
        try:
            arrays[fname] = safetensors.numpy.load_file(str(fpath))
        except Exception as err:  # safetensors raises its own SafetensorError
            raise CheckpointError(fpath, f"not a safetensors file ({err})") from None
    return Checkpoint(manifest=manifest, params=arrays[PARAMS], state=arrays[STATE], path=path)


def load_latest(directory: str | os.PathLike) -> Checkpoint | None:
    """The newest valid checkpoint in ``directory``; ``None`` when it holds none at all. An
    invalid one is logged and skipped for the one before; when every one is invalid, raises
    :class:`CheckpointError` listing why (starting afresh would silently lose the training)."""
    problems = []
    for path in checkpoints(directory):
        try:
            return load(path)
        except CheckpointError as err:
            log.warning("skipping %s", err)
            problems.append(str(err))
    if problems:
        raise CheckpointError(directory, f"no valid checkpoint among {len(problems)}: "
                              + "; ".join(problems))
    return None
