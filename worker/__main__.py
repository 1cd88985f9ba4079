"""``bitps-worker``: one worker rank training the demo model (a tiny Qwen3-MoE on a byte corpus).

The one place that reads worker flags and environment variables. Every setting is a flag with an
environment twin and a key of the ``--config`` TOML file: flag > environment > file > default
(``bitps.proto.settings``). The twins are ``BITPS_`` + the flag name (``--push-codec`` <-
``BITPS_PUSH_CODEC``), except torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``. Defaults
and allowed values come from the dataclasses (``ClientConfig``, ``CodecConfig``,
``OverlapConfig``, ``PoolConfig``, ``RunConfig``, ``DemoConfig``); :func:`program` adds only
names and help, and ``docs/configuration.md`` is rendered from it.

``--algorithm`` picks a trainer from the registry (``worker.algorithms.trainers``: ``ps``,
``diloco``). Plug-ins (``--plugin MODULE``, ``BITPS_PLUGINS``, config key ``plugins``;
docs/plugins.md) are imported before any other setting is read, so ``--algorithm``,
``--push-codec`` and ``--pull-codec`` accept the trainers and codecs they register.

With ``--json`` it prints one JSON object per line on stdout (``start``, which names the steps
it will run, ``step`` every ``--log-every`` steps, ``done`` whose ``final_loss`` is the mean of
the last 10 steps and which counts the bytes pushed on the wire and pulled), which
``bitps-launch`` reads.

SIGTERM ends the run where it is (mid-step too): the worker sends Leave to every shard, so its
peers stop waiting for it at once rather than at the shards' heartbeat timeout, prints a
``terminated`` event and exits 0. It does not wait for what is in flight (a sync pull may be
held for a peer that is gone); a second SIGTERM kills it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bitps.proto.codecs import CODEC_NAMES, CodecConfig
from bitps.proto.settings import Program, from_field, option
from bitps.worker.algorithms.trainers import make_trainer
from bitps.worker.config import (
    AlgorithmConfig,
    ClientConfig,
    EncoderConfig,
    OverlapConfig,
    PoolConfig,
    RunConfig,
    connection_settings,
)

if TYPE_CHECKING:  # its module imports torch
    from bitps.worker.demo import DemoConfig

__all__ = ["SLOW_WAIT_STATUS_S", "WorkerConfig", "build_parser", "log_slow_waits", "main",
           "parse_config", "program"]

SLOW_WAIT_STATUS_S = 2.0
"""How long the slow-wait diagnosis may ask a shard for its Status (the wait it runs in has
half its limit left)."""


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler: leave the shards and exit 0 (a
    BaseException, as KeyboardInterrupt: no ``except Exception`` on the way swallows it)."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    raise _Terminated


@functools.cache
def program() -> Program:
    """bitps-worker's settings, in ``--help`` order. Built on first use: ``DemoConfig``, which
    holds the model's defaults, imports torch."""
    from bitps.worker.demo import DemoConfig

    _C, _K, _O, _P, _R, _D, _A = (ClientConfig, CodecConfig, OverlapConfig, PoolConfig,
                                  RunConfig, DemoConfig, AlgorithmConfig)
    return Program("bitps-worker", "Train the bitps demo model as one worker rank.", (
        option("servers", default="", metavar="HOST:PORT,...",
               help="comma-separated gRPC host:port of every shard, in shard-id order"),
        from_field(_C, "rank", env="RANK", help="worker rank (torchrun's RANK)"),
        from_field(_C, "world_size", env="WORLD_SIZE",
                   help="number of worker ranks (torchrun's WORLD_SIZE)"),
        from_field(_R, "steps", help="training steps"),
        from_field(_A, "name", name="algorithm",
                   help="ps: push gradients and pull parameters every step; diloco: local "
                        "SGD, H inner AdamW steps per push of the pseudo-gradient; or a "
                        "plug-in's trainer"),
        from_field(_A, "inner_steps", help="diloco: inner steps per round (H)"),
        from_field(_A, "inner_lr", help="diloco: inner AdamW learning rate"),
        from_field(_A, "inner_weight_decay", help="diloco: inner AdamW weight decay"),
        from_field(_A, "fragments", help="diloco: streaming fragments, each exchanged at its "
                                         "own step of the round (1 = no streaming)"),
        from_field(_A, "fragment_overlap_steps",
                   help="diloco streaming: inner steps an exchange stays in flight"),
        from_field(_A, "inner_steps_adaptive",
                   help="diloco: size each round from measured speed (DyLU): max(1, "
                        "round(H * own steps/s / fastest live worker's))"),
        from_field(_D, "batch_size", help="sequences per step per rank"),
        from_field(_D, "seq_len", help="bytes per sequence"),
        from_field(_D, "corpus_bytes", help="corpus byte budget"),
        from_field(_D, "seed", help="model init seed (data seed = seed, rank)"),
        from_field(_R, "threads", help="torch CPU threads"),
        from_field(_R, "local_rank", env="LOCAL_RANK",
                   help="GPU index on this host (torchrun's LOCAL_RANK)"),
        from_field(_R, "device", help="torch device; auto = cuda:<local rank> when CUDA is "
                                      "available, else cpu"),
        from_field(_R, "metrics_port", help="Prometheus port; 0 = any free port, -1 = off"),
        from_field(_R, "metrics_host", help="address the Prometheus endpoint binds to"),
        *connection_settings(),
        from_field(_R, "step_delay_s", name="step-delay",
                   help="extra seconds of sleep per step (simulates a straggler)"),
        from_field(_K, "name", name="push-codec",
                   help="gradient codec, with error feedback (a onebit_adam shard overrides "
                        "it)"),
        option("pull-codec", default="push", choices=CODEC_NAMES.plus("push"),
               help="codec the shards publish parameter updates with for pulls (their own "
                    "error feedback; workers stay bit-identical); push = the push codec's"),
        from_field(_K, "chunk", name="codec-chunk",
                   help="elements per scale chunk (sign1) or exponent chunk (sparse), a "
                        "multiple of 64; push and pull codecs"),
        from_field(_K, "scale", name="sign1-scale", help="sign1 scale rule"),
        from_field(_K, "values", name="sparse-values", help="sparse value encoding"),
        from_field(EncoderConfig, "compress_min_bytes",
                   help="tensors smaller than this go uncompressed; every key of a larger one "
                        "is compressed"),
        from_field(EncoderConfig, "clip_norm",
                   help="clip each step's local gradient to this L2 norm before its push "
                        "(0 = off; -1 = auto: 1.0 when pushes are compressed, off for "
                        "float32 pushes)"),
        from_field(EncoderConfig, "codec_seed", help="seed of sparse sampling and rounding"),
        from_field(EncoderConfig, "threads", name="encoder-threads",
                   help="threads that encode one push's keys (0 = one per core)"),
        from_field(_O, "mode", name="overlap",
                   help="push buckets from backward hooks; auto = on when communication "
                        "exceeds --overlap-min-ratio of compute, measured over the first steps"),
        from_field(_O, "min_ratio", name="overlap-min-ratio",
                   help="auto overlap: the communication/compute ratio above which overlap "
                        "turns on"),
        from_field(_O, "bucket_bytes", help="overlap: bytes per gradient bucket"),
        from_field(_O, "inflight_bytes",
                   help="overlap: gradient bytes in flight before the next bucket waits"),
        from_field(_O, "hold_when_clipping",
                   help="overlap: a step after a clipped one is pushed whole by step() with "
                        "the exact clip factor, not from the hooks with a predicted one (sync: "
                        "compressed pushes where shards hold pulls, i.e. sync with several "
                        "workers)"),
        from_field(_R, "profile_dir", name="profile", metavar="DIR",
                   help="directory: write a torch.profiler trace of --profile-steps steps "
                        "(after 2 warm-up steps) to DIR/trace-rank<R>.json and print the top "
                        "operators (empty = off)"),
        from_field(_R, "profile_steps", help="steps the profiler records"),
        from_field(_R, "activation_pool",
                   help="keep saved activations in a pre-reserved arena with host offload"),
        from_field(_P, "capacity_bytes", name="pool-capacity",
                   help="arena bytes; 0 = --pool-fraction of the device's memory"),
        from_field(_P, "fraction", name="pool-fraction",
                   help="share of device memory for the arena"),
        from_field(_P, "allocator", name="pool-allocator", help="arena allocator"),
        from_field(_P, "policy", name="pool-policy", help="what to offload under pressure: "
                   "the entry needed furthest in the future (schedule) or the least recently "
                   "used (lru)"),
        from_field(_P, "min_block", name="pool-min-block", help="buddy: smallest block"),
        from_field(_P, "min_tensor_bytes", name="pool-min-tensor-bytes",
                   help="saved tensors below this stay with the framework allocator"),
        from_field(_R, "log_every", help="progress line every N steps"),
        from_field(_R, "json", help="print JSON progress lines (for bitps-launch)"),
    ), plugins=True)


def build_parser() -> argparse.ArgumentParser:
    """The parser of a whole ``bitps-worker`` command line; a flag not given parses to its
    default. It reads no environment variable and no file (:func:`parse_config` does), so it
    parses a command line the same way wherever it runs."""
    return program().parser()


@dataclasses.dataclass(kw_only=True, frozen=True)
class WorkerConfig:
    """Everything one ``bitps-worker`` run is configured with."""

    client: ClientConfig
    encoder: EncoderConfig
    algorithm: AlgorithmConfig
    overlap: OverlapConfig
    pool: PoolConfig
    run: RunConfig
    demo: DemoConfig


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
                 ) -> tuple[WorkerConfig, argparse.Namespace]:
    """The worker's configuration from ``argv`` (default ``sys.argv[1:]``), ``environ``
    (default ``os.environ``) and the ``--config`` file, and every resolved value by its flag's
    dest name. A bad flag exits with status 2 (argparse); a bad variable, file or combination
    raises ``ValueError`` (``SettingError`` when a single value is unreadable)."""
    from bitps.worker.demo import DemoConfig

    r = program().parse(argv, environ)
    push = CodecConfig(**r.kwargs(CodecConfig))
    pull = None if r["pull-codec"] == "push" else dataclasses.replace(push, name=r["pull-codec"])
    servers = tuple(s for s in r["servers"].split(",") if s)
    cfg = WorkerConfig(
        client=ClientConfig(**r.kwargs(ClientConfig), servers=servers),
        encoder=EncoderConfig(**r.kwargs(EncoderConfig), push_codec=push, pull_codec=pull),
        algorithm=AlgorithmConfig(**r.kwargs(AlgorithmConfig)),
        overlap=OverlapConfig(**r.kwargs(OverlapConfig)), pool=PoolConfig(**r.kwargs(PoolConfig)),
        run=RunConfig(**r.kwargs(RunConfig)), demo=DemoConfig(**r.kwargs(DemoConfig)))
    return cfg, r.namespace()


def _emit(run: RunConfig, **event) -> None:
    if run.json:
        print(json.dumps(event), flush=True)
    elif event["event"] == "step":
        logging.info("rank %d step %d loss %.4f %.1f samples/s", event["rank"], event["step"],
                     event["loss"], event["samples_per_s"])
    else:
        logging.info("%s", event)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, _ = parse_config(argv)
    except ValueError as err:
        print(f"bitps-worker: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    run, rank = cfg.run, cfg.client.rank

    import torch

    from bitps.proto.keys import KeyFileError
    from bitps.worker.transport.client import PSClient

    torch.set_num_threads(run.threads)
    try:
        client = PSClient(cfg.client)
    except KeyFileError as err:
        logging.critical("rank %d cannot start: %s", rank, err)
        return 2
    log_slow_waits(client)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _train(cfg, client)
    except _Terminated:
        # Leave first: the peers' sync steps and SSP bounds stop counting this rank now. Nothing
        # in flight is waited for; the threads left are daemons.
        client.close()
        _emit(run, event="terminated", rank=rank)
        logging.info("rank %d: SIGTERM: left every shard", rank)
        return 0


def log_slow_waits(client) -> None:
    """Install ``client.on_slow_wait``: a wait past half its limit logs, per shard still
    silent, one warning naming the shard and whom it waits for (``describe_wait`` of the
    shard's Status, asked within :data:`SLOW_WAIT_STATUS_S`)."""
    from bitps.worker.launch.waits import describe_wait

    rank = client.cfg.rank

    def slow(shard: int, waited_s: float) -> None:
        line = describe_wait(lambda: client.status(shard, timeout_s=SLOW_WAIT_STATUS_S), rank)
        logging.getLogger("bitps.worker").warning(
            "rank %d: no answer from shard %d (%s) after %.1f s: %s", rank, shard,
            client.cfg.servers[shard], waited_s, line)

    client.on_slow_wait = slow


def _train(cfg: WorkerConfig, client) -> int:
    """The training loop of :func:`main` (``_Terminated`` passes through)."""
    run, demo, rank, world_size = cfg.run, cfg.demo, cfg.client.rank, cfg.client.world_size

    import torch
    from prometheus_client import start_http_server

    from bitps.worker.demo import batches, build_model, load_corpus, loss_fn

    metrics_port = -1
    if run.metrics_port >= 0:
        httpd, _ = start_http_server(run.metrics_port, addr=run.metrics_host,
                                     registry=client.metrics.registry)
        metrics_port = httpd.server_port
    device = torch.device(run.device if run.device != "auto" else
                          f"cuda:{run.local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    corpus = load_corpus(demo.corpus_bytes)
    model = build_model(demo).to(device)
    trainer = make_trainer(cfg.algorithm.name, model, client, cfg)
    pool = None
    if run.activation_pool:
        from bitps.worker.memory.pool import ActivationPool

        pool = ActivationPool(cfg.pool, device=device, params=model.parameters())
        client.metrics.registry.register(pool.collector())
    m = client.metrics
    _emit(run, event="start", rank=rank, steps=run.steps, metrics_port=metrics_port,
          device=str(device), params=sum(p.numel() for p in model.parameters()),
          keys=len(trainer.keys), corpus_sha256=corpus.sha256, corpus_files=corpus.files,
          corpus_bytes=len(corpus.data))
    data = batches(corpus, batch_size=demo.batch_size, seq_len=demo.seq_len, rank=rank,
                   world_size=world_size, seed=demo.seed)
    first = last = None
    recent: deque[float] = deque(maxlen=10)
    profiler = _profiler(run, rank, device) if run.profile_dir else None
    utilization: deque[float] = deque(maxlen=10)
    t_start = time.perf_counter()
    try:
        for step in range(run.steps):
            t0 = time.perf_counter()
            input_ids, labels = (t.to(device, non_blocking=True) for t in next(data))
            with pool.hooks() if pool is not None else contextlib.nullcontext():
                loss = loss_fn(model, input_ids, labels)
            loss.backward()
            if run.step_delay_s:
                time.sleep(run.step_delay_s)
            trainer.step()
            stats = getattr(trainer, "last_stats", None)  # PSModel's step statistics
            if stats is not None:
                utilization.append(stats.utilization)
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
            if step % run.log_every == 0 or step == run.steps - 1:
                _emit(run, event="step", rank=rank, step=step, loss=last,
                      samples_per_s=demo.batch_size / dt, clock=trainer.clock)
    except BaseException as err:
        if profiler is not None:
            profiler.stop()
        if not isinstance(err, _Terminated):  # SIGTERM: main() leaves without waiting
            trainer.close()
        raise
    if profiler is not None:
        profiler.stop()
    trainer.close()
    wall = time.perf_counter() - t_start
    wire = m.push_wire_bytes.value
    decision = getattr(trainer, "decision", None)  # PSModel's overlap decision
    _emit(run, event="done", rank=rank, steps=run.steps, first_loss=first,
          final_loss=sum(recent) / max(len(recent), 1), last_loss=last, seconds=wall,
          samples_per_s=run.steps * demo.batch_size / wall,
          push_wire_bytes=wire, pull_bytes=m.pull_bytes.value,
          overlap=bool(decision and decision.enabled),
          overlap_decision=decision.describe() if decision else "",
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


def _profiler(run: RunConfig, rank: int, device):
    """A started ``torch.profiler`` recording ``--profile-steps`` steps after 2 warm-up steps;
    when done it writes the Chrome trace to ``--profile``/trace-rank<R>.json and prints the
    top operators by self time on stderr (balance stages or buckets by what dominates)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"

    path = os.path.join(run.profile_dir, f"trace-rank{rank}.json")
    os.makedirs(run.profile_dir, exist_ok=True)

    def ready(prof) -> None:
        prof.export_chrome_trace(path)
        print(prof.key_averages().table(sort_by=sort, row_limit=15), file=sys.stderr)
        logging.info("profiler trace of %d steps written to %s", run.profile_steps, path)

    prof = profile(activities=activities, on_trace_ready=ready, record_shapes=False,
                   schedule=schedule(wait=1, warmup=1, active=run.profile_steps, repeat=1))
    prof.start()
    return prof


if __name__ == "__main__":
    sys.exit(main())
