"""Overlap: buckets pushed from backward hooks by the communication thread, pulls awaited in
forward pre-hooks, the 20 % rule, and the step timing behind it.

In-process shards on real loopback sockets; the model trains on the CPU (the CUDA stream path is
checked by ``bench/gpu_check.py`` on a GPU).
"""

from __future__ import annotations

import logging
import threading

import pytest

from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import OptimizerConfig, ServerConfig, create_server
from bitps.worker import ClientConfig, PSClient
from bitps.worker.config import OverlapConfig
from bitps.worker.training.buckets import make_buckets
from bitps.worker.training.utilization import StepStats, decide, settled
from tests.helpers import run_ranks

torch = pytest.importorskip("torch")


@pytest.fixture
def shard_factory():
    started = []

    def make(**kw):
        shard = create_server(ServerConfig(metrics_port=-1, **kw))
        started.append(shard)
        return f"127.0.0.1:{shard.ports['grpc_port']}"

    yield make
    for s in started:
        s.stop(0)


# -- pieces -------------------------------------------------------------------------------------
def test_buckets_follow_backward_order_and_cover_every_key_once():
    names = ["embed", "l0.w", "l0.b", "l1.w", "l1.b", "head"]
    shapes = [(256, 16), (64, 64), (64,), (64, 64), (64,), (16, 256)]
    plan = make_plan([ParamSpec(n, s) for n, s in zip(names, shapes)], num_shards=2,
                     partition_bytes=4096)
    buckets = make_buckets(plan, names, bucket_bytes=16_384)
    assert [b.params for b in buckets] == [(5,), (3, 4), (1, 2), (0,)]  # last layer first
    assert [b.priority for b in buckets] == [5, 3, 1, 0]
    assert sorted(k for b in buckets for k in b.keys) == [k.key for k in plan.keys]
    assert sum(b.nbytes for b in buckets) == sum(k.nbytes for k in plan.keys)
    assert make_buckets(plan, names, bucket_bytes=16_384) == buckets  # deterministic
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets(plan, names, bucket_bytes=0)


def test_overlap_config_rejects_bad_values():
    with pytest.raises(ValueError, match="overlap mode"):
        OverlapConfig(mode="sometimes")
    with pytest.raises(ValueError, match="min_ratio"):
        OverlapConfig(min_ratio=-1)
    with pytest.raises(ValueError, match="probe_steps"):
        OverlapConfig(probe_steps=0)


def test_decide_applies_the_20_percent_rule_to_the_median():
    def step(compute, comm):
        return StepStats(wall_s=compute + comm, exposed_s=comm, comm_s=comm, overlapped=False)

    cheap = decide([step(1.0, 0.1), step(1.0, 0.15), step(1.0, 5.0)], 0.2)
    assert not cheap.enabled and cheap.ratio == pytest.approx(0.15)
    assert "0.150 of compute" in cheap.describe() and "off" in cheap.describe()
    dear = decide([step(1.0, 0.5)] * 3, 0.2)
    assert dear.enabled and "on" in dear.describe()
    assert not decide([step(1.0, 0.5)], 0.2, reason="clipping").enabled
    s = step(0.9, 0.1)
    assert s.utilization == pytest.approx(0.9) and s.overlap_ratio == 0.0


# -- the model path -----------------------------------------------------------------------------
def _demo():
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus

    demo = DemoConfig(seq_len=32, batch_size=4, corpus_bytes=100_000)
    corpus = load_corpus(demo.corpus_bytes)
    return demo, corpus, build_model, batches


def test_sync_parameters_after_20_steps_are_bit_identical_with_overlap_on_and_off(
        shard_factory):
    """Acceptance 1: two workers, a sync shard running Adam, 20 steps of the demo model."""
    from bitps.worker.demo import loss_fn
    from bitps.worker.training.model import PSModel

    torch.set_num_threads(1)
    demo, corpus, build_model, batches = _demo()

    def train(mode: str) -> list[torch.Tensor]:
        server = shard_factory(mode="sync", optimizer=OptimizerConfig(name="adam", lr=3e-3))
        results: dict[int, list[torch.Tensor]] = {}
        errors: list[BaseException] = []
        models = [build_model(demo) for _ in range(2)]  # torch's seed is global: not in threads

        def rank(r: int) -> None:
            try:
                model = models[r]
                client = PSClient(ClientConfig(servers=(server,), rank=r, world_size=2,
                                               partition_bytes=16 << 10))
                ps_model = PSModel(model, client,
                                   overlap=OverlapConfig(mode=mode, bucket_bytes=32 << 10))
                assert ps_model.decision.enabled == (mode == "on")
                data = batches(corpus, batch_size=4, seq_len=32, rank=r, world_size=2, seed=0)
                for _ in range(20):
                    loss_fn(model, *next(data)).backward()
                    ps_model.step()
                ps_model.synchronize()
                results[r] = [p.detach().clone() for p in model.parameters()]
                if mode == "on":
                    assert len(ps_model.buckets) > 4 and ps_model.last_stats.overlapped
                ps_model.close()
            except BaseException as err:  # noqa: BLE001 - re-raised on the test thread
                errors.append(err)

        run_ranks(rank)
        if errors:
            raise errors[0]
        for a, b in zip(results[0], results[1]):
            assert torch.equal(a, b)  # sync: both ranks hold the shard's values
        return results[0]

    off, on = train("off"), train("on")
    assert any(not torch.equal(p, q) for p, q in zip(off, build_model(demo).parameters()))
    for a, b in zip(off, on):
        assert torch.equal(a, b)


class _Reads(torch.overrides.TorchFunctionMode):
    """Records the value of every parameter the first time a torch function reads it."""

    def __init__(self, named) -> None:
        super().__init__()
        self.names = {id(p): n for n, p in named}
        self.seen: dict[str, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            name = self.names.get(id(a))
            if name is not None and name not in self.seen:
                self.seen[name] = a.detach().clone()
        return func(*args, **kwargs)


class _SelfAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def test_read_trace_waits_where_the_forward_reads():
    """A parent's functional call, a tied weight, and an expert the traced step never called."""
    from bitps.worker.training.readers import ReadTrace

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 32)
            self.attn = _SelfAttention()
            self.experts = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
            self.unused = torch.nn.Linear(2, 2)

        def forward(self, tokens):
            h = self.attn(self.embed(tokens))
            h = self.experts[0](h)  # expert 1 gets no tokens in this step
            return h @ self.embed.weight[:8, :8]  # a tied read by the root's own code

    net = Net()
    named = list(net.named_parameters())
    trace = ReadTrace(net, [p for _, p in named])
    net(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    waits = trace.finish()
    by_name = {m: {named[i][0] for i in idx} for m, idx in waits.items()}
    assert {"attn.attn.out_proj.weight", "attn.attn.out_proj.bias",
            "attn.attn.in_proj_weight"} <= by_name[net.attn.attn]
    assert net.attn.attn.out_proj not in by_name  # its forward never runs
    assert by_name[net.embed] == {"embed.weight"}
    assert "embed.weight" in by_name[net]  # read by the root's forward itself
    # never read: the owner waits, and so does the nearest enclosing module that ran
    assert by_name[net.experts[1]] == {"experts.1.weight", "experts.1.bias"}
    assert {"experts.1.weight", "unused.weight"} <= by_name[net]
    assert not net._forward_pre_hooks and not net.attn.attn._forward_hooks  # hooks removed


@pytest.mark.parametrize("block", ["MultiheadAttention", "TransformerEncoderLayer"])
def test_parameters_a_parent_reads_by_functional_call_are_ready_before_it_reads_them(
        shard_factory, block):
    """Acceptance 2: ``nn.MultiheadAttention`` reads ``out_proj.weight`` inside
    ``F.multi_head_attention_forward``, so ``out_proj``'s own pre-hook never runs. With pulls
    slowed (the communication thread pauses before each), every parameter value each forward
    reads must be the shard's value for that step: what an overlap-off run reads."""
    from bitps.worker.training.model import PSModel

    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        if block == "MultiheadAttention":
            return _SelfAttention()
        return torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                                batch_first=True)

    def run(mode: str) -> list[dict[str, torch.Tensor]]:
        server = shard_factory(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
        model = build()
        client = PSClient(ClientConfig(servers=(server,)))
        pull = client.pull

        def slow_pull(*args, **kwargs):
            threading.Event().wait(0.02)
            return pull(*args, **kwargs)

        client.pull = slow_pull
        # one bucket per parameter, one in flight at a time: out_proj's bucket goes after the
        # attention's own (a higher priority), which the attention's pre-hook waits for
        ps_model = PSModel(model, client, overlap=OverlapConfig(mode=mode, bucket_bytes=1,
                                                                inflight_bytes=1))
        gen = torch.Generator().manual_seed(3)
        reads = []
        for _ in range(6):
            with _Reads(model.named_parameters()) as r:
                out = model(torch.randn(2, 5, 32, generator=gen))
            out.square().mean().backward()
            ps_model.step()
            reads.append(r.seen)
        ps_model.close()
        return reads

    off, on = run("off"), run("on")
    assert "out_proj.weight" in "".join(off[0]) and len(off[0]) == len(on[0])
    for step, (a, b) in enumerate(zip(off, on)):
        assert a.keys() == b.keys()
        torn = [n for n in a if not torch.equal(a[n], b[n])]
        assert not torn, f"step {step}: forward read {torn} before their pull completed"
    assert not torch.equal(off[0]["self_attn.out_proj.weight" if block != "MultiheadAttention"
                               else "attn.out_proj.weight"],
                           off[-1]["self_attn.out_proj.weight" if block != "MultiheadAttention"
                                   else "attn.out_proj.weight"])


@pytest.mark.parametrize("codec", ["raw", "sign1"])
def test_bytes_pushed_per_bucket_equal_a_synchronous_copy_of_the_gradient(shard_factory, codec):
    """Acceptance 3 (CPU): what the communication thread sends for every bucket, hashed when
    sent and again once answered, equals the bytes computed from a copy of the gradients taken
    after backward returned (sign1: compressed by the torch codec next to the gradients, error
    feedback replayed by the numpy reference). ``bench/gpu_check.py`` runs this same function
    on CUDA."""
    from bitps.bench.gpu_check import pushed_bytes_match

    torch.set_num_threads(1)
    server = shard_factory(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.05))
    assert pushed_bytes_match(server, device="cpu", codec=codec) == []


def test_auto_decides_once_the_median_of_the_probe_is_known():
    """More than half of ``probe_steps`` on one side of ``min_ratio`` fixes the median's side:
    ``auto`` stops probing there (each probe step runs without overlap), and decides as the
    full probe would have."""
    def step(ratio: float) -> StepStats:
        return StepStats(wall_s=1.0 + ratio, exposed_s=ratio, comm_s=ratio, overlapped=False)

    hi, lo = step(0.5), step(0.1)
    assert not settled([hi], 0.2, 3) and not settled([hi, lo], 0.2, 3)
    assert settled([hi, hi], 0.2, 3) and settled([lo, lo], 0.2, 3)
    assert settled([hi, lo, lo], 0.2, 3)  # probe_steps measured: decided on the median
    assert not settled([hi, hi], 0.2, 4) and settled([hi, lo, hi, hi], 0.2, 5)
    assert settled([hi], 0.2, 1) and settled([hi], 0.2, 2) is False
    for seen, rest in (([hi, hi], [lo]), ([lo, lo], [hi]), ([hi, lo, hi, hi], [lo])):
        # what the early decision says is what the whole probe would have said
        assert decide(seen, 0.2).enabled == decide(seen + rest, 0.2).enabled


def test_auto_rule_is_observable_both_ways(shard_factory, caplog):
    """Acceptance 4: cheap communication (a small model whose step computes for a while) is
    reported with overlap off and its ratio; dear communication (a large model with almost no
    compute) with overlap on. Logged, exported as gauges, and on ``PSModel.decision``."""
    import time

    from bitps.worker.training.model import PSModel

    torch.set_num_threads(1)

    def run(width: int, busy_s: float):
        server = shard_factory(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.01))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
        client = PSClient(ClientConfig(servers=(server,)))
        ps_model = PSModel(model, client, overlap=OverlapConfig(mode="auto", probe_steps=3))
        decided_after = None
        for step in range(6):
            model(torch.ones(2, width)).sum().backward()
            time.sleep(busy_s)  # stands for compute: it is on the training thread
            ps_model.step()
            if decided_after is None and ps_model.decision is not None:
                decided_after = step + 1
        m = client.metrics
        gauges = (m.overlap_enabled.value, m.comm_compute_ratio.value)
        decision = ps_model.decision
        ps_model.close()
        return decision, gauges, decided_after

    with caplog.at_level(logging.INFO, logger="bitps.worker.training.overlap"):
        cheap, cheap_gauges, cheap_after = run(width=16, busy_s=0.05)
        dear, dear_gauges, dear_after = run(width=2048, busy_s=0.0)  # 16 MiB of parameters
    # one warm-up step, then two measured steps on one side settle the median of three (each
    # probe step runs without overlap; the third was taken as well before)
    assert cheap_after == dear_after == 3
    assert not cheap.enabled and cheap.ratio < 0.2 and cheap_gauges == (0, cheap.ratio)
    assert dear.enabled and dear.ratio > 0.2 and dear_gauges == (1, dear.ratio)
    text = caplog.text
    assert f"overlap off: communication is {cheap.ratio:.3f} of compute" in text
    assert f"overlap on: communication is {dear.ratio:.3f} of compute" in text


def test_misuse_gets_clear_errors(shard_factory):
    from bitps.worker.training.model import PSModel

    server = shard_factory(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.01))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    client = PSClient(ClientConfig(servers=(server,)))
    ps_model = PSModel(model, client, overlap=OverlapConfig(mode="on"))
    model(torch.ones(1, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="second gradient"):
        model(torch.ones(1, 8)).sum().backward()
    ps_model.step()
    with ps_model.no_sync():  # accumulation: nothing pushed until the backward outside
        model(torch.ones(1, 8)).sum().backward()
    model(torch.ones(1, 8)).sum().backward()
    ps_model.step()
    ps_model.close()
    assert ps_model.clock == 2


def test_a_shard_error_in_the_communication_thread_reaches_the_training_thread(shard_factory):
    """A NaN gradient pushed from a backward hook is refused by the shard (NON_FINITE); the
    typed error surfaces where the training thread next waits for that bucket, and the
    parameters keep their values."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.wire import PSError
    from bitps.worker.training.model import PSModel

    server = shard_factory(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    before = [p.detach().clone() for p in model.parameters()]
    client = PSClient(ClientConfig(servers=(server,)))
    ps_model = PSModel(model, client, overlap=OverlapConfig(mode="on"))
    model(torch.full((1, 8), float("nan"))).sum().backward()
    ps_model.step()
    with pytest.raises(PSError) as err:
        model(torch.ones(1, 8))  # the forward pre-hook waits for the bucket
    assert err.value.code == pb.NON_FINITE and "NaN" in str(err.value)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach(), q)
    with pytest.raises(PSError):
        ps_model.close()  # close() still leaves the shards, then reports the failure
    with pytest.raises(RuntimeError, match="closed"):
        client.pull([], [], clock=0)
