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
from pathlib import Path

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


def run(*, rate: str = "1gbit", width: int = 512, depth: int = 16,
        comm_ratios: tuple[float, ...] = (0.6, 0.8, 1.0), steps: int = 12, warmup: int = 3,
        probe_batch: int = 64, bucket_bytes: int = 1 << 20, partition_bytes: int = 128 << 10,
        inflight_bytes: int = 2 << 20, device: str = "auto", out: Path | None = None,
        quick: bool = False) -> dict:
    """Run the three cases, write ``overlap.json``/``.md`` under ``out``, return the document.
    Every target of case 1 gets the two checks (utilization >= 0.9, step <= 1.1x
    compute-only); case 2 must finish and be no slower with overlap on; case 3 must decide
    overlap on and be no slower with it."""
    import torch

    torch.set_num_threads(1)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if quick:
        steps, warmup = 3, 1
    busy = machine_busy(2.0)
    cfg = {"bucket_bytes": bucket_bytes, "partition_bytes": partition_bytes,
           "inflight_bytes": inflight_bytes}
    rows, checks, batches = [], {}, {}
    with shaped_link(rate) as link:
        print(f"link: {link.kind}: {link.note}", file=sys.stderr)
        param_bytes = sum(p.numel() * 4 for p in make_model(width, depth, dev).parameters())
        probe = train_steps(make_model(width, depth, dev), probe_batch, max(steps // 2, 2), warmup,
                            dev)
        comm = _ps_run(link, make_model(width, depth, dev), probe_batch, max(steps // 2, 2),
                       warmup, dev, "off", cfg)
        per_sample = probe["step_s"] / probe_batch
        for target in comm_ratios:
            batch, base = _size_batch(width, depth, target, comm["exposed_s"], per_sample,
                                      steps, warmup, dev)
            results = {mode: _ps_run(link, make_model(width, depth, dev), batch, steps, warmup,
                                     dev, mode, cfg) for mode in ("off", "on")}
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
        # case 2: two workers, sync, at the last target's batch
        pair = {}
        for mode in ("off", "on"):
            try:
                pair[mode] = _two_workers(link, width, depth, batch, steps, warmup, dev, mode,
                                          cfg)
            except Exception as err:  # a wedge shows as a deadline: report it, do not crash
                print(f"two workers, overlap {mode}: {err}", file=sys.stderr)
                pair[mode] = None
        for mode, r in pair.items():
            if r is not None:
                rows.append(_row(f"2 workers sync: overlap {mode}", comm_ratios[-1], None,
                                 batch, r, base))
        done = pair["on"] is not None and pair["off"] is not None
        checks["two_workers_sync_overlap_on_completes"] = check(done, "true", done)
        ratio = pair["on"]["step_s"] / pair["off"]["step_s"] if done else None
        checks["two_workers_sync_overlap_on_vs_off"] = check(
            round(ratio, 3) if done else None, "< 1", done and ratio < 1)
        # case 3: sign1 with default clipping, the norm ~3 so that clipping is in force
        scale = 3.0 / _grad_norm(width, depth, probe_batch, dev)
        sign = _ps_run(link, make_model(width, depth, dev), probe_batch, max(steps // 2, 2), warmup,
                       dev, "off", cfg, codec="sign1", loss_scale=scale)
        target = comm_ratios[0]
        cbatch, cbase = _size_batch(width, depth, target, sign["exposed_s"], per_sample,
                                    steps, warmup, dev)
        # auto decides after one warm-up and three probe steps: measure after that
        coded = {mode: _ps_run(link, make_model(width, depth, dev), cbatch, steps,
                               warmup + (4 if mode == "auto" else 0), dev, mode, cfg,
                               codec="sign1", loss_scale=scale) for mode in ("off", "auto")}
        cmeasured = coded["off"]["exposed_s"] / cbase["step_s"]
        rows.append(_row("sign1 + clip: compute-only", target, cmeasured, cbatch, cbase, cbase))
        for mode, r in coded.items():
            rows.append(_row(f"sign1 + clip: overlap {mode}", target, cmeasured, cbatch, r,
                             cbase))
        checks["compressed_clip_auto_turns_overlap_on"] = check(
            coded["auto"]["overlap"], "true", coded["auto"]["overlap"])
        cratio = coded["auto"]["step_s"] / coded["off"]["step_s"]
        checks["compressed_clip_overlap_on_vs_off"] = check(round(cratio, 3), "< 1", cratio < 1)
    config = {"link": link.kind, "rate": link.rate, "link_note": link.note, "width": width,
              "depth": depth, "param_bytes": param_bytes, "comm_ratios": list(comm_ratios),
              "batches": batches, "comm_ms_overlap_off_probe": round(comm["exposed_s"] * 1e3, 2),
              "sign1_comm_ms_overlap_off_probe": round(sign["exposed_s"] * 1e3, 2),
              "sign1_batch": cbatch, "sign1_loss_scale": round(scale, 3),
              "bucket_bytes": bucket_bytes, "partition_bytes": partition_bytes,
              "inflight_bytes": inflight_bytes, "mode": "sync", "optimizer": "sgd",
              "device": str(dev), "steps": steps, "warmup": warmup, "torch_threads": 1,
              "machine_busy_before": round(busy, 3), "quick": quick}
    notes = (f"Link: {link.kind} ({link.note}). Model: {depth} x Linear({width}, {width}) + "
             f"ReLU, {param_bytes / 2**20:.1f} MiB of float32 parameters. Case 1 sizes the "
             f"batch so communication / compute = target (measured: overlap-off exposed time / "
             f"compute-only step); one worker (1 torch thread), one sync shard (sgd). Case 2: two "
             f"workers, a shard beside each (half of each worker's traffic crosses the link), "
             f"at the last target's batch; step = the slower worker's. Case 3: sign1 pushes "
             f"and pulls, clip_norm 1.0 with the loss scaled x{scale:.3g} (gradient norm ~3), "
             f"the batch sized for the first target from sign1's own communication; auto "
             f"measured after its decision. Buckets {bucket_bytes >> 10} KiB, credit window "
             f"{inflight_bytes >> 10} KiB, partitions {partition_bytes >> 10} KiB. step ms = "
             f"wall / steps over {steps} steps after {warmup}; utilization = (wall - exposed "
             f"communication) / wall as PSModel measures it; exposed and comm ms are medians "
             f"per step. CPU ms per step from /proc: the worker process (beyond compute = less "
             f"the compute-only run's), its communication and ZeroMQ I/O threads, and the "
             f"shards. Machine busy before the run: {busy:.0%} of all cores.")
    write_results("overlap", config=config, rows=rows, checks=checks, out=out, notes=notes,
                  columns=[("case", "case"), ("target", "comm/compute target"),
                           ("measured", "measured"), ("batch", "batch"), ("step_ms", "step ms"),
                           ("vs_compute_only", "x compute-only"), ("utilization", "utilization"),
                           ("exposed_ms", "exposed ms"), ("comm_ms", "comm ms"),
                           ("overlap", "overlap"), ("cpu_ms", "worker CPU ms"),
                           ("beyond_compute_cpu_ms", "beyond compute"),
                           ("cpu_comm_ms", "comm thread"), ("cpu_zmq_ms", "zmq I/O"),
                           ("shard_cpu_ms", "shard CPU ms")])
    return {"rows": rows, "checks": checks}
