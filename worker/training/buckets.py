"""Buckets: the units ``PSModel`` pushes from backward hooks when overlap is on.

A bucket is one or more whole parameters and every key (``proto.keyplan``) cut from them.
Parameters are grouped in reverse registration order, the order backward usually produces their
gradients, so a bucket's gradients become ready close together; a bucket is pushed as soon as
all of them are. ``priority`` is the smallest registration index in the bucket: the next forward
needs low priorities first, so the communication thread sends those first when several wait.

    buckets = make_buckets(plan, names=["embed.weight", "fc.weight"], bucket_bytes=1 << 20)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bitps.proto.keyplan import KeyPlan

__all__ = ["Bucket", "make_buckets"]


@dataclass(frozen=True)
class Bucket:
    """Parameters (by registration index) pushed and pulled together."""

    index: int
    """Position in the list :func:`make_buckets` returns (backward order)."""
    params: tuple[int, ...]
    """Registration indices of the parameters in the bucket."""
    keys: tuple[int, ...]
    """Plan keys of those parameters, in plan order."""
    nbytes: int
    """Float32 bytes of the bucket's gradients."""

    @property
    def priority(self) -> int:
        """Lower goes first: the next forward needs the earliest-registered parameters first."""
        return min(self.params)


def make_buckets(plan: KeyPlan, names: Sequence[str], bucket_bytes: int) -> list[Bucket]:
    """Group the parameters ``names`` (registration order, as planned in ``plan``) from the last
    to the first into buckets, closing a bucket once it holds ``bucket_bytes`` float32 bytes or
    more (DDP's rule: a layer's bias rides with its weight rather than alone). Deterministic:
    every rank gets the same buckets."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    keys_of: dict[str, list[int]] = {n: [] for n in names}
    nbytes_of = dict.fromkeys(names, 0)
    for k in plan.keys:
        if k.name not in keys_of:
            raise ValueError(f"plan key {k.key} names parameter {k.name!r}, not in names")
        keys_of[k.name].append(k.key)
        nbytes_of[k.name] += k.nbytes
    groups: list[list[int]] = []
    size = bucket_bytes  # "full": the first parameter opens a bucket
    for i in reversed(range(len(names))):
        if size >= bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes_of[names[i]]
    return [Bucket(index=b, params=tuple(sorted(g)),
                   keys=tuple(sorted(k for i in g for k in keys_of[names[i]])),
                   nbytes=sum(nbytes_of[names[i]] for i in g))
            for b, g in enumerate(groups)]
