"""Compressed pushes end to end: a real PSClient with a push codec, in-process shards on port 0,
real sockets. The shard must apply exactly what the numpy reference decodes, the worker must
keep exactly the reference's residuals, small keys must go raw, and bytes are counted."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bitps.native import sign1
from bitps.proto.codecs import CodecConfig
from bitps.proto.keyplan import ParamSpec, make_plan
from bitps.ps import OptimizerConfig, ServerConfig, create_server
from bitps.worker import ClientConfig, PSClient
from tests.encoding import EncodingClient

LR = np.float32(0.5)  # a power of two: SGD's fma and numpy's two roundings agree


@pytest.fixture
def shards():
    started = [create_server(ServerConfig(shard_id=i, num_shards=2, mode="async",
                                          optimizer=OptimizerConfig(name="sgd", lr=float(LR))))
               for i in range(2)]
    yield started
    for s in started:
        s.stop(0)


def test_sign1_push_applies_reference_decode_and_keeps_reference_residuals(shards):
    # "big" is cut into 1024-element keys (compressed), "bias" is one 40-element key (raw).
    plan = make_plan([ParamSpec("big", (3000,)), ParamSpec("bias", (10,))], num_shards=2,
                     partition_bytes=4096)
    cfg = ClientConfig(servers=tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards),
                       partition_bytes=4096, compress_min_bytes=1024,
                       push_codec=CodecConfig(name="sign1", chunk=64))
    init = {"big": np.linspace(-1, 1, 3000, dtype=np.float32), "bias": np.ones(10, np.float32)}
    keys = [k.key for k in plan.keys]
    views = [init[k.name][k.offset:k.offset + k.length] for k in plan.keys]
    rng = np.random.default_rng(0)
    with EncodingClient(cfg) as client:
        client.register(plan, dict(zip(keys, views)))
        expected = [v.copy() for v in views]
        residuals = [np.zeros(k.length, np.float32) for k in plan.keys]
        outs = [np.empty(k.length, np.float32) for k in plan.keys]
        for step in range(3):
            grads = [(rng.standard_normal(k.length) * 10.0 ** rng.integers(-2, 2, k.length))
                     .astype(np.float32) for k in plan.keys]
            client.push_pull(keys, grads, outs, clock=step).wait()
            for i, k in enumerate(plan.keys):
                if k.name == "bias":  # 40 bytes < compress_min_bytes: raw
                    applied = grads[i]
                else:
                    payload, residuals[i] = sign1.encode_reference(grads[i], residuals[i],
                                                                   chunk=64)
                    applied = sign1.decode_reference(payload, k.length, chunk=64)
                expected[i] = expected[i] - LR * applied
                assert np.array_equal(outs[i], expected[i]), (step, k.key, k.name)
        kept = client.residuals()
        for i, k in enumerate(plan.keys):
            if k.name == "bias":
                assert k.key not in kept
            else:
                assert np.array_equal(kept[k.key], residuals[i])
        m = client.metrics.codec_wire_bytes.labels("sign1").value
        raw = client.metrics.codec_raw_bytes.labels("sign1").value
        assert raw == 3 * 3000 * 4
        assert m == 3 * sum(sign1.payload_bytes(k.length, 64) for k in plan.keys
                            if k.name != "bias")
        scraped = _scrape(client.metrics.registry)
        assert scraped["bitps_worker_compression_ratio"][()] == pytest.approx(raw / m)
        norms = {k.shard: 0.0 for k in plan.keys}
        for i, k in enumerate(plan.keys):
            if k.name != "bias":
                norms[k.shard] = float(np.hypot(norms[k.shard], np.linalg.norm(residuals[i])))
        for shard, norm in norms.items():
            assert scraped["bitps_worker_residual_norm"][(("shard", str(shard)),)] == \
                pytest.approx(norm, rel=1e-5)
        assert "bitps_worker_onebit_phase" not in scraped
    decoded = sum(s.core.metrics.codec_decoded_bytes.labels("sign1").value for s in shards)
    wire = sum(s.core.metrics.codec_wire_bytes.labels("sign1").value for s in shards)
    assert decoded == raw and wire == m


def _scrape(registry) -> dict:
    """``{metric name: {labels tuple: value}}`` parsed from the registry's exposition text."""
    out: dict = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.mark.parametrize("name", ["bf16", "fp16", "sparse"])
def test_other_codecs_train_a_key_through_the_shard(shards, name):
    """Every codec decodes on the shard to within its rounding of the pushed gradient."""
    plan = make_plan([ParamSpec("w", (5000,))], num_shards=2, partition_bytes=8192)
    cfg = ClientConfig(servers=tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards),
                       partition_bytes=8192, compress_min_bytes=0,
                       push_codec=CodecConfig(name=name, chunk=256))
    keys = [k.key for k in plan.keys]
    zeros = {k.key: np.zeros(k.length, np.float32) for k in plan.keys}
    grads = [np.random.default_rng(k.key).standard_normal(k.length).astype(np.float32)
             for k in plan.keys]
    outs = [np.empty(k.length, np.float32) for k in plan.keys]
    with EncodingClient(cfg) as client:
        client.register(plan, zeros)
        client.push_pull(keys, grads, outs, clock=0).wait()
        kept = client.residuals()
    for k, g, out in zip(plan.keys, grads, outs):
        # parameters = -lr * decoded, and decoded + residual == gradient (error feedback)
        np.testing.assert_allclose(-out / LR + kept[k.key], g, rtol=0, atol=1e-5, err_msg=name)
        assert np.count_nonzero(out) > (0.1 if name == "sparse" else 0.99) * k.length


@pytest.mark.parametrize("codec", ["sign1", "bf16"])
def test_psmodel_device_codec_path_trains_like_the_host_path(codec):
    """PSModel's GPU path (torch-ops codec next to the gradients, caller-kept error feedback)
    run on CPU tensors: the same bytes reach the shard as from the host path (numba kernels), so
    the two trainings end bit-identical."""
    torch = pytest.importorskip("torch")
    from bitps.worker.training.model import PSModel

    def train(device_codec: bool):
        shard = create_server(ServerConfig(mode="sync", metrics_port=-1,
                                           optimizer=OptimizerConfig(name="sgd", lr=0.05)))
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                        torch.nn.Linear(64, 4))
            cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                               partition_bytes=4096, compress_min_bytes=1024,
                               push_codec=CodecConfig(name=codec, chunk=64))
            with PSClient(cfg) as client:
                ps_model = PSModel(model, client, device_codec=device_codec)
                assert ps_model.device_codec == device_codec
                data = torch.Generator().manual_seed(1)
                for _ in range(6):
                    x = torch.randn(16, 32, generator=data)
                    loss = model(x).square().mean()
                    loss.backward()
                    ps_model.step()
                ps_model.synchronize()  # auto may have turned overlap on: pushes in flight
                sent = client.metrics.codec_wire_bytes.labels(codec).value
            return [p.detach().clone() for p in model.parameters()], sent
        finally:
            shard.stop(0)

    host, host_bytes = train(False)
    device, device_bytes = train(True)
    assert host_bytes == device_bytes > 0
    for a, b in zip(host, device):
        assert torch.equal(a, b)


def test_nonfinite_gradient_is_refused_on_the_worker_unless_it_arrives_encoded(shards):
    """A compressed push holding NaN never reaches the error-feedback residual (NON_FINITE
    on the worker, counted); a key that arrives already encoded (the device codec: its host
    gradient is not filled) is not read."""
    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.wire import PSError

    plan = make_plan([ParamSpec("big", (2048,))], num_shards=2, partition_bytes=4096)
    cfg = ClientConfig(servers=tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards),
                       partition_bytes=4096, compress_min_bytes=0,
                       push_codec=CodecConfig(name="sign1", chunk=64))
    keys = [k.key for k in plan.keys]
    init = np.zeros(2048, np.float32)
    with EncodingClient(cfg) as client:
        client.register(plan, {k.key: init[k.offset:k.offset + k.length] for k in plan.keys})
        grads = [np.ones(k.length, np.float32) for k in plan.keys]
        client.push(keys, grads, clock=0).wait()
        kept = {k: r.copy() for k, r in client.residuals().items()}
        grads[1][5] = np.inf
        with pytest.raises(PSError, match=f"key {keys[1]}: gradient holds NaN or Inf") as err:
            client.push(keys, grads, clock=1)
        assert err.value.code == pb.NON_FINITE and client.metrics.nonfinite.value == 1
        assert all(np.array_equal(kept[k], r) for k, r in client.residuals().items())
        code = sign1.encode_reference(np.ones(1024, np.float32), np.zeros(1024, np.float32),
                                      chunk=64)[0]
        client.push(keys, grads, clock=1, encoded={keys[1]: code}).wait()
        assert client.metrics.nonfinite.value == 1


def test_psmodel_device_codec_refuses_a_nonfinite_gradient_before_its_residual():
    """The device codec keeps error feedback next to the gradients: a NaN gradient is refused
    (NON_FINITE, counted) before it reaches them, and training goes on from the same state."""
    torch = pytest.importorskip("torch")
    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.wire import PSError
    from bitps.worker.training.model import PSModel

    shard = create_server(ServerConfig(mode="async", metrics_port=-1,
                                       optimizer=OptimizerConfig(name="sgd", lr=0.05)))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        cfg = ClientConfig(servers=(f"127.0.0.1:{shard.ports['grpc_port']}",),
                           partition_bytes=4096, compress_min_bytes=0,
                           push_codec=CodecConfig(name="sign1", chunk=64))
        with PSClient(cfg) as client:
            ps_model = PSModel(model, client, device_codec=True)
            model(torch.ones(4, 64)).sum().backward()
            ps_model.step()
            kept = {k: r.clone() for k, r in ps_model._staging.residuals.items()}
            params = [p.detach().clone() for p in model.parameters()]
            model(torch.full((4, 64), float("nan"))).sum().backward()
            with pytest.raises(PSError, match="gradient holds NaN or Inf") as err:
                ps_model.step()
            assert err.value.code == pb.NON_FINITE and client.metrics.nonfinite.value == 1
            assert kept.keys() == ps_model._staging.residuals.keys()
            assert all(torch.equal(kept[k], r) for k, r in ps_model._staging.residuals.items())
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            model.zero_grad()
            model(torch.ones(4, 64)).sum().backward()
            ps_model.step()
            assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    finally:
        shard.stop(0)


def test_every_key_of_a_tensor_over_compress_min_bytes_is_compressed_by_default(shards):
    """Acceptance 5: the 1 MiB rule is about one communication's size, not a partition's. A
    1.5 MiB tensor is cut into keys under 1 MiB; with the default compress_min_bytes (1 MiB)
    all of them go sign1, and the 512 KiB tensor beside it goes raw."""
    big, small = 3 << 17, 1 << 17  # elements: 1.5 MiB and 512 KiB of float32
    plan = make_plan([ParamSpec("big", (big,)), ParamSpec("small", (small,))], num_shards=2)
    names = [k.name for k in plan.keys]
    assert names.count("big") >= 2 and names[-1] == "small"
    assert all(k.nbytes < 1 << 20 for k in plan.keys)
    cfg = ClientConfig(servers=tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards),
                       push_codec=CodecConfig(name="sign1"))
    assert cfg.compress_min_bytes == 1 << 20
    keys = [k.key for k in plan.keys]
    with EncodingClient(cfg) as client:
        client.register(plan, {k.key: np.zeros(k.length, np.float32) for k in plan.keys})
        assert [client.compresses(k, 0) for k in keys] == [n == "big" for n in names]
        grads = [np.ones(k.length, np.float32) for k in plan.keys]
        client.push(keys, grads, clock=0).wait()
    decoded = sum(s.core.metrics.codec_decoded_bytes.labels("sign1").value for s in shards)
    assert decoded == big * 4  # both keys of "big" arrived compressed, "small" did not
