"""``bitps-worker``: one worker rank training the demo model (a tiny Qwen3-MoE on a byte corpus).

The one place that reads worker flags and environment variables. Rank and world size come from
``--rank``/``--world-size``, else torchrun's ``RANK``/``WORLD_SIZE``; the servers from
``--servers`` or ``BITPS_SERVERS``. With ``--json`` it prints one JSON object per line on stdout
(``start``, ``step`` every ``--log-every`` steps, ``done`` whose ``final_loss`` is the mean of
the last 10 steps and which counts the bytes pushed on the wire and pulled), which
``bitps-launch`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections import deque

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="bitps-worker",
                                description="Train the bitps demo model as one worker rank.")
    add = p.add_argument
    add("--servers", default=env("BITPS_SERVERS", ""),
        help="comma-separated gRPC host:port of every shard, in shard-id order")
    add("--rank", type=int, default=int(env("RANK", "0")), help="worker rank (env RANK)")
    add("--world-size", type=int, default=int(env("WORLD_SIZE", "1")),
        help="number of worker ranks (env WORLD_SIZE)")
    add("--steps", type=int, default=int(env("BITPS_STEPS", "150")), help="training steps")
    add("--batch-size", type=int, default=8, help="sequences per step per rank")
    add("--seq-len", type=int, default=128, help="bytes per sequence")
    add("--corpus-bytes", type=int, default=2_000_000, help="corpus byte budget")
    add("--seed", type=int, default=0, help="model init seed (data seed = seed, rank)")
    add("--threads", type=int, default=int(env("BITPS_THREADS", "1")), help="torch CPU threads")
    add("--local-rank", type=int, default=int(env("LOCAL_RANK", "0")),
        help="GPU index on this host (env LOCAL_RANK)")
    add("--device", default=env("BITPS_DEVICE", "auto"),
        help="torch device; auto = cuda:<local rank> when CUDA is available, else cpu")
    add("--metrics-port", type=int, default=int(env("BITPS_METRICS_PORT", "0")),
        help="Prometheus port; 0 = any free port, -1 = off")
    add("--metrics-host", default=env("BITPS_METRICS_HOST", "127.0.0.1"))
    add("--token", default=env("BITPS_TOKEN", ""), help="shared secret of the shards")
    add("--deadline", type=float, default=60.0, help="seconds any push/pull may wait")
    add("--step-delay", type=float, default=0.0,
        help="extra seconds of sleep per step (simulates a straggler)")
    add("--push-codec", default=env("BITPS_PUSH_CODEC", "raw"),
        choices=("raw", "bf16", "fp16", "sign1", "sparse"),
        help="gradient codec, with error feedback (a onebit_adam shard overrides it)")
    add("--pull-codec", default=env("BITPS_PULL_CODEC", "push"),
        choices=("push", "raw", "bf16", "fp16", "sign1", "sparse"),
        help="codec the shards publish parameter updates with for pulls (their own error "
             "feedback; workers stay bit-identical); push = the push codec's")
    add("--codec-chunk", type=int, default=int(env("BITPS_CODEC_CHUNK", "2048")),
        help="elements per scale chunk (sign1, sparse)")
    add("--sign1-scale", default="rms", choices=("rms", "mean_abs"), help="sign1 scale rule")
    add("--sparse-values", default="natexp8", choices=("natexp8", "bf16"),
        help="sparse value encoding")
    add("--compress-min-bytes", type=int,
        default=int(env("BITPS_COMPRESS_MIN_BYTES", str(1 << 20))),
        help="tensors smaller than this go uncompressed; every key of a larger one is "
             "compressed")
    add("--clip-norm", type=float, default=1.0,
        help="clip the local gradient to this L2 norm before error feedback (0 = off)")
    add("--codec-seed", type=int, default=0, help="seed of sparse sampling and rounding")
    add("--overlap", default=env("BITPS_OVERLAP", "auto"), choices=("auto", "on", "off"),
        help="push buckets from backward hooks; auto = on when communication exceeds "
             "--overlap-min-ratio of compute, measured over the first steps")
    add("--overlap-min-ratio", type=float, default=0.2,
        help="auto overlap: the communication/compute ratio above which overlap turns on")
    add("--bucket-bytes", type=int, default=1 << 20, help="overlap: bytes per gradient bucket")
    add("--inflight-bytes", type=int, default=2 << 20,
        help="overlap: gradient bytes in flight before the next bucket waits")
    add("--profile", default="",
        help="directory: write a torch.profiler trace of --profile-steps steps (after 2 "
             "warm-up steps) to DIR/trace-rank<R>.json and print the top operators")
    add("--profile-steps", type=int, default=5, help="steps the profiler records")
    add("--activation-pool", action="store_true",
        default=env("BITPS_ACTIVATION_POOL", "") not in ("", "0"),
        help="keep saved activations in a pre-reserved arena with host offload "
             "(env BITPS_ACTIVATION_POOL=1)")
    add("--pool-capacity", type=int, default=0,
        help="arena bytes; 0 = --pool-fraction of the device's memory")
    add("--pool-fraction", type=float, default=0.3, help="share of device memory for the arena")
    add("--pool-allocator", default="buddy", choices=("buddy", "bestfit"))
    add("--pool-policy", default="lru", choices=("lru", "schedule"),
        help="what to offload under pressure")
    add("--pool-min-block", type=int, default=4 << 20, help="buddy: smallest block")
    add("--pool-min-tensor-bytes", type=int, default=1 << 20,
        help="saved tensors below this stay with the framework allocator")
    add("--log-every", type=int, default=10, help="progress line every N steps")
    add("--json", action="store_true", help="print JSON progress lines (for bitps-launch)")
    return p


def _emit(args, **event) -> None:
    if args.json:
        print(json.dumps(event), flush=True)
    elif event["event"] == "step":
        logging.info("rank %d step %d loss %.4f %.1f samples/s", event["rank"], event["step"],
                     event["loss"], event["samples_per_s"])
    else:
        logging.info("%s", event)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    servers = tuple(s for s in args.servers.split(",") if s)

    import torch
    from bitps.proto.codecs import CodecConfig
    from bitps.worker.client import PSClient
    from bitps.worker.config import ClientConfig, OverlapConfig, PoolConfig
    from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn
    from bitps.worker.model import PSModel
    from prometheus_client import start_http_server

    try:
        codec = CodecConfig(name=args.push_codec, chunk=args.codec_chunk,
                            scale=args.sign1_scale, values=args.sparse_values)
        pull = None if args.pull_codec == "push" else CodecConfig(
            name=args.pull_codec, chunk=args.codec_chunk, scale=args.sign1_scale,
            values=args.sparse_values)
        cfg = ClientConfig(servers=servers, rank=args.rank, world_size=args.world_size,
                           token=args.token, deadline_s=args.deadline, push_codec=codec,
                           pull_codec=pull,
                           compress_min_bytes=args.compress_min_bytes,
                           clip_norm=args.clip_norm, codec_seed=args.codec_seed)
        overlap = OverlapConfig(mode=args.overlap, min_ratio=args.overlap_min_ratio,
                                bucket_bytes=args.bucket_bytes,
                                inflight_bytes=args.inflight_bytes)
        pool_cfg = PoolConfig(capacity_bytes=args.pool_capacity, fraction=args.pool_fraction,
                              allocator=args.pool_allocator, policy=args.pool_policy,
                              min_block=args.pool_min_block,
                              min_tensor_bytes=args.pool_min_tensor_bytes)
        if args.profile_steps < 1:
            raise ValueError(f"--profile-steps must be >= 1, got {args.profile_steps}")
        demo = DemoConfig(seq_len=args.seq_len, batch_size=args.batch_size,
                          corpus_bytes=args.corpus_bytes, seed=args.seed)
    except ValueError as err:
        print(f"bitps-worker: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    client = PSClient(cfg)
    metrics_port = -1
    if args.metrics_port >= 0:
        httpd, _ = start_http_server(args.metrics_port, addr=args.metrics_host,
                                     registry=client.metrics.registry)
        metrics_port = httpd.server_port
    device = torch.device(args.device if args.device != "auto" else
                          f"cuda:{args.local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    corpus = load_corpus(demo.corpus_bytes)
    model = build_model(demo).to(device)
    ps_model = PSModel(model, client, overlap=overlap)
    pool = None
    if args.activation_pool:
        from bitps.worker.pool import ActivationPool

        pool = ActivationPool(pool_cfg, device=device, params=model.parameters())
        client.metrics.registry.register(pool.collector())
    m = client.metrics
    _emit(args, event="start", rank=args.rank, metrics_port=metrics_port, device=str(device),
          params=sum(p.numel() for p in model.parameters()), keys=len(ps_model.keys),
          corpus_sha256=corpus.sha256, corpus_files=corpus.files,
          corpus_bytes=len(corpus.data))
    data = batches(corpus, batch_size=demo.batch_size, seq_len=demo.seq_len, rank=args.rank,
                   world_size=args.world_size, seed=demo.seed)
    first = last = None
    recent: deque[float] = deque(maxlen=10)
    profiler = _profiler(args, device) if args.profile else None
    utilization: deque[float] = deque(maxlen=10)
    t_start = time.perf_counter()
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            input_ids, labels = (t.to(device, non_blocking=True) for t in next(data))
            with pool.hooks() if pool is not None else contextlib.nullcontext():
                loss = loss_fn(model, input_ids, labels)
            loss.backward()
            if args.step_delay:
                time.sleep(args.step_delay)
            ps_model.step()
            utilization.append(ps_model.last_stats.utilization)
            if profiler is not None:
                profiler.step()
            dt = time.perf_counter() - t0
            last = loss.item()
            first = last if first is None else first
            recent.append(last)
            with m.lock:
                m.step_time.observe(dt)
                m.samples_per_s.set(demo.batch_size / dt)
                m.loss.set(last)
            if step % args.log_every == 0 or step == args.steps - 1:
                _emit(args, event="step", rank=args.rank, step=step, loss=last,
                      samples_per_s=demo.batch_size / dt, clock=ps_model.clock)
    finally:
        if profiler is not None:
            profiler.stop()
        ps_model.close()
    wall = time.perf_counter() - t_start
    wire = m.push_wire_bytes.value
    _emit(args, event="done", rank=args.rank, steps=args.steps, first_loss=first,
          final_loss=sum(recent) / max(len(recent), 1), last_loss=last, seconds=wall,
          samples_per_s=args.steps * demo.batch_size / wall,
          push_wire_bytes=wire, pull_bytes=m.pull_bytes.value,
          overlap=bool(ps_model.decision and ps_model.decision.enabled),
          overlap_decision=ps_model.decision.describe() if ps_model.decision else "",
          utilization=sum(utilization) / max(len(utilization), 1),
          pool=_pool_summary(pool))
    return 0


def _pool_summary(pool) -> dict | None:
    if pool is None:
        return None
    s = pool.stats()
    return {"stored": s.stored, "passthrough": s.passthrough, "fallbacks": s.fallbacks,
            "evicted_bytes": s.evicted_bytes, "fetched_bytes": s.fetched_bytes,
            "peak_requested": s.peak_requested, "internal_at_peak": s.internal_at_peak,
            "external_at_peak": s.external_at_peak}


def _profiler(args, device):
    """A started ``torch.profiler`` recording ``--profile-steps`` steps after 2 warm-up steps;
    when done it writes the Chrome trace to ``--profile``/trace-rank<R>.json and prints the
    top operators by self time on stderr (balance stages or buckets by what dominates)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"

    path = os.path.join(args.profile, f"trace-rank{args.rank}.json")
    os.makedirs(args.profile, exist_ok=True)

    def ready(prof) -> None:
        prof.export_chrome_trace(path)
        print(prof.key_averages().table(sort_by=sort, row_limit=15), file=sys.stderr)
        logging.info("profiler trace of %d steps written to %s", args.profile_steps, path)

    prof = profile(activities=activities, on_trace_ready=ready, record_shapes=False,
                   schedule=schedule(wait=1, warmup=1, active=args.profile_steps, repeat=1))
    prof.start()
    return prof


if __name__ == "__main__":
    sys.exit(main())
