"""``python -m bitps.bench.gpu_check``: the overlap checks on the CUDA stream path, for a machine
with a GPU; on one without, it says so and checks nothing.

1. **No race** (issue 4, acceptance 3): with overlap on, what the communication thread sends for
   every bucket (hashed when sent and again once answered) equals the bytes computed from a
   copy of the gradients taken after backward returned: raw pushes, and sign1 compressed on the
   device with error feedback (replayed by the numpy reference). ``tests/test_overlap.py`` runs
   the same function on the CPU.
2. **Same result**: in sync mode, parameters after 20 steps are bit-identical with overlap on
   and off (the model on the GPU, one worker).
3. **Activation pool**: gradients bit-identical with the pool at a 50 % budget (offloads through
   pinned memory on a side stream) and without it (issue 5's CUDA path).
4. **NaN refused before the device residual**: the device codec (sign1 next to the gradients)
   refuses a NaN gradient with ``NON_FINITE`` and leaves its on-device residuals unchanged.
5. **Clipping under overlap on the device codec**: buckets leave with predicted clip factors
   and the corrections land in the on-device residuals; what the shard received plus the
   residuals equals the exactly clipped gradients (``tests/test_clip.py`` runs it on the CPU).
6. **Compressed pulls**: sign1 codes applied to the pinned host copies and uploaded leave the
   worker's copy and its model bit-identical to the shard's.
6b. **Weight prediction** (issue 26): two async workers computing with predicted parameters
   (made in a second pinned buffer and uploaded) keep copies bit-identical to the shards', and
   their models hold exactly the prediction, overlap off and on.
7. The CUDA codec tests (``tests/test_codec_torch.py``, skipped on machines without CUDA).
8. ``bitps-bench overlap --device cuda`` (unless ``--no-bench``).

Writes ``<out>/gpu_check.json`` and ``.md`` (``--out``, default ``bench/results``) and exits
non-zero when a check fails. ``--device cpu`` runs checks 1-6 on the CPU (a dry run of the
script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from bitps.bench.report import check, write_results

__all__ = ["clipped_sum_problems", "main", "nonfinite_refused", "predicted_copies_match",
           "pulled_copies_match", "pushed_bytes_match", "sync_result"]


def _digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()


def _recording_client(cfg):
    """A ``PSClient`` that hashes every payload the communication thread sends, as sent and
    again once the exchange is answered (``sent``: clock, keys, the two digests by key). The
    buffers may be reused after the answer (pinned gradient buffers on CUDA), not before."""
    from bitps.worker.transport.client import Encoded, PSClient

    class Recording(PSClient):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.sent: list[tuple[int, list[int], list[str], list[str]]] = []

        def push_pull(self, keys, grads, outs, *, clock):
            if threading.current_thread().name != "bitps-comm":
                raise AssertionError("a bucket was pushed off the communication thread")
            arrays = list(grads.payloads if isinstance(grads, Encoded) else grads)
            answered: list[str] = []
            self.sent.append((clock, list(keys), [_digest(a) for a in arrays], answered))
            handle = super().push_pull(keys, grads, outs, clock=clock)
            wait = handle.wait

            def answered_wait(timeout=None):  # returns once answered: hash again then
                wait(timeout)
                if not answered:
                    answered.extend(_digest(a) for a in arrays)

            handle.wait = answered_wait
            return handle

    return Recording(cfg)


def _demo(device):
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn

    demo = DemoConfig(seq_len=32, batch_size=4, corpus_bytes=100_000)
    corpus = load_corpus(demo.corpus_bytes)
    data = batches(corpus, batch_size=4, seq_len=32, rank=0, world_size=1, seed=0)
    batch = (lambda: [t.to(device) for t in next(data)])
    return build_model(demo).to(device), batch, loss_fn


def pushed_bytes_match(server: str, *, device: str = "cpu", codec: str = "raw",
                       steps: int = 6) -> list[str]:
    """Train the demo model ``steps`` steps with overlap on against the shard at ``server``
    (async, any update rule) and return every difference between what was pushed and what a
    synchronous copy of the gradients gives (empty = no race)."""
    import torch

    from bitps.native import sign1
    from bitps.proto.codecs import CodecConfig
    from bitps.worker.config import ClientConfig, OverlapConfig
    from bitps.worker.training.model import PSModel

    chunk = 64
    cfg = ClientConfig(servers=(server,), partition_bytes=8 << 10, compress_min_bytes=4096,
                       clip_norm=0.0, push_codec=CodecConfig(name=codec, chunk=chunk))
    client = _recording_client(cfg)
    model, batch, loss_fn = _demo(torch.device(device))
    ps_model = PSModel(model, client, device_codec=codec == "sign1",
                       overlap=OverlapConfig(mode="on", bucket_bytes=16 << 10))
    plan = ps_model.plan
    tensor_bytes = {n: p.numel() * 4 for n, p in ps_model.params}
    residual = {k.key: np.zeros(k.length, np.float32) for k in plan.keys}
    expected: dict[tuple[int, int], str] = {}
    for step in range(steps):
        loss_fn(model, *batch()).backward()
        # the synchronous copy: backward has returned, the device is idle
        flat = {n: p.grad.detach().reshape(-1).cpu().clone().numpy() for n, p in ps_model.params}
        for k in plan.keys:
            g = flat[k.name][k.offset:k.offset + k.length]
            if codec == "sign1" and tensor_bytes[k.name] >= cfg.compress_min_bytes:
                payload, residual[k.key] = sign1.encode_reference(g, residual[k.key],
                                                                  chunk=chunk)
                expected[step, k.key] = hashlib.sha256(payload).hexdigest()
            else:
                expected[step, k.key] = _digest(g)
        ps_model.step()
    ps_model.synchronize()
    problems: list[str] = []
    seen: dict[tuple[int, int], str] = {}
    per_clock: dict[int, list[tuple[int, ...]]] = {}
    for clock, keys, digests, answered in client.sent:
        per_clock.setdefault(clock, []).append(tuple(keys))
        for i, (key, digest) in enumerate(zip(keys, digests)):
            if (clock, key) in seen:
                problems.append(f"clock {clock} key {key}: pushed twice")
            seen[clock, key] = digest
            if i >= len(answered):
                problems.append(f"clock {clock} key {key}: never answered")
            elif digest != answered[i]:
                problems.append(f"clock {clock} key {key}: changed while in flight")
    for where, digest in expected.items():
        if seen.get(where) != digest:
            problems.append(f"clock {where[0]} key {where[1]}: pushed bytes differ from the "
                            f"synchronous copy" if where in seen else
                            f"clock {where[0]} key {where[1]}: never pushed")
    buckets = sorted(tuple(b.keys) for b in ps_model.buckets)
    for clock, pushes in per_clock.items():
        if sorted(pushes) != buckets:
            problems.append(f"clock {clock}: pushes {sorted(pushes)} are not the buckets")
    ps_model.close()
    return problems


def sync_result(server_for_run, *, device: str = "cpu", steps: int = 20) -> bool:
    """Whether ``steps`` steps of the demo model against a fresh sync shard end with the same
    parameters, bit for bit, with overlap off and on. ``server_for_run()`` starts a sync shard
    and returns its ``host:port``."""
    import torch

    from bitps.worker.config import ClientConfig, OverlapConfig
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    finals = []
    for mode in ("off", "on"):
        model, batch, loss_fn = _demo(torch.device(device))
        client = PSClient(ClientConfig(servers=(server_for_run(),), partition_bytes=16 << 10))
        ps_model = PSModel(model, client, overlap=OverlapConfig(mode=mode,
                                                                bucket_bytes=32 << 10))
        for _ in range(steps):
            loss_fn(model, *batch()).backward()
            ps_model.step()
        ps_model.synchronize()
        finals.append([p.detach().cpu().clone() for p in model.parameters()])
        ps_model.close()
    return all(torch.equal(a, b) for a, b in zip(*finals))


def pool_gradients_match(*, device: str = "cpu", budget: float = 0.5, steps: int = 3) -> bool:
    """Whether the demo model's gradients are bit-identical with the activation pool at
    ``budget`` of the activation peak (offloads to host memory: pinned buffers and a side
    stream on CUDA) and without it."""
    import torch

    from bitps.worker.config import PoolConfig
    from bitps.worker.memory.pool import ActivationPool

    small = dict(min_block=4096, max_block=2 << 20, min_tensor_bytes=1024)
    results = []
    peak = 0
    for capacity in (None, 256 << 20, "budget"):
        model, batch, loss_fn = _demo(torch.device(device))
        pool = None
        if capacity is not None:
            size = int(peak * budget) if capacity == "budget" else capacity
            pool = ActivationPool(PoolConfig(capacity_bytes=size, **small), device=device,
                                  params=model.parameters())
        grads = []
        for _ in range(steps):
            with pool.hooks() if pool else contextlib.nullcontext():
                loss = loss_fn(model, *batch())
            loss.backward()
            grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        if capacity == 256 << 20:
            peak = pool.stats().peak_requested
        if capacity == "budget" and pool.stats().evictions == 0:
            return False  # the budget did not force offloads: nothing was checked
        results.append(grads)
    return all(torch.equal(a, b) for ref, got in zip(results[0], results[2])
               for a, b in zip(ref, got))


def nonfinite_refused(server: str, *, device: str = "cpu") -> bool:
    """Whether ``PSModel``'s device codec refuses a NaN gradient (``NON_FINITE``) and keeps its
    error-feedback residuals (on ``device``) as they were."""
    import torch

    from bitps.proto import bitps_pb2 as pb
    from bitps.proto.codecs import CodecConfig
    from bitps.proto.wire import PSError
    from bitps.worker.config import ClientConfig
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    dev = torch.device(device)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 64).to(dev)
    cfg = ClientConfig(servers=(server,), compress_min_bytes=0,
                       push_codec=CodecConfig(name="sign1", chunk=256))
    with PSClient(cfg) as client:
        ps_model = PSModel(model, client, device_codec=True)
        model(torch.ones(4, 256, device=dev)).sum().backward()
        ps_model.step()
        kept = {k: r.clone() for k, r in ps_model._staging.residuals.items()}
        model.zero_grad()
        model(torch.full((4, 256), float("nan"), device=dev)).sum().backward()
        try:
            ps_model.step()
            return False
        except PSError as err:
            refused = err.code == pb.NON_FINITE
        return refused and bool(kept) and all(torch.equal(kept[k], r)
                                              for k, r in ps_model._staging.residuals.items())


def clipped_sum_problems(server: str, *, device: str = "cpu", codec: str = "sign1",
                         device_codec: bool = False, mode: str = "on",
                         steps: int = 12) -> list[str]:
    """Clipping under overlap (``worker.training.clip``): train a small net with clipping in force
    at varying strength (gradient norms vary 30x between steps) against the shard at ``server``
    (async, SGD with lr 1, so its parameters fall by exactly what it received) and return what
    breaks the invariant: received plus the worker's residuals = the exactly clipped gradients
    summed (empty = it holds). Pulls are float32, so the shard's parameters are its updates."""
    import torch

    from bitps.proto.codecs import CodecConfig
    from bitps.worker.config import ClientConfig, OverlapConfig
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    dev = torch.device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64),
                                                                  torch.nn.Tanh())],
                                torch.nn.Linear(64, 8)).to(dev)
    start = [p.detach().double().cpu() for p in model.parameters()]
    client = PSClient(ClientConfig(servers=(server,), partition_bytes=4096,
                                   compress_min_bytes=1024, clip_norm=0.5,
                                   push_codec=CodecConfig(name=codec, chunk=64),
                                   pull_codec=CodecConfig(name="raw")))
    # hold_when_clipping off: every step's buckets go from the hooks with predicted factors
    ps_model = PSModel(model, client, device_codec=device_codec,
                       overlap=OverlapConfig(mode=mode, bucket_bytes=8192,
                                             hold_when_clipping="off"))
    corrected = []
    correct = ps_model.encoder.clip_correct

    def counting(keys, grads, *, clock, used, exact):
        corrected.append(used != exact)
        correct(keys, grads, clock=clock, used=used, exact=exact)

    ps_model.encoder.clip_correct = counting
    gen = torch.Generator().manual_seed(1)
    clipped = [torch.zeros_like(p, dtype=torch.float64) for p in start]
    factors = []
    for step in range(steps):
        x = torch.randn(16, 64, generator=gen).to(dev)
        (model(x).square().sum() * (0.1, 1.0, 3.0)[step % 3]).backward()
        grads = [p.grad.detach().double().cpu() for p in model.parameters()]
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads)))
        factors.append(min(1.0, 0.5 / (norm + 1e-6)))
        for acc, g in zip(clipped, grads):
            acc += factors[-1] * g
        ps_model.step()
    ps_model.synchronize()
    residual = {**ps_model.encoder.residuals(),
                **{k: r.cpu().numpy() for k, r in ps_model._staging.residuals.items()}}
    got = [p0 - p.detach().double().cpu() for p0, p in zip(start, model.parameters())]
    for k in ps_model.plan.keys:
        got[ps_model._staging.index[k.name]].view(-1)[k.offset:k.offset + k.length] += \
            torch.from_numpy(residual[k.key]).double()
    names = [n for n, _ in model.named_parameters()]
    ps_model.close()
    problems = []
    if not (min(factors) < 0.2 and max(factors) > 0.3):
        problems.append(f"clipping was not in force at varying strength: {factors}")
    if any(corrected) != (mode == "on"):
        problems.append(f"corrections {'missing' if mode == 'on' else 'made'} with overlap "
                        f"{mode}")
    if len(residual) != len(ps_model.plan.keys):
        problems.append(f"{len(residual)} residuals for {len(ps_model.plan.keys)} keys")
    for name, a, b in zip(names, got, clipped):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            problems.append(f"{name}: received + residual differ from the clipped sum by "
                            f"{float((a - b).abs().max()):.3g}")
    return problems


def pulled_copies_match(server_for_run, *, device: str = "cpu", steps: int = 8) -> list[str]:
    """Compressed pulls on ``device``: a worker trains the demo model with overlap on, sign1
    pushes and pulls (the device codec on CUDA) against the shard ``server_for_run()`` starts
    (it returns the address and the shard's core); return the keys whose worker copy (the
    pinned host buffer on CUDA) or model parameters differ from the shard's after a last pull
    (empty = bit-identical)."""
    import torch

    from bitps.proto.codecs import CodecConfig
    from bitps.worker.config import ClientConfig, OverlapConfig
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    server, core = server_for_run()
    problems = []
    model, batch, loss_fn = _demo(torch.device(device))
    client = PSClient(ClientConfig(servers=(server,), compress_min_bytes=0,
                                   push_codec=CodecConfig(name="sign1")))
    ps_model = PSModel(model, client, overlap=OverlapConfig(mode="on"))
    for _ in range(steps):
        loss_fn(model, *batch()).backward()
        ps_model.step()
    ps_model.synchronize()
    client.pull(ps_model.keys, ps_model._staging.outs, clock=ps_model.clock).wait()
    ps_model._staging.copy_in()
    for k in ps_model.plan.keys:
        shard = core.slots[k.key].param
        if not np.array_equal(ps_model._staging.outs[k.key], shard):
            problems.append(f"key {k.key}: worker copy differs from the shard")
        on_model = dict(model.named_parameters())[k.name].detach().reshape(-1)
        if not np.array_equal(on_model[k.offset:k.offset + k.length].cpu().numpy(), shard):
            problems.append(f"key {k.key}: model parameters differ from the shard")
    if core.slots[0].publisher is None:
        problems.append("the shard published no codes")
    ps_model.close()
    return problems


def _model_slice(ps_model, k) -> np.ndarray:
    """Key ``k``'s part of ``ps_model``'s parameters, on the host."""
    flat = dict(ps_model.model.named_parameters())[k.name].detach().reshape(-1)
    return flat[k.offset:k.offset + k.length].cpu().numpy()


def _predicted_rank(ps_model, batch, loss_fn, cores, barrier, *, steps: int) -> list[str]:
    """One worker of :func:`predicted_copies_match`: train, pull once more, compare."""
    import torch

    for _ in range(steps):
        loss_fn(ps_model.model, *batch()).backward()
        ps_model.step()
    ps_model.synchronize()
    barrier.wait()  # both pushed everything: one more pull sees the end
    ps_model.client.pull(ps_model.keys, ps_model._staging.outs, clock=ps_model.clock).wait()
    ps_model._staging.copy_in()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prediction = ps_model._staging.prediction
    if prediction is None:
        return ["no weight prediction (the shards did not ask)"]
    slots = {k: slot for core in cores for k, slot in core.slots.items()}
    problems, ahead = [], False
    for k in ps_model.plan.keys:
        if not np.array_equal(prediction.exact[k.key], slots[k.key].param):
            problems.append(f"key {k.key}: worker copy differs from the shard")
        if not np.array_equal(_model_slice(ps_model, k), prediction.shown[k.key]):
            problems.append(f"key {k.key}: model differs from the prediction")
        ahead = ahead or not np.array_equal(prediction.shown[k.key], prediction.exact[k.key])
    if not ahead:
        problems.append("the prediction is the exact copy for every key")
    exact = {k.key: prediction.exact[k.key].copy() for k in ps_model.plan.keys}
    ps_model.close()  # the model becomes the exact copy
    problems.extend(f"key {k.key}: model not exact after close" for k in ps_model.plan.keys
                    if not np.array_equal(_model_slice(ps_model, k), exact[k.key]))
    return problems


def predicted_copies_match(servers: tuple[str, ...], cores, *, device: str = "cpu",
                           overlap: str = "on", steps: int = 8) -> list[str]:
    """Weight prediction on ``device`` (issue 26): two workers (threads) train the demo model
    with sign1 pushes and pulls against async shards at ``servers`` (``cores``: their
    ``ShardCore``), computing with predicted parameters (``worker.training.prediction``; on
    CUDA made in a second pinned buffer and uploaded). Returns the problems, none when: after a
    last pull every worker copy (the pinned host buffer on CUDA) equals its shard's values bit
    for bit, the model's parameters equal the prediction uploaded, which is ahead of the copy,
    and after close the model holds the exact copy."""
    import torch

    from bitps.proto.codecs import CodecConfig
    from bitps.worker.config import ClientConfig, EncoderConfig, OverlapConfig
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    encoder = EncoderConfig(push_codec=CodecConfig(name="sign1", chunk=64), compress_min_bytes=0)
    problems: list[str] = []
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        ps_model = None
        try:
            model, batch, loss_fn = _demo(torch.device(device))
            client = PSClient(ClientConfig(servers=servers, rank=r, world_size=2))
            ps_model = PSModel(model, client, encoder=encoder,
                               overlap=OverlapConfig(mode=overlap))
            problems.extend(f"rank {r}: {p}" for p in _predicted_rank(
                ps_model, batch, loss_fn, cores, barrier, steps=steps))
        except BaseException as err:  # noqa: BLE001 - reported as a problem
            problems.append(f"rank {r}: {type(err).__name__}: {err}")
            barrier.abort()
        finally:
            if ps_model is not None:
                ps_model.close()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        if t.is_alive():
            problems.append(f"{t.name} still running after 300 s")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bitps.bench.gpu_check", description=__doc__.split(
        "\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (dry run)")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--no-bench", action="store_true", help="skip bitps-bench overlap")
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.gpu_check: no CUDA device on this machine; the CUDA stream path was NOT "
              "checked (run it on a machine with a GPU, or --device cpu for a dry run)")
        return 0
    from bitps.ps import OptimizerConfig, ServerConfig, create_server

    shards = []

    def shard(mode: str, name: str, shard_id: int = 0, num_shards: int = 1) -> str:
        lr = 1.0 if name == "sgd_lr1" else 0.01  # lr 1: the parameters fall by what arrived
        s = create_server(ServerConfig(
            mode=mode, metrics_port=-1, shard_id=shard_id, num_shards=num_shards,
            optimizer=OptimizerConfig(name=name.removesuffix("_lr1"), lr=lr)))
        shards.append(s)
        return f"127.0.0.1:{s.ports['grpc_port']}"

    checks, rows = {}, []
    try:
        for codec in ("raw", "sign1"):
            problems = pushed_bytes_match(shard("async", "sgd"), device=args.device, codec=codec)
            rows.append({"check": f"pushed bytes = synchronous copy ({codec})",
                         "result": "; ".join(problems[:3]) or "match"})
            checks[f"no_race_{codec}"] = check(len(problems), "0 differences", not problems)
        same = sync_result(lambda: shard("sync", "adam"), device=args.device)
        rows.append({"check": "sync: overlap on == off after 20 steps",
                     "result": "bit-identical" if same else "DIFFERENT"})
        checks["sync_overlap_on_equals_off"] = check(same, "True", same)
        pooled = pool_gradients_match(device=args.device)
        rows.append({"check": "activation pool at 50 % budget: gradients == pool off",
                     "result": "bit-identical" if pooled else "DIFFERENT or no offload"})
        checks["pool_gradients_identical"] = check(pooled, "True", pooled)
        refused = nonfinite_refused(shard("async", "sgd"), device=args.device)
        rows.append({"check": "device codec: NaN refused, residuals unchanged",
                     "result": "refused" if refused else "NOT refused or residual changed"})
        checks["device_codec_refuses_nan"] = check(refused, "True", refused)
        problems = clipped_sum_problems(shard("async", "sgd_lr1"), device=args.device,
                                        device_codec=True)
        rows.append({"check": "clipping under overlap (device codec): received + residuals "
                              "= clipped sum", "result": "; ".join(problems[:3]) or "holds"})
        checks["clip_under_overlap_device_codec"] = check(len(problems), "0 problems",
                                                          not problems)

        def published():
            address = shard("async", "adam")
            return address, shards[-1].core

        problems = pulled_copies_match(published, device=args.device)
        rows.append({"check": "compressed pulls: worker copies == shard after overlap",
                     "result": "; ".join(problems[:3]) or "bit-identical"})
        checks["compressed_pulls_bit_identical"] = check(len(problems), "0 differences",
                                                         not problems)
        for overlap in ("off", "on"):
            servers = tuple(shard("async", "adam", i, 2) for i in range(2))
            problems = predicted_copies_match(servers, [s.core for s in shards[-2:]],
                                              device=args.device, overlap=overlap)
            rows.append({"check": f"weight prediction, 2 async workers, overlap {overlap}: "
                                  "copies == shard, model == prediction",
                         "result": "; ".join(problems[:3]) or "bit-identical"})
            checks[f"prediction_overlap_{overlap}"] = check(len(problems), "0 problems",
                                                            not problems)
    finally:
        for s in shards:
            s.stop(0)
    if args.device.startswith("cuda"):
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_codec_torch.py"])
        rows.append({"check": "tests/test_codec_torch.py on CUDA", "result": f"exit {code}"})
        checks["codec_torch_cuda_tests"] = check(code, "exit 0", code == 0)
        if not args.no_bench:
            code = subprocess.call([sys.executable, "-m", "bitps.bench", *(
                ["--out", str(args.out)] if args.out else []), "overlap", "--device", "cuda"])
            rows.append({"check": "bitps-bench overlap --device cuda", "result": f"exit {code}"})
            checks["overlap_bench_cuda"] = check(code, "exit 0", code == 0)
    write_results("gpu_check", config={"device": args.device,
                                       "cuda": torch.cuda.get_device_name(0)
                                       if torch.cuda.is_available() else None},
                  rows=rows, checks=checks, out=args.out,
                  columns=[("check", "check"), ("result", "result")])
    for row in rows:
        print(f"{row['check']}: {row['result']}")
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
