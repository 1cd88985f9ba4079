"""ActivationPool: saved activations through an arena with host offload, on the CPU (the arena is
a CPU tensor, host copies are synchronous); sizes scaled down so the demo model's activations
count."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from bitps.worker.config import PoolConfig  # noqa: E402
from bitps.worker.memory.pool import ActivationPool  # noqa: E402

SMALL = dict(min_block=1024, max_block=1 << 20, min_tensor_bytes=1024)


@pytest.fixture(scope="module")
def demo():
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn

    cfg = DemoConfig(seq_len=32, batch_size=4, corpus_bytes=100_000)
    corpus = load_corpus(cfg.corpus_bytes)

    def data():
        return batches(corpus, batch_size=4, seq_len=32, rank=0, world_size=1, seed=0)

    return cfg, build_model, data, loss_fn


def _train(demo, steps: int, pool_cfg: PoolConfig | None, check_empty: bool = True):
    """``steps`` of SGD on the demo model; each step's gradients, and the pool."""
    cfg, build_model, data, loss_fn = demo
    torch.set_num_threads(1)
    model = build_model(cfg)
    pool = (ActivationPool(pool_cfg, params=model.parameters()) if pool_cfg is not None
            else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = data()
    grads = []
    for _ in range(steps):
        x, y = next(it)
        with pool.hooks() if pool else contextlib.nullcontext():
            loss = loss_fn(model, x, y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if pool is not None and check_empty:
            s = pool.stats()
            assert s.live_entries == 0 and s.used == 0, "the pool kept blocks after backward"
            assert pool.allocator.stats().live == 0
    return grads, pool


@pytest.fixture(scope="module")
def reference(demo):
    grads, _ = _train(demo, 5, None)
    _, pool = _train(demo, 1, PoolConfig(capacity_bytes=64 << 20, **SMALL))
    return grads, pool.stats().peak_requested


@pytest.mark.parametrize("budget", [None, 0.5, 0.1])
@pytest.mark.parametrize("policy", ["lru", "schedule"])
def test_gradients_are_bit_identical_with_the_pool_on_and_off(demo, reference, budget, policy):
    """Acceptance 2: budgets infinite, 50 % and 10 % of the activation bytes, both policies."""
    ref, peak = reference
    capacity = 64 << 20 if budget is None else int(peak * budget)
    grads, pool = _train(demo, 5, PoolConfig(capacity_bytes=capacity, policy=policy, **SMALL))
    for step, (a, b) in enumerate(zip(ref, grads)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {step}"
    s = pool.stats()
    assert s.stored > 0 and s.fallbacks == 0
    if budget is None:
        assert s.evictions == 0
    else:  # the budget is below the peak: offloads happened and came back
        assert s.evictions > 0 and s.fetches > 0 and s.peak_used <= capacity


def test_no_leak_over_100_steps(demo):
    """Acceptance 3: the arena is empty after every backward (checked in ``_train``), and the
    allocator's free blocks are back to the fully-free arena."""
    for allocator in ("bestfit", "buddy"):
        cfg = PoolConfig(capacity_bytes=1 << 20, allocator=allocator, **SMALL)  # ~half the peak
        fresh = ActivationPool(cfg).allocator.free_blocks()
        _, pool = _train(demo, 100 if allocator == "bestfit" else 20, cfg)
        assert pool.stats().evictions > 0
        assert pool.allocator.free_blocks() == fresh
    # With room for everything nothing is evicted, so the schedule policy's victim heap is
    # never popped: freed entries must still leave it (it is rebuilt as it outgrows the arena).
    steps = 20
    _, pool = _train(demo, steps, PoolConfig(capacity_bytes=64 << 20, **SMALL))
    assert pool.stats().evictions == 0
    assert len(pool._furthest) <= 2 * pool.stats().stored // steps + 65


def test_retain_graph_keeps_entries_until_the_graph_goes():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    pool = ActivationPool(PoolConfig(capacity_bytes=1 << 20, **SMALL),
                          params=lin.parameters())
    x = torch.randn(32, 64, requires_grad=True)
    with pool.hooks():
        loss = torch.tanh(lin(x)).square().sum()
    assert pool.stats().live_entries > 0
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    assert pool.stats().live_entries > 0  # the graph still holds its handles
    x.grad = None
    loss.backward()
    assert torch.equal(x.grad, first)
    del loss
    assert pool.stats().live_entries == 0 and pool.stats().used == 0


def test_rules_pass_parameters_small_and_strided_tensors_through_and_share_storages():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    pool = ActivationPool(PoolConfig(capacity_bytes=1 << 20, **SMALL), params=[w])
    x0 = torch.randn(64, 64, requires_grad=True)
    with pool.hooks():
        x = x0 * 1  # an activation (not a leaf)
        y = x @ w  # saves x (stored) and w (a parameter: passes through)
        z = (y * y).sum() + (y * 2).sum()  # y saved once by mul, shared
        tiny = torch.randn(4, requires_grad=True)
        (tiny * tiny).sum()  # below min_tensor_bytes
        strided = torch.randn(64, 64, requires_grad=True)
        (strided.t() * strided.t()).sum()  # non-contiguous
        leaf = torch.randn(64, 64, requires_grad=True)
        (leaf * leaf).sum()  # a leaf that requires grad: its owner holds it
        frozen = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
        (x @ frozen).sum()  # saves only the frozen parameter (not in params): passes through
    s = pool.stats()
    assert s.stored == 2 and s.shared >= 1 and s.passthrough >= 6
    z.backward()
    got = w.grad.clone()
    w.grad = None
    y = (x0 * 1) @ w  # the same graph, no pool
    ((y * y).sum() + (y * 2).sum()).backward()
    assert torch.equal(got, w.grad)


@pytest.mark.parametrize("policy", ["lru", "schedule"])
def test_saving_an_offloaded_tensor_again_shares_its_host_copy(policy):
    """``b`` is offloaded to make room for ``c``; saving ``b`` again (twice, by ``b * b``) hits
    the offloaded entry, and backward reads it from host memory: gradients as without pool."""
    def grads(pool):
        a = torch.linspace(-1, 1, 1024, requires_grad=True)
        with pool.hooks() if pool else contextlib.nullcontext():
            b = a.exp()  # saves b
            c = (a * 2).exp()  # saves c: no room for both, b goes to host
            loss = (b * b).sum() + c.sum()  # saves b twice more: shared with the host copy
        loss.backward()
        return a.grad

    pool = ActivationPool(PoolConfig(capacity_bytes=4096, policy=policy, **SMALL))
    assert torch.equal(grads(pool), grads(None))
    s = pool.stats()
    assert s.evictions >= 1 and s.shared >= 1 and s.fetches >= 1 and s.used == 0


def test_a_fetched_tensor_outlives_its_entry():
    """What unpack returns for an offloaded entry (on CPU, a view of the host copy) keeps its
    values after the graph drops the entry and the arena is reused."""
    pool = ActivationPool(PoolConfig(capacity_bytes=4096, policy="schedule", **SMALL))
    a = torch.arange(1024, dtype=torch.float32)
    first = pool._pack(a)
    second = pool._pack(a + 1)  # no room for both: a, saved first, goes to host
    assert pool.stats().evictions == 1
    got = pool._unpack(first)
    del first  # the entry is freed; its host copy lives on in ``got``
    third = pool._pack(a * 3)  # the arena and host buffers turn over
    assert torch.equal(got, a)
    del second, third
    assert pool.stats().used == 0 and pool.stats().live_entries == 0


def test_an_arena_too_small_is_pure_passthrough_counted_as_fallbacks(demo, reference):
    ref, _ = reference
    grads, pool = _train(demo, 2, PoolConfig(capacity_bytes=1, **SMALL))  # nothing fits
    for a, b in zip(ref, grads):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    s = pool.stats()
    assert s.stored == 0 and s.fallbacks > 0 and s.fallback_rate == 1.0


def test_schedule_policy_moves_fewer_bytes_than_lru_in_1f1b():
    """Four micro-batches, two in flight, backward oldest first (1F1B): LRU evicts the oldest
    micro-batch, which is needed next; the schedule policy evicts the newest."""
    moved = {}
    for policy in ("lru", "schedule"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64),
                                                          torch.nn.Tanh()) for _ in range(4)])
        pool = ActivationPool(PoolConfig(capacity_bytes=96 << 10, policy=policy, **SMALL),
                              params=model.parameters())
        xs = [torch.randn(64, 64) for _ in range(4)]
        losses, grads = {}, []
        order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
        for op, mb in order:
            if op == "F":
                with pool.hooks(), pool.microbatch(mb):
                    losses[mb] = model(xs[mb]).square().mean()
            else:
                losses.pop(mb).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        moved[policy] = (pool.stats().evicted_bytes, grads)
    assert moved["schedule"][0] < moved["lru"][0]
    for a, b in zip(moved["lru"][1], moved["schedule"][1]):
        assert torch.equal(a, b)


def test_config_errors_and_metrics():
    with pytest.raises(ValueError, match="policy"):
        PoolConfig(policy="mru")
    with pytest.raises(ValueError, match="allocator"):
        PoolConfig(allocator="slab")
    pool = ActivationPool(PoolConfig(capacity_bytes=1 << 20, allocator="bestfit", **SMALL))
    registry = CollectorRegistry()
    registry.register(pool.collector())
    text = generate_latest(registry).decode()
    for name in ("bitps_worker_pool_capacity_bytes 1.048576e+06",
                 "bitps_worker_pool_external_fragmentation_ratio",
                 "bitps_worker_pool_evicted_bytes_total", "bitps_worker_pool_fallbacks_total"):
        assert name in text
