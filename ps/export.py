"""``bitps-export``: the model a set of shard checkpoints holds, as one safetensors state dict.

    bitps-export --checkpoint-dir ckpt/shard0 ckpt/shard1 --out model.safetensors

reads the newest valid checkpoint in each shard's directory (``ps.checkpoint.load_latest``),
checks that together they are every shard of one key plan, rebuilds each parameter from its keys
(the plan's names, offsets and lengths, and the tensor's shape as registration sent it) and
writes float32 tensors under the parameters' names, which torch loads as they are::

    import safetensors.torch
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

Only trainable parameters live on the shards: a model that also keeps persistent buffers loads
with ``strict=False``. No torch here; the file is plain safetensors.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence

import numpy as np
import safetensors.numpy

from bitps.ps.checkpoint import Checkpoint, CheckpointError, load_latest

__all__ = ["assemble", "export", "main"]

log = logging.getLogger("bitps.export")


def _check_cover(ckpts: Sequence[Checkpoint]) -> None:
    """One checkpoint per shard of one plan, every shard there."""
    first = ckpts[0].manifest
    signature, num_shards = first["plan"]["signature"], first["config"]["num_shards"]
    seen: dict[int, Checkpoint] = {}
    for c in ckpts:
        cfg, plan = c.manifest["config"], c.manifest["plan"]
        if plan["signature"] != signature or cfg["num_shards"] != num_shards:
            raise CheckpointError(c.path, f"key plan {plan['signature']!r} over "
                                  f"{cfg['num_shards']} shards; {ckpts[0].path} has "
                                  f"{signature!r} over {num_shards}")
        if cfg["shard_id"] in seen:
            raise CheckpointError(c.path, f"is shard {cfg['shard_id']} again (also "
                                  f"{seen[cfg['shard_id']].path}); pass one directory per shard")
        seen[cfg["shard_id"]] = c
    if missing := sorted(set(range(num_shards)) - set(seen)):
        raise CheckpointError(ckpts[0].path, f"the plan has {num_shards} shards; no checkpoint "
                              f"of shard(s) {missing} was given")


def assemble(ckpts: Sequence[Checkpoint]) -> dict[str, np.ndarray]:
    """Every parameter, by name, in its shape, from the checkpoints of all shards of one plan.
    Raises :class:`CheckpointError` when a shard is missing or repeated, the plans differ, a
    key has no shape (its worker predates ``KeySpec.shape``) or the keys do not tile a tensor."""
    if not ckpts:
        raise ValueError("no checkpoints to assemble")
    _check_cover(ckpts)
    parts: dict[str, list] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    versions = []
    for c in ckpts:
        for spec in c.manifest["plan"]["keys"]:
            name, key = spec["name"], spec["key"]
            if spec["shape"] is None:
                raise CheckpointError(c.path, f"key {key} of {name!r} has no tensor shape "
                                      f"(registered by a worker that predates KeySpec.shape)")
            if shapes.setdefault(name, tuple(spec["shape"])) != tuple(spec["shape"]):
                raise CheckpointError(c.path, f"key {key} gives {name!r} shape "
                                      f"{spec['shape']}; another key gives {shapes[name]}")
            parts.setdefault(name, []).append((spec["offset"], spec["length"],
                                               c.params[str(key)]))
            versions.append(c.manifest["keys"][str(key)]["version"])
    out = {}
    for name, pieces in parts.items():
        numel, at = math.prod(shapes[name]), 0
        flat = np.empty(numel, np.float32)
        for offset, length, values in sorted(pieces, key=lambda p: p[0]):
            if offset != at or offset + length > numel:
                raise CheckpointError(ckpts[0].path, f"{name!r} of shape {shapes[name]}: a key "
                                      f"covers [{offset}, {offset + length}); expected one "
                                      f"starting at {at} within {numel} elements")
            flat[offset:offset + length] = values
            at += length
        if at != numel:
            raise CheckpointError(ckpts[0].path, f"{name!r} of shape {shapes[name]}: keys "
                                  f"cover {at} of {numel} elements")
        out[name] = flat.reshape(shapes[name])
    if ckpts[0].manifest["config"]["mode"] == "sync" and min(versions) != max(versions):
        # the shards were saved independently: in sync, equal versions mean one step's model
        log.warning("keys are at versions %d to %d: the shards were checkpointed at different "
                    "steps", min(versions), max(versions))
    return out


def export(directories: Sequence[str | os.PathLike], out: str | os.PathLike
           ) -> dict[str, np.ndarray]:
    """Write the model held by the newest valid checkpoint of each shard directory to ``out``
    (safetensors); returns the tensors. Raises :class:`CheckpointError` as :func:`assemble`
    does, or when a directory holds no checkpoint."""
    ckpts = []
    for d in directories:
        ckpt = load_latest(d)
        if ckpt is None:
            raise CheckpointError(d, "holds no checkpoint")
        ckpts.append(ckpt)
    tensors = assemble(ckpts)
    safetensors.numpy.save_file(tensors, str(out))
    return tensors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bitps-export", description="Write the model held by the newest valid checkpoint "
        "of every shard as one safetensors state dict (float32, the parameters' names and "
        "shapes).")
    parser.add_argument("--checkpoint-dir", nargs="+", required=True, metavar="DIR",
                        help="one checkpoint directory per shard, all shards of the model")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the safetensors file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        tensors = export(args.checkpoint_dir, args.out)
    except CheckpointError as err:
        log.error("%s", err)
        return 1
    print(json.dumps({"event": "exported", "out": str(args.out), "tensors": len(tensors),
                      "elements": sum(t.size for t in tensors.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
