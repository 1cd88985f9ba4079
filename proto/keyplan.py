"""The key plan: how a model's parameters become keys and keys land on shards.

Each parameter tensor is flattened and cut into near-equal partitions of at most
``partition_bytes``; each partition is a *key*. The default is 1 MiB, not BytePS's 4 MB: on this
transport, push+pull of one tensor was fastest with 1 MiB keys at every size measured (1 MiB as
one key 0.69 ms vs as four 1.02 ms; 2 MiB as two keys 1.8 ms vs as one 2.0 ms; 64 MiB 52 ms vs
58 ms with 4 MiB keys). Keys go to shards by greedy size balancing (largest first onto the
least-loaded shard; ties by key id, then shard id). The plan is a pure function of the
``(name, shape, dtype)`` list and the two settings, so every worker computes the same plan
without a coordinator, and its :attr:`KeyPlan.signature` lets a shard refuse a worker whose
model differs.

A pipeline stage registers a *partial plan*: :meth:`KeyPlan.subset` of the whole model's plan,
the keys of the stage's parameters only, with the whole model's key ids, shards, partitioning
and signature, so every stage agrees on them and a shard still refuses another model.

    >>> plan = make_plan([ParamSpec("w", (1024, 1024))], num_shards=2, partition_bytes=1 << 20)
    >>> [k.length for k in plan.keys]       # 4 MiB in four 1 MiB keys, two per shard
    [262144, 262144, 262144, 262144]
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_PARTITION_BYTES", "DIGEST_BYTES", "Key", "KeyPlan", "ParamSpec",
           "PlanMismatchError", "UnknownParametersError", "make_plan", "value_digest"]

DEFAULT_PARTITION_BYTES = 1 << 20
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class UnknownParametersError(ValueError):
    """Parameter names a plan does not have: ``names`` (sorted), of a plan of ``known``
    parameters."""

    def __init__(self, names, known: int) -> None:
        self.names, self.known = sorted(names), known
        shown = self.names[:8] + (["..."] if len(self.names) > 8 else [])
        super().__init__(f"parameters {shown} are not in the model's plan ({known} parameters); "
                         f"expected names from the plan's parameter list")


class PlanMismatchError(ValueError):
    """A parameter whose shape or dtype differs from the plan's: ``name``, ``got`` and
    ``expected`` (``(shape, dtype)`` each)."""

    def __init__(self, name: str, got: tuple, expected: tuple) -> None:
        self.name, self.got, self.expected = name, got, expected
        super().__init__(f"parameter {name!r} is {got[1]}{list(got[0])}; the model's plan has "
                         f"{expected[1]}{list(expected[0])}")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name, shape and element type (``"float32"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Key:
    """A partition: elements ``[offset, offset + length)`` of the flattened tensor ``name``,
    whose shape is ``shape`` (registration sends it, so a shard checkpoint can be exported as
    the original tensors)."""

    key: int
    name: str
    offset: int
    length: int
    shard: int
    dtype: str = "float32"
    shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.length * _ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class KeyPlan:
    """The keys of a model, in parameter order, with their shards: every key (:func:`make_plan`)
    or those of some parameters (:meth:`subset`: a partial plan). ``keys`` are in key-id order;
    look one up by id with :meth:`key`, not by position (a partial plan's ids have gaps)."""

    keys: tuple[Key, ...]
    num_shards: int
    partition_bytes: int
    signature: str
    params: tuple[ParamSpec, ...] = ()
    """The whole model's parameters, as planned (the signature is theirs)."""
    model_keys: int = -1
    """Keys of the whole model's plan (-1: ``len(keys)``, a whole plan)."""

    def __post_init__(self) -> None:
        if self.model_keys < 0:
            object.__setattr__(self, "model_keys", len(self.keys))

    @functools.cached_property
    def _by_id(self) -> dict[int, Key]:
        return {k.key: k for k in self.keys}

    @property
    def partial(self) -> bool:
        """Whether this plan holds only some of the model's keys."""
        return len(self.keys) < self.model_keys

    def key(self, key: int) -> Key:
        """The key with id ``key``; ``KeyError`` naming it when this plan does not hold it."""
        try:
            return self._by_id[key]
        except KeyError:
            raise KeyError(f"key {key} is not in this plan ({len(self.keys)} of the model's "
                           f"{self.model_keys} keys)") from None

    def __contains__(self, key: int) -> bool:
        return key in self._by_id

    def subset(self, names: Iterable[str]) -> KeyPlan:
        """The keys of the parameters ``names`` (a pipeline stage's), keeping this plan's key
        ids, shards, partitioning and signature, in key order. Names this plan does not plan
        raise :class:`UnknownParametersError` naming them."""
        wanted = set(names)
        known = {p.name for p in self.params} if self.params else {k.name for k in self.keys}
        if unknown := wanted - known:
            raise UnknownParametersError(unknown, len(known))
        return dataclasses.replace(self, keys=tuple(k for k in self.keys if k.name in wanted))

    def bind(self, params: Sequence[ParamSpec]) -> KeyPlan:
        """:meth:`subset` of ``params``' names once their shapes and dtypes are the plan's
        (:class:`PlanMismatchError` names the first that is not): what ``PSModel`` registers
        for a stage's parameters."""
        planned = {p.name: p for p in self.params}
        plan = self.subset(p.name for p in params)
        for p in params:
            want = planned.get(p.name)
            if want is None:  # a plan without its parameter list: the keys' shapes
                k = next((k for k in plan.keys if k.name == p.name), None)
                want = None if k is None else ParamSpec(k.name, k.shape, k.dtype)
            if want is not None and (tuple(p.shape), p.dtype) != (tuple(want.shape),
                                                                  want.dtype):
                raise PlanMismatchError(p.name, (tuple(p.shape), p.dtype),
                                        (tuple(want.shape), want.dtype))
        return plan

    def for_shard(self, shard: int) -> tuple[Key, ...]:
        """The keys shard ``shard`` holds, in key order."""
        return tuple(k for k in self.keys if k.shard == shard)

    def shard_bytes(self) -> list[int]:
        """Bytes held by each shard."""
        loads = [0] * self.num_shards
        for k in self.keys:
            loads[k.shard] += k.nbytes
        return loads

    def imbalance(self) -> float:
        """max / mean shard load in bytes (1.0 = perfect balance)."""
        loads = self.shard_bytes()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0


DIGEST_BYTES = 16


def value_digest(values) -> bytes:
    """BLAKE2b-128 of one key's values as the shard stores them (float32, C order): what a
    worker sends at registration so that a copy it already holds need not be pulled."""
    return hashlib.blake2b(memoryview(values).cast("B"), digest_size=DIGEST_BYTES).digest()


def _signature(params: Sequence[ParamSpec], num_shards: int, partition_bytes: int) -> str:
    desc = {
        "params": [[p.name, list(p.shape), p.dtype] for p in params],
        "num_shards": num_shards,
        "partition_bytes": partition_bytes,
    }
    return hashlib.sha256(json.dumps(desc, separators=(",", ":")).encode()).hexdigest()[:32]


def make_plan(
    params: Sequence[ParamSpec], *, num_shards: int, partition_bytes: int = DEFAULT_PARTITION_BYTES
) -> KeyPlan:
    """Cut ``params`` into keys and balance them over ``num_shards`` shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if partition_bytes < 1024:
        raise ValueError(f"partition_bytes must be >= 1024, got {partition_bytes}")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    pieces: list[tuple[str, int, int, str, tuple[int, ...]]] = []
    for p in params:
        if p.dtype not in _ITEMSIZE:
            raise ValueError(f"parameter {p.name!r} has dtype {p.dtype!r}; expected one of "
                             f"{sorted(_ITEMSIZE)}")
        n = p.numel
        if n == 0:
            continue
        parts = max(1, math.ceil(n * _ITEMSIZE[p.dtype] / partition_bytes))
        base, extra = divmod(n, parts)
        offset = 0
        for i in range(parts):
            length = base + (1 if i < extra else 0)
            pieces.append((p.name, offset, length, p.dtype, tuple(p.shape)))
            offset += length
    order = sorted(range(len(pieces)), key=lambda i: (-pieces[i][2] * _ITEMSIZE[pieces[i][3]], i))
    heap = [(0, s) for s in range(num_shards)]
    shard_of = [0] * len(pieces)
    for i in order:
        load, s = heapq.heappop(heap)
        shard_of[i] = s
        heapq.heappush(heap, (load + pieces[i][2] * _ITEMSIZE[pieces[i][3]], s))
    keys = tuple(
        Key(key=i, name=name, offset=off, length=length, shard=shard_of[i], dtype=dt,
            shape=shape)
        for i, (name, off, length, dt, shape) in enumerate(pieces)
    )
    return KeyPlan(keys=keys, num_shards=num_shards, partition_bytes=partition_bytes,
                   signature=_signature(params, num_shards, partition_bytes),
                   params=tuple(ParamSpec(p.name, tuple(p.shape), p.dtype) for p in params))
