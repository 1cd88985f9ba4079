"""``ActivationPool``: saved activations in one pre-reserved arena, offloaded to host memory under
pressure, through ``torch.autograd.graph.saved_tensors_hooks``.

    pool = ActivationPool(PoolConfig(capacity_bytes=8 << 30), device=device,
                          params=model.parameters())
    with pool.hooks():
        loss = loss_fn(model(x), y)       # pack: activations are copied into the arena
    loss.backward()                       # unpack: copied back out; blocks freed with the graph

**pack(t)** passes ``t`` through untouched (the framework keeps it) when it is a parameter (or
any leaf that requires grad: its owner holds it anyway), on another device than the arena,
smaller than ``min_tensor_bytes``, not strided (sparse), or not contiguous. Otherwise it stores
``t``'s bytes once per storage span (a second save of the same tensor, or of a contiguous view
inside a stored span, shares the entry), allocating a block from the arena's allocator
(``native.buddy`` or ``native.bestfit``). When nothing fits, entries are offloaded to host memory
by the policy (``lru``: least recently used; ``schedule``: needed furthest in the future) until
the block fits; if it never does, ``t`` passes through and the request counts as a *fallback*
(the "OOM" the problem statement counts).

**unpack(handle)** returns a new tensor with the saved values, copied out of the arena or, for an
offloaded entry, from host memory (a *fetch*). Under ``lru`` a fetched entry comes back into the
arena first (an LRU cache keeps what was used last, evicting others to make room); under
``schedule`` it is served from host memory, since a saved tensor is rarely read twice and the
arena is better kept for tensors still to be read. On CPU, where host memory is the arena's
memory, that serves the host copy itself, a tensor viewing it; on CUDA it is copied to the
device. Entries live as long as autograd holds their
handles (``retain_graph`` and double backward work): when the graph drops the last handle, the
block goes back to the allocator, so the arena is empty after every backward.

On CUDA, host buffers are pinned and offload copies run on a side stream: the compute stream
waits on the copy's event before the block is reused, and fetches copy on the compute stream
(non-blocking). On CPU every copy is synchronous. Copies never change values: gradients are
bit-identical with the pool on or off.

Schedule-aware eviction needs to know the micro-batch a tensor belongs to: wrap each micro-batch's
forward in ``pool.microbatch(i)``; micro-batches' backwards are assumed to run oldest first
(1F1B and GPipe), or as :meth:`ActivationPool.set_backward_order` says. A pipeline stage does
both itself: ``StageRuntime(..., pool=pool)`` enters :meth:`ActivationPool.hooks` and
``microbatch(mb)`` around each forward and gives the pool each step's backward order from its
action list, so the schedule policy works with no user code (:meth:`ActivationPool.residency`
shows what it kept).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bitps.native.arena import Allocator
from bitps.native.bestfit import BestFitAllocator
from bitps.native.buddy import BuddyAllocator
from bitps.worker.config import PoolConfig

__all__ = ["ActivationPool", "PoolStats", "make_allocator"]


def make_allocator(cfg: PoolConfig, capacity: int) -> Allocator:
    """The allocator ``cfg`` names, over ``capacity`` bytes."""
    if cfg.allocator == "bestfit":
        return BestFitAllocator(capacity, align=cfg.align)
    return BuddyAllocator(capacity, min_block=cfg.min_block, max_block=cfg.max_block,
                          trim=cfg.trim)


def device_memory(device: torch.device) -> int:
    """Total memory of ``device`` in bytes (CPU: physical RAM)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class PoolStats:
    """Counters since creation (or :meth:`ActivationPool.reset_stats`), plus the state now."""

    capacity: int
    used: int
    """Bytes of blocks held now."""
    live_entries: int
    peak_used: int
    peak_requested: int
    """Most bytes of saved activations resident at once (the pool's "peak live")."""
    high_water: int
    """Highest arena offset used since the pool was made: the arena this run needed."""
    internal_at_peak: float
    """1 - requested / allocated when resident activations peaked."""
    external_at_peak: float
    """1 - largest free block / total free at that moment."""
    failed_allocs: int
    """Allocations that found no room before evicting."""
    external_at_failures: float
    """Mean external fragmentation at those failures (0 when none): whether the room was
    there but in pieces."""
    stored: int
    stored_bytes: int
    shared: int
    """Saves that reused an entry (another save of a stored span)."""
    passthrough: int
    """Saves left to the framework by rule (parameter, small, non-contiguous, other device)."""
    fallbacks: int
    fallback_bytes: int
    evictions: int
    evicted_bytes: int
    fetches: int
    fetched_bytes: int
    stall_s: float
    """Time the training thread spent on offload and fetch copies."""

    @property
    def overhead(self) -> float:
        """Arena needed / peak live requested - 1."""
        return self.high_water / self.peak_requested - 1 if self.peak_requested else 0.0

    @property
    def fallback_rate(self) -> float:
        """Fallbacks / pool requests (stored + shared + fallbacks)."""
        n = self.stored + self.fallbacks
        return self.fallbacks / n if n else 0.0


class _Entry:
    __slots__ = ("offset", "host", "nbytes", "storage", "start", "version", "source", "refs",
                 "seq", "microbatch", "copied")

    def __init__(self, nbytes, storage, start, version, source, seq, microbatch) -> None:
        self.offset: int | None = None
        self.host: torch.Tensor | None = None
        self.nbytes, self.storage, self.start, self.version = nbytes, storage, start, version
        self.source = source  # weakref to the first tensor saved: its storage is still alive
        self.refs = 0
        self.seq = seq
        self.microbatch = microbatch
        self.copied: torch.cuda.Event | None = None  # offload copy (CUDA)


class _Handle:
    """What the graph holds for a stored tensor; dropping the last one frees the entry."""

    __slots__ = ("pool", "entry", "rel", "nbytes", "shape", "dtype", "__weakref__")

    def __init__(self, pool, entry, rel, t: torch.Tensor) -> None:
        self.pool, self.entry, self.rel = pool, entry, rel
        self.nbytes, self.shape, self.dtype = t.nbytes, t.shape, t.dtype
        entry.refs += 1

    def __del__(self) -> None:
        try:
            self.pool._drop(self.entry)
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
            pass


class _Passthrough:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationPool:
    """Saved activations in a pre-reserved arena (see the module docstring)."""

    def __init__(self, cfg: PoolConfig, *, device: torch.device | str = "cpu",
                 params: Iterable[torch.Tensor] = (), allocator: Allocator | None = None,
                 trace: list | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compare like t.device
            self.device = torch.device("cuda", torch.cuda.current_device())
        capacity = cfg.capacity_bytes or int(cfg.fraction * device_memory(self.device))
        self.capacity = capacity
        self.arena = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.allocator = allocator or make_allocator(cfg, capacity)
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._lock = threading.RLock()
        # Entries in the arena, least recently used first (the LRU order: a use moves an entry
        # to the end), and a heap of them by schedule key for the schedule policy (stale items
        # are skipped when popped): both policies pick a victim without scanning the arena.
        self._resident: dict[_Entry, None] = {}
        self._furthest: list[tuple[int, int, _Entry]] = []
        self._by_storage: dict[int, list[_Entry]] = {}
        self._seq = itertools.count(1)
        self._microbatch = 0
        self._backward_rank: dict[int, int] = {}
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self.trace = trace
        """When a list: ``("alloc", id, nbytes)`` and ``("free", id)`` events of every entry,
        the allocation trace ``bitps-bench memory`` replays."""
        self.reset_stats()

    # -- public -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Route tensors saved for backward inside the block through the pool."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Tag tensors saved inside the block as micro-batch ``index`` (schedule policy)."""
        before, self._microbatch = self._microbatch, index
        try:
            yield
        finally:
            self._microbatch = before

    def set_backward_order(self, order: Sequence[int]) -> None:
        """The order in which micro-batches' backwards will run (default: by index)."""
        with self._lock:
            self._backward_rank = {mb: i for i, mb in enumerate(order)}
            if self.cfg.policy == "schedule":
                self._rebuild_furthest()

    def residency(self) -> dict[int, tuple[int, int]]:
        """Bytes held per micro-batch tag now: ``{mb: (in the arena, offloaded to host)}``
        (what schedule-aware eviction chose to keep; a stage runtime tags its forwards)."""
        out: dict[int, list[int]] = {}
        with self._lock:
            for entries in self._by_storage.values():
                for e in entries:
                    row = out.setdefault(e.microbatch, [0, 0])
                    row[0 if e.offset is not None else 1] += e.nbytes
        return {mb: (r[0], r[1]) for mb, r in sorted(out.items())}

    def stats(self) -> PoolStats:
        with self._lock:
            s = self.allocator.stats()
            return PoolStats(capacity=self.capacity, used=s.allocated,
                             live_entries=sum(len(v) for v in self._by_storage.values()),
                             **self._counts, external_at_failures=(
                                 self._failure_external / self._counts["failed_allocs"]
                                 if self._counts["failed_allocs"] else 0.0))

    def reset_stats(self) -> None:
        """Zero the counters and peaks (the high-water mark stays: it is the arena's)."""
        with getattr(self, "_lock", contextlib.nullcontext()):
            self._counts = dict(peak_used=0, peak_requested=0, high_water=0,
                                internal_at_peak=0.0, external_at_peak=0.0, stored=0,
                                stored_bytes=0, shared=0, passthrough=0, fallbacks=0,
                                fallback_bytes=0, evictions=0, evicted_bytes=0, fetches=0,
                                fetched_bytes=0, stall_s=0.0, failed_allocs=0)
            self._failure_external = 0.0  # summed: a per-failure list would grow forever

    def collector(self) -> Collector:
        """Prometheus collector of the pool's gauges and counters (``bitps_worker_pool_*``)."""
        return _PoolCollector(self)

    # -- hooks --------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        # Cheap tests only: this runs for every saved tensor. A leaf that requires grad is a
        # parameter or an input its caller holds anyway; a frozen parameter is caught by its
        # exact type (isinstance(t, Parameter) would run a Python metaclass hook).
        if (t.layout != torch.strided or t.nbytes < self.cfg.min_tensor_bytes
                or t.device != self.device or not t.is_contiguous()
                or (t.requires_grad and t.is_leaf) or type(t) is torch.nn.Parameter):
            storage = None
        else:
            storage = t.untyped_storage().data_ptr()
        if storage is None or storage in self._params:
            with self._lock:
                self._counts["passthrough"] += 1
            return _Passthrough(t)
        start = t.storage_offset() * t.element_size()
        with self._lock:
            for e in self._by_storage.get(storage, ()):
                if (e.source() is not None and e.version == t._version
                        and e.start <= start and start + t.nbytes <= e.start + e.nbytes):
                    self._counts["shared"] += 1
                    self._touch(e)
                    return _Handle(self, e, start - e.start, t)
            offset = self._place(t.nbytes)
            if offset is None:
                self._counts["fallbacks"] += 1
                self._counts["fallback_bytes"] += t.nbytes
                return _Passthrough(t)
            e = _Entry(t.nbytes, storage, start, t._version, weakref.ref(t), next(self._seq),
                       self._microbatch)
            e.offset = offset
            self._by_storage.setdefault(storage, []).append(e)
            self._make_resident(e)
            self._counts["stored"] += 1
            self._counts["stored_bytes"] += t.nbytes
            if self.trace is not None:
                self.trace.append(("alloc", id(e), t.nbytes))
            # detached: the copy records no autograd node (cheaper than a no_grad block)
            self.arena[offset:offset + t.nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
            self._note_peak()
            return _Handle(self, e, 0, t)

    def _unpack(self, h):
        if isinstance(h, _Passthrough):
            return h.tensor
        e = h.entry
        with self._lock:
            if e.offset is not None:  # one clone of a typed view of the block
                self._touch(e)
                start = e.offset + h.rel
                return self.arena[start:start + h.nbytes].view(h.dtype).view(h.shape).clone()
            t0 = time.perf_counter()
            self._counts["fetches"] += 1
            if e.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(e.copied)
            offset = self._place(e.nbytes) if self.cfg.policy == "lru" else None
            if offset is not None:  # an LRU cache: what was just used comes back in
                self._counts["fetched_bytes"] += e.nbytes
                self.arena[offset:offset + e.nbytes].copy_(e.host, non_blocking=self._cuda)
                e.offset, e.host = offset, None
                self._make_resident(e)
                self._note_peak()
                src = self.arena[offset + h.rel:offset + h.rel + h.nbytes]
            else:
                self._counts["fetched_bytes"] += h.nbytes
                src = e.host[h.rel:h.rel + h.nbytes]
                if not self._cuda:
                    # On CPU host memory is the arena's memory: the host copy itself is served
                    # (nothing writes it again, and it lives as long as any tensor viewing it).
                    self._counts["stall_s"] += time.perf_counter() - t0
                    return src.view(h.dtype).view(h.shape)
            out = torch.empty(h.shape, dtype=h.dtype, device=self.device)
            out.reshape(-1).view(torch.uint8).copy_(src, non_blocking=self._cuda)
            self._counts["stall_s"] += time.perf_counter() - t0
            return out

    # -- arena --------------------------------------------------------------------------------
    def _place(self, nbytes: int) -> int | None:
        offset = self.allocator.alloc(nbytes)
        if offset is None and self._resident:
            self._counts["failed_allocs"] += 1
            self._failure_external += self.allocator.stats().external
        while offset is None and self._resident:
            self._offload(self._victim())
            offset = self.allocator.alloc(nbytes)
        return offset

    def _victim(self) -> _Entry:
        """The resident entry to offload: least recently used (``lru``), or the one whose
        micro-batch's backward comes last and, within it, the earliest saved (``schedule``:
        backward reads a micro-batch's tensors newest first)."""
        if self.cfg.policy == "lru":
            return next(iter(self._resident))
        while self._furthest[0][2] not in self._resident:
            heapq.heappop(self._furthest)  # offloaded or freed since it was pushed
        return self._furthest[0][2]

    def _schedule_key(self, e: _Entry) -> tuple[int, int]:
        """Smallest = needed furthest in the future (a min-heap key)."""
        return -self._backward_rank.get(e.microbatch, e.microbatch), e.seq

    def _make_resident(self, e: _Entry) -> None:
        self._resident[e] = None
        if self.cfg.policy != "schedule":
            return
        if len(self._furthest) > 2 * len(self._resident) + 64:
            # freed entries stay in the heap until popped: rebuild before it outgrows the arena
            self._rebuild_furthest()
        else:
            heapq.heappush(self._furthest, (*self._schedule_key(e), e))

    def _rebuild_furthest(self) -> None:
        """The schedule heap from the resident entries alone, with the current keys."""
        self._furthest = [(*self._schedule_key(r), r) for r in self._resident]
        heapq.heapify(self._furthest)

    def _touch(self, e: _Entry) -> None:
        """A use of an entry: under ``lru``, if resident, it becomes the most recently used."""
        if self.cfg.policy == "lru" and e in self._resident:
            del self._resident[e]
            self._resident[e] = None

    def _offload(self, e: _Entry) -> None:
        t0 = time.perf_counter()
        src = self.arena[e.offset:e.offset + e.nbytes]
        host = torch.empty(e.nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            self._copy_stream.wait_stream(compute)
            with torch.cuda.stream(self._copy_stream):
                host.copy_(src, non_blocking=True)
                e.copied = torch.cuda.Event()
                e.copied.record()
            compute.wait_event(e.copied)  # the block is rewritten only after the copy read it
        else:
            host.copy_(src)
        self.allocator.free(e.offset)
        e.offset, e.host = None, host
        del self._resident[e]
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += e.nbytes
        self._counts["stall_s"] += time.perf_counter() - t0

    def _drop(self, e: _Entry) -> None:
        with self._lock:
            e.refs -= 1
            if e.refs:
                return
            if e.offset is not None:
                self.allocator.free(e.offset)
                del self._resident[e]
            e.host = None
            entries = self._by_storage.get(e.storage, [])
            if e in entries:
                entries.remove(e)
                if not entries:
                    del self._by_storage[e.storage]
            if self.trace is not None:
                self.trace.append(("free", id(e)))

    def _note_peak(self) -> None:
        a, c = self.allocator, self._counts
        c["peak_used"] = max(c["peak_used"], a.allocated)
        c["high_water"] = a.high_water
        if a.requested > c["peak_requested"]:  # the full snapshot only at a new peak
            s = a.stats()
            c["peak_requested"] = s.requested
            c["internal_at_peak"], c["external_at_peak"] = s.internal, s.external


class _PoolCollector(Collector):
    def __init__(self, pool: ActivationPool) -> None:
        self.pool = pool

    def collect(self):
        s = self.pool.stats()
        for kind, name, doc, value in (
                (GaugeMetricFamily, "capacity_bytes", "Arena size", s.capacity),
                (GaugeMetricFamily, "used_bytes", "Bytes of arena blocks held now", s.used),
                (GaugeMetricFamily, "peak_used_bytes", "Most arena bytes held at once",
                 s.peak_used),
                (GaugeMetricFamily, "peak_requested_bytes",
                 "Most saved-activation bytes resident at once", s.peak_requested),
                (GaugeMetricFamily, "internal_fragmentation_ratio",
                 "1 - requested/allocated at the peak", s.internal_at_peak),
                (GaugeMetricFamily, "external_fragmentation_ratio",
                 "1 - largest free/total free at the peak", s.external_at_peak),
                (GaugeMetricFamily, "external_fragmentation_at_failures_ratio",
                 "Mean 1 - largest free/total free at failed allocations",
                 s.external_at_failures),
                (GaugeMetricFamily, "overhead_ratio", "Arena needed / peak live requested - 1",
                 s.overhead),
                (CounterMetricFamily, "failed_allocs", "Allocations that found no room",
                 s.failed_allocs),
                (CounterMetricFamily, "evictions", "Entries offloaded to host memory",
                 s.evictions),
                (CounterMetricFamily, "evicted_bytes", "Bytes offloaded to host memory",
                 s.evicted_bytes),
                (CounterMetricFamily, "fetches", "Unpacks served from host memory", s.fetches),
                (CounterMetricFamily, "fetched_bytes", "Bytes read back from host memory",
                 s.fetched_bytes),
                (CounterMetricFamily, "fallbacks",
                 "Saves the pool could not hold (left to the framework)", s.fallbacks),
                (CounterMetricFamily, "stall_seconds",
                 "Training-thread time in offload and fetch copies", s.stall_s)):
            yield kind(f"bitps_worker_pool_{name}", doc, value=value)
        if self.pool.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.pool.device)
            for key in ("reserved_bytes.all.peak", "allocated_bytes.all.peak",
                        "inactive_split_bytes.all.peak"):
                yield GaugeMetricFamily("bitps_worker_cuda_" + key.replace(".", "_"),
                                        f"torch.cuda.memory_stats {key}",
                                        value=stats.get(key, 0))
