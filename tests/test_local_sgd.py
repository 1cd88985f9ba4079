"""Local SGD / DiLoCo (``worker.algorithms.local_sgd``) against real shards (in-process, real
sockets): with H = 1, raw pushes and an outer SGD of lr 1, one worker is plain local training with
the inner optimizer, and two workers with inner SGD are sync SGD on the mean gradient; H > 1 moves
H-fold fewer bytes; a misfit setting is refused before anything runs; a worker that restarts
mid-round resumes from the shards' parameters."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from bitps import CodecConfig  # noqa: E402
from bitps.ps import OptimizerConfig  # noqa: E402
from bitps.worker import ClientConfig, PSClient  # noqa: E402
from bitps.worker.algorithms.local_sgd import LocalSGD  # noqa: E402
from tests.test_cluster import servers_of  # noqa: E402

OUTER_PLAIN = OptimizerConfig(name="sgd", lr=1.0)
STEPS = 20


@pytest.fixture
def shards(cluster):
    """``shards(num_shards, **server_config)`` -> the gRPC addresses of running shards."""
    return lambda num_shards=2, **kw: servers_of(cluster(num_shards, **kw))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _client(servers, rank=0, world=1, **kw) -> PSClient:
    return PSClient(ClientConfig(servers=servers, rank=rank, world_size=world,
                                 partition_bytes=1024, **kw))


def test_one_worker_h1_equals_local_training_with_the_inner_optimizer(shards):
    servers = shards(2, mode="sync", optimizer=OUTER_PLAIN)
    model, ref = _model(), _model()
    local = LocalSGD(model, _client(servers), torch.optim.AdamW(model.parameters(), lr=1e-2),
                     inner_steps=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        for step in range(STEPS):
            _loss(model, 0, step).backward()
            assert local.step()
            _loss(ref, 0, step).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        local.close()
    assert local.clock == STEPS
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_two_workers_h1_with_inner_sgd_equal_sync_sgd_on_the_mean_gradient(shards):
    servers = shards(2, mode="sync", optimizer=OUTER_PLAIN)
    lr = 0.05
    models = [_model(), _model()]
    workers, errors = [None, None], []

    def run(rank):
        try:
            m = models[rank]
            w = workers[rank] = LocalSGD(m, _client(servers, rank, 2),
                                         torch.optim.SGD(m.parameters(), lr=lr), inner_steps=1)
            for step in range(STEPS):
                _loss(m, rank, step).backward()
                w.step()
        except Exception as err:  # reported below: a thread must not die silently
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for w in workers:
        if w is not None:
            w.close()
    assert not errors, errors

    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            opt.zero_grad()
            _loss(ref, rank, step).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    for m in models:
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_h_inner_steps_push_once_per_round_and_sign1_shrinks_the_bytes(shards):
    servers = shards(1, mode="sync", optimizer=OptimizerConfig(
        name="momentum", lr=0.7, momentum=0.9, nesterov=True))
    model = _model()
    client = _client(servers, compress_min_bytes=0,
                     push_codec=CodecConfig(name="sign1", chunk=64))
    local = LocalSGD(model, client, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     inner_steps=4)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        exchanged = []
        for step in range(8):
            _loss(model, 0, step).backward()
            exchanged.append(local.step())
        assert exchanged == [False, False, False, True] * 2
        assert local.clock == 2
        m = client.metrics
        raw = m.codec_raw_bytes.labels("sign1").value
        wire = m.codec_wire_bytes.labels("sign1").value
        assert raw == 2 * 4 * sum(p.numel() for p in model.parameters())
        assert wire < raw / 20
    finally:
        local.close()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_misfit_settings_are_refused_before_anything_runs(shards):
    model = _model()
    servers = shards(1, mode="sync", optimizer=OUTER_PLAIN)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    cases = [({"inner_steps": 0}, model.parameters(), "inner_steps is 0"),
             ({"inner_steps": 2}, model[0].parameters(), "does not update"),
             ({"inner_steps": 2, "fragments": 3}, model.parameters(), "fragments is 3"),
             ({"inner_steps": 4, "fragments": 2, "overlap_steps": 2}, model.parameters(),
              "overlap_steps is 2")]
    for kw, params, message in cases:
        client = _client(servers)
        try:
            with pytest.raises(ValueError, match=message):
                LocalSGD(model, client, sgd(params), **kw)
            assert client.plan is None  # refused before registering
        finally:
            client.close(leave=False)
    from bitps.worker.config import AlgorithmConfig

    with pytest.raises(ValueError, match="fragment_overlap_steps"):
        AlgorithmConfig(name="diloco", inner_steps=8, fragments=4, fragment_overlap_steps=2)
    onebit = shards(1, mode="sync", optimizer=OptimizerConfig(name="onebit_adam"))
    client = _client(onebit)
    try:
        with pytest.raises(ValueError, match="onebit_adam"):
            LocalSGD(model, client, sgd(model.parameters()), inner_steps=2)
    finally:
        client.close()


def test_a_worker_restarting_mid_round_resumes_from_the_shards_parameters(shards):
    servers = shards(2, mode="async", optimizer=OptimizerConfig(
        name="nesterov", lr=0.7, momentum=0.9))
    model = _model()
    local = LocalSGD(model, _client(servers), torch.optim.AdamW(model.parameters(), lr=1e-2),
                     inner_steps=3)
    for step in range(7):  # two rounds and one inner step of the third
        _loss(model, 0, step).backward()
        local.step()
    global_after_two = [torch.from_numpy(a.copy()) for a in local._pulled]
    state = local.state_dict()
    local.client.close(leave=False)  # the process dies mid-round

    fresh = _model(seed=1)  # built from another seed: must not win over the shards' values
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    again = LocalSGD(fresh, PSClient(ClientConfig(servers=servers, partition_bytes=1024)), opt,
                     inner_steps=3)
    try:
        for p, g in zip(fresh.parameters(), global_after_two):
            torch.testing.assert_close(p.detach().reshape(-1), g, rtol=0, atol=0)
        again.load_state_dict(dict(state, inner_step=0))
        _loss(fresh, 0, 7).backward()
        again.step()
    finally:
        again.close()


def test_streaming_fragments_exchange_at_staggered_steps_and_landing_keeps_progress(shards):
    """F = 2 fragments, H = 4: fragment 0 goes at inner step 2, fragment 1 at step 4, each in
    flight for one inner step while training goes on. With one worker, raw pushes and an outer
    SGD of lr 1 the new global values are the sent ones, so a landing that keeps the progress
    made in flight leaves the model on the path of plain local training."""
    servers = shards(2, mode="sync", optimizer=OUTER_PLAIN)
    model, ref = _model(), _model()
    local = LocalSGD(model, _client(servers), torch.optim.AdamW(model.parameters(), lr=1e-2),
                     inner_steps=4, fragments=2, overlap_steps=1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    started, in_flight = [], []
    try:
        for step in range(12):
            _loss(model, 0, step).backward()
            started.append(local.step())
            in_flight.append(sorted(local._inflight))
            _loss(ref, 0, step).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        local.close()
    assert started == [False, True, False, True] * 3
    # fragment 0 in flight during step 3, fragment 1 during step 1 of the next round
    assert in_flight[:5] == [[], [0], [], [1], []]
    assert local.clock == 3 and not local._inflight
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
