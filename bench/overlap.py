"""``bitps-bench overlap``: step time, compute utilization and worker CPU with overlap off and on,
against the same model computing with no PS at all, over a bandwidth-limited link.

A shard (a real ``bitps-server`` process, ``sync`` mode, ``sgd``) sits on the far end of a veth
pair in its own network namespace, with ``tc tbf`` at ``--rate`` (1 Gbit/s) on both ends
(``bench.link``; unshaped loopback, reported, when namespaces cannot be made). The model is a
stack of ``depth`` linear layers of ``width``. Three cases:

1. **One worker, fp32** (this process: a real ``PSModel`` over a real ``PSClient``), its batch
   sized so communication takes ``comm_ratio`` x compute (0.6, 0.8 and 1.0 by default; each is
   checked): compute-only at a probe batch gives the compute time per sample, an overlap-off
   run the communication time (all of it exposed), and the batch is scaled to match. Then
   compute-only, overlap off and overlap on at that batch.
2. **Two workers, sync**, at the batch of the last target: worker 0 (this process) and shard 0
   on this side, worker 1 (``bench.overlap_peer``) and shard 1 in the namespace, so half of
   each worker's traffic crosses the shaped link, as a ring all-reduce's would. Buckets are
   larger than the credit window; before pulls stopped holding credit this wedged.
3. **Compressed with clipping**: sign1 pushes and pulls at the default ``clip_norm`` (1.0), the
   loss scaled so the gradient norm is about 3 (clipping in force), the batch sized as in 1 for
   the first target from sign1's own overlap-off communication; overlap ``auto`` must turn on.

Step time = wall time over the measured steps / steps; utilization = ``PSModel``'s (wall -
exposed communication) / wall. Worker CPU per step comes from ``/proc`` (user + system, per
thread: the training thread, the communication thread, ZeroMQ's I/O thread, the rest); *beyond
compute* is the worker's CPU per step less the compute-only run's. The shards' CPU per step is
read from ``/proc`` too. The machine's load before the run is recorded.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitps.bench.config import OverlapBench
from bitps.bench.link import Link, shaped_link
from bitps.bench.proc import ReadyProcess, machine_busy, process_cpu, thread_cpu
from bitps.bench.report import check, write_results

__all__ = ["client_config", "make_model", "overlap_config", "run", "train_steps"]


def make_model(width: int, depth: int, device):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def _shard(prefix: tuple[str, ...], host: str, shard_id: int = 0,
           num_shards: int = 1) -> ReadyProcess:
    return ReadyProcess([*prefix, sys.executable, "-m", "bitps.ps", "--host", host,
                         "--grpc-port", "0", "--data-port", "0", "--metrics-port", "-1",
                         "--shard-id", str(shard_id), "--num-shards", str(num_shards),
                         "--mode", "sync", "--optimizer", "sgd", "--lr", "1e-4"])


def _cpu_split(before: dict, after: dict, comm_tid: int | None) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` readings, by role."""
    main = threading.main_thread().native_id
    split = {"main": 0.0, "comm": 0.0, "zmq": 0.0, "other": 0.0}
    for tid, (name, seconds) in after.items():
        used = seconds - before.get(tid, (name, 0.0))[1]
        role = ("main" if tid == main else "comm" if tid == comm_tid
                else "zmq" if name.startswith("ZMQbg") else "other")
        split[role] += used
    return split


def train_steps(model, batch: int, steps: int, warmup: int, device, ps_model=None, *,
                loss_scale: float = 1.0, seed: int = 1, shard_pids: tuple[int, ...] = ()
                ) -> dict:
    """Train ``warmup + steps`` steps; time the last ``steps`` and read the CPU they used."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    width = model[0].in_features
    xs = [torch.randn(batch, width, generator=gen).to(device) for _ in range(2)]
    utilization, exposed, comm, backward = [], [], [], []
    t0, cpu0, shard0 = 0.0, {}, 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, cpu0 = time.perf_counter(), thread_cpu()
            shard0 = sum(process_cpu(p) for p in shard_pids)
        loss = model(xs[i % 2]).square().mean() * loss_scale
        t_fwd = time.perf_counter()
        loss.backward()
        if device.type == "cpu" and i >= warmup:
            backward.append(time.perf_counter() - t_fwd)
        if ps_model is None:
            for p in model.parameters():
                p.grad = None
        else:
            ps_model.step()
            if i >= warmup:
                s = ps_model.last_stats
                utilization.append(s.utilization)
                exposed.append(s.exposed_s)
                comm.append(s.comm_s)
    if ps_model is not None:
        ps_model.synchronize()
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    thread = ps_model._overlap.comm if ps_model else None
    comm_thread = thread._thread.native_id if thread else None
    cpu = _cpu_split(cpu0, thread_cpu(), comm_thread)
    return {"step_s": step_s,
            "utilization": statistics.fmean(utilization) if utilization else 1.0,
            "exposed_s": statistics.median(exposed) if exposed else 0.0,
            "comm_s": statistics.median(comm) if comm else 0.0,
            "backward_s": statistics.median(backward) if backward else None,
            "overlap": bool(ps_model and ps_model.decision and ps_model.decision.enabled),
            "cpu_s": sum(cpu.values()) / steps, **{f"cpu_{k}_s": v / steps for k, v in cpu.items()},
            "shard_cpu_s": (sum(process_cpu(p) for p in shard_pids) - shard0) / steps}


def client_config(servers, cfg: dict, *, rank: int = 0, world_size: int = 1,
                   codec: str = "raw"):
    from bitps.proto.codecs import CodecConfig
    from bitps.worker.config import ClientConfig

    return ClientConfig(servers=servers, rank=rank, world_size=world_size,
                        partition_bytes=cfg["partition_bytes"],
                        push_codec=CodecConfig(name=codec))


def overlap_config(mode: str, cfg: dict):
    from bitps.worker.config import OverlapConfig

    return OverlapConfig(mode=mode, bucket_bytes=cfg["bucket_bytes"],
                         inflight_bytes=cfg["inflight_bytes"])


def _ps_run(link: Link, model, batch: int, steps: int, warmup: int, device, mode: str,
            cfg: dict, *, codec: str = "raw", loss_scale: float = 1.0) -> dict:
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    shard = _shard(link.prefix, link.server_ip)
    try:
        client = PSClient(client_config((f"{link.server_ip}:{shard.ready['grpc_port']}",),
                                         cfg, codec=codec))
        ps_model = PSModel(model, client, overlap=overlap_config(mode, cfg))
        try:
            return train_steps(model, batch, steps, warmup, device, ps_model,
                               loss_scale=loss_scale, shard_pids=(shard.proc.pid,))
        finally:
            ps_model.close()
    finally:
        shard.stop()


def _two_workers(link: Link, width: int, depth: int, batch: int, steps: int, warmup: int,
                 device, mode: str, cfg: dict) -> dict:
    """Case 2: two workers in sync, a shard beside each; this process is worker 0."""
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    shards = [_shard((), link.host_ip, 0, 2), _shard(link.prefix, link.server_ip, 1, 2)]
    peer = None
    try:
        servers = (f"{link.host_ip}:{shards[0].ready['grpc_port']}",
                   f"{link.server_ip}:{shards[1].ready['grpc_port']}")
        peer = subprocess.Popen(
            [*link.prefix, sys.executable, "-m", "bitps.bench.overlap_peer", json.dumps({
                "servers": servers, "rank": 1, "world_size": 2, "width": width,
                "depth": depth, "batch": batch, "steps": steps, "warmup": warmup,
                "mode": mode, "cfg": cfg, "device": str(device)})],
            stdout=subprocess.PIPE, text=True)
        model = make_model(width, depth, device)
        client = PSClient(client_config(servers, cfg, world_size=2))
        ps_model = PSModel(model, client, overlap=overlap_config(mode, cfg))
        try:
            ours = train_steps(model, batch, steps, warmup, device, ps_model, seed=1,
                               shard_pids=tuple(s.proc.pid for s in shards))
        finally:
            ps_model.close()
        out, _ = peer.communicate(timeout=300)
        if peer.returncode:
            raise RuntimeError(f"bench.overlap_peer exited {peer.returncode}")
        theirs = json.loads(out.strip().splitlines()[-1])
        # the step of the pair is the slower one's; utilization and CPU are worker 0's
        return {**ours, "step_s": max(ours["step_s"], theirs["step_s"]),
                "peer_step_s": theirs["step_s"], "peer_cpu_s": theirs["cpu_s"]}
    finally:
        if peer is not None and peer.poll() is None:
            peer.kill()
            peer.wait()
        for s in shards:
            s.stop()


def _size_batch(width: int, depth: int, comm_ratio: float, comm_s: float,
                per_sample_s: float, steps: int, warmup: int, dev) -> tuple[int, dict]:
    """The batch at which compute-only takes ``comm_s / comm_ratio``, and its measurement."""
    batch = max(1, round(comm_s / comm_ratio / per_sample_s))
    for _ in range(3):  # compute is not linear in the batch: correct on measurements
        compute_only = train_steps(make_model(width, depth, dev), batch, steps, warmup, dev)
        ratio = comm_s / compute_only["step_s"]
        print(f"communication {comm_s * 1e3:.1f} ms per step; batch {batch}: compute "
              f"{compute_only['step_s'] * 1e3:.1f} ms (ratio {ratio:.2f})", file=sys.stderr)
        if abs(ratio / comm_ratio - 1) < 0.05:
            break
        batch = max(1, round(batch * ratio / comm_ratio))
    return batch, compute_only


def _grad_norm(width: int, depth: int, batch: int, dev) -> float:
    import torch

    model = make_model(width, depth, dev)
    gen = torch.Generator(device="cpu").manual_seed(1)
    model(torch.randn(batch, width, generator=gen).to(dev)).square().mean().backward()
    return float(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters())))


def _row(case: str, target, measured, batch: int, r: dict, base: dict) -> dict:
    ms = 1e3
    return {"case": case, "target": target, "measured": measured, "batch": batch,
            "step_ms": r["step_s"] * ms, "vs_compute_only": r["step_s"] / base["step_s"],
            "utilization": r["utilization"],
            "compute_only_over_step": base["step_s"] / r["step_s"],
            "exposed_ms": r["exposed_s"] * ms, "comm_ms": r["comm_s"] * ms,
            "backward_ms": r["backward_s"] * ms if r["backward_s"] is not None else None,
            "overlap": r["overlap"], "cpu_ms": r["cpu_s"] * ms,
            "beyond_compute_cpu_ms": (r["cpu_s"] - base["cpu_s"]) * ms,
            "cpu_comm_ms": r["cpu_comm_s"] * ms, "cpu_zmq_ms": r["cpu_zmq_s"] * ms,
            "cpu_other_ms": r["cpu_other_s"] * ms, "shard_cpu_ms": r["shard_cpu_s"] * ms}


_COLUMNS = [("case", "case"), ("target", "comm/compute target"), ("measured", "measured"),
            ("batch", "batch"), ("step_ms", "step ms"), ("vs_compute_only", "x compute-only"),
            ("utilization", "utilization"), ("exposed_ms", "exposed ms"),
            ("comm_ms", "comm ms"), ("overlap", "overlap"), ("cpu_ms", "worker CPU ms"),
            ("beyond_compute_cpu_ms", "beyond compute"), ("cpu_comm_ms", "comm thread"),
            ("cpu_zmq_ms", "zmq I/O"), ("shard_cpu_ms", "shard CPU ms")]


@dataclass(frozen=True)
class _Setup:
    """What every case of one run shares: the link, the options, the device and the client
    settings (``wire``: the dict ``client_config`` and ``bench.overlap_peer`` read)."""

    link: Link
    cfg: OverlapBench
    dev: Any
    wire: dict

    def model(self):
        return make_model(self.cfg.width, self.cfg.depth, self.dev)

    def ps_run(self, batch: int, steps: int, warmup: int, mode: str, **kw) -> dict:
        return _ps_run(self.link, self.model(), batch, steps, warmup, self.dev, mode, self.wire,
                       **kw)

    def size_batch(self, comm_ratio: float, comm_s: float, per_sample_s: float):
        c = self.cfg
        return _size_batch(c.width, c.depth, comm_ratio, comm_s, per_sample_s, c.steps,
                           c.warmup, self.dev)


def run(cfg: OverlapBench | None = None, *, out: Path | None = None) -> dict:
    """Run the three cases, write ``overlap.json``/``.md`` under ``out``, return the document.
    Every target of case 1 gets the two checks (utilization >= 0.9, step <= 1.1x
    compute-only); case 2 must finish and be no slower with overlap on; case 3 must decide
    overlap on and be no slower with it."""
    import torch

    cfg = (cfg or OverlapBench()).sized()
    torch.set_num_threads(1)
    dev = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                       "cpu" if cfg.device == "auto" else cfg.device)
    busy = machine_busy(2.0)
    wire = {"bucket_bytes": cfg.bucket_bytes, "partition_bytes": cfg.partition_bytes,
            "inflight_bytes": cfg.inflight_bytes}
    probe_steps = max(cfg.steps // 2, 2)
    with shaped_link(cfg.rate) as link:
        print(f"link: {link.kind}: {link.note}", file=sys.stderr)
        s = _Setup(link, cfg, dev, wire)
        param_bytes = sum(p.numel() * 4 for p in s.model().parameters())
        probe = train_steps(s.model(), cfg.probe_batch, probe_steps, cfg.warmup, dev)
        comm = s.ps_run(cfg.probe_batch, probe_steps, cfg.warmup, "off")
        per_sample = probe["step_s"] / cfg.probe_batch
        rows, checks, batches, batch, base = _one_worker(s, per_sample, comm["exposed_s"])
        pair_rows, pair_checks = _two_worker_rows(s, batch, base)
        clip_rows, clip_checks, clip_config, scale = _clipped_rows(s, per_sample)
    config = {"link": link.kind, "rate": link.rate, "link_note": link.note, "width": cfg.width,
              "depth": cfg.depth, "param_bytes": param_bytes,
              "comm_ratios": list(cfg.comm_ratios), "batches": batches,
              "comm_ms_overlap_off_probe": round(comm["exposed_s"] * 1e3, 2), **clip_config,
              "bucket_bytes": cfg.bucket_bytes, "partition_bytes": cfg.partition_bytes,
              "inflight_bytes": cfg.inflight_bytes, "mode": "sync", "optimizer": "sgd",
              "device": str(dev), "steps": cfg.steps, "warmup": cfg.warmup, "torch_threads": 1,
              "machine_busy_before": round(busy, 3), "quick": cfg.quick}
    rows += pair_rows + clip_rows
    checks.update(pair_checks)
    checks.update(clip_checks)
    write_results("overlap", config=config, rows=rows, checks=checks, out=out,
                  notes=_notes(cfg, link, param_bytes, scale, busy), columns=_COLUMNS)
    return {"rows": rows, "checks": checks}


def _one_worker(s: _Setup, per_sample: float, comm_s: float):
    """Case 1 at every target: its rows, checks, batches by target, and the last target's
    batch and compute-only run (case 2 runs at them)."""
    rows, checks, batches = [], {}, {}
    for target in s.cfg.comm_ratios:
        batch, base = s.size_batch(target, comm_s, per_sample)
        results = {mode: s.ps_run(batch, s.cfg.steps, s.cfg.warmup, mode) for mode in ("off", "on")}
        measured = results["off"]["exposed_s"] / base["step_s"]
        batches[f"{target:g}"] = {"batch": batch, "measured_ratio": round(measured, 3)}
        rows.append(_row("1 worker: compute-only", target, measured, batch, base, base))
        for mode, r in results.items():
            rows.append(_row(f"1 worker: overlap {mode}", target, measured, batch, r, base))
        on = results["on"]
        checks[f"overlap_on_utilization_at_ratio_{target:g}"] = check(
            round(on["utilization"], 3), ">= 0.9", on["utilization"] >= 0.9)
        checks[f"overlap_on_step_vs_compute_only_at_ratio_{target:g}"] = check(
            round(on["step_s"] / base["step_s"], 3), "<= 1.1",
            on["step_s"] / base["step_s"] <= 1.1)
    return rows, checks, batches, batch, base


def _two_worker_rows(s: _Setup, batch: int, base: dict) -> tuple[list[dict], dict]:
    """Case 2: two workers, sync, at the last target's batch."""
    c, pair = s.cfg, {}
    for mode in ("off", "on"):
        try:
            pair[mode] = _two_workers(s.link, c.width, c.depth, batch, c.steps, c.warmup, s.dev,
                                      mode, s.wire)
        except Exception as err:  # a wedge shows as a deadline: report it, do not crash
            print(f"two workers, overlap {mode}: {err}", file=sys.stderr)
            pair[mode] = None
    rows = [_row(f"2 workers sync: overlap {mode}", c.comm_ratios[-1], None, batch, r, base)
            for mode, r in pair.items() if r is not None]
    done = pair["on"] is not None and pair["off"] is not None
    ratio = pair["on"]["step_s"] / pair["off"]["step_s"] if done else None
    return rows, {"two_workers_sync_overlap_on_completes": check(done, "true", done),
                  "two_workers_sync_overlap_on_vs_off": check(
                      round(ratio, 3) if done else None, "< 1", done and ratio < 1)}


def _clipped_rows(s: _Setup, per_sample: float) -> tuple[list[dict], dict, dict, float]:
    """Case 3: sign1 with default clipping, the norm ~3 so that clipping is in force; its
    rows, checks, the figures the config records, and the loss scale."""
    c = s.cfg
    scale = 3.0 / _grad_norm(c.width, c.depth, c.probe_batch, s.dev)
    sign = s.ps_run(c.probe_batch, max(c.steps // 2, 2), c.warmup, "off", codec="sign1",
                    loss_scale=scale)
    target = c.comm_ratios[0]
    cbatch, cbase = s.size_batch(target, sign["exposed_s"], per_sample)
    # auto decides after one warm-up and three probe steps: measure after that
    coded = {mode: s.ps_run(cbatch, c.steps, c.warmup + (4 if mode == "auto" else 0), mode,
                            codec="sign1", loss_scale=scale) for mode in ("off", "auto")}
    cmeasured = coded["off"]["exposed_s"] / cbase["step_s"]
    rows = [_row("sign1 + clip: compute-only", target, cmeasured, cbatch, cbase, cbase)]
    for mode, r in coded.items():
        rows.append(_row(f"sign1 + clip: overlap {mode}", target, cmeasured, cbatch, r, cbase))
    cratio = coded["auto"]["step_s"] / coded["off"]["step_s"]
    checks = {"compressed_clip_auto_turns_overlap_on": check(
                  coded["auto"]["overlap"], "true", coded["auto"]["overlap"]),
              "compressed_clip_overlap_on_vs_off": check(round(cratio, 3), "< 1", cratio < 1)}
    return rows, checks, {"sign1_comm_ms_overlap_off_probe": round(sign["exposed_s"] * 1e3, 2),
                          "sign1_batch": cbatch, "sign1_loss_scale": round(scale, 3)}, scale


def _notes(cfg: OverlapBench, link: Link, param_bytes: int, scale: float, busy: float) -> str:
    return (f"Link: {link.kind} ({link.note}). Model: {cfg.depth} x Linear({cfg.width}, "
            f"{cfg.width}) + ReLU, {param_bytes / 2**20:.1f} MiB of float32 parameters. Case 1 "
            f"sizes the batch so communication / compute = target (measured: overlap-off "
            f"exposed time / compute-only step); one worker (1 torch thread), one sync shard "
            f"(sgd). Case 2: two workers, a shard beside each (half of each worker's traffic "
            f"crosses the link), at the last target's batch; step = the slower worker's. Case "
            f"3: sign1 pushes and pulls, clip_norm 1.0 with the loss scaled x{scale:.3g} "
            f"(gradient norm ~3), the batch sized for the first target from sign1's own "
            f"communication; auto measured after its decision. Buckets "
            f"{cfg.bucket_bytes >> 10} KiB, credit window {cfg.inflight_bytes >> 10} KiB, "
            f"partitions {cfg.partition_bytes >> 10} KiB. step ms = wall / steps over "
            f"{cfg.steps} steps after {cfg.warmup}; utilization = (wall - exposed "
            f"communication) / wall as PSModel measures it; exposed and comm ms are medians "
            f"per step. CPU ms per step from /proc: the worker process (beyond compute = less "
            f"the compute-only run's), its communication and ZeroMQ I/O threads, and the "
            f"shards. Machine busy before the run: {busy:.0%} of all cores.")
