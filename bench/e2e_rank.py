"""One rank of ``bitps-bench e2e``, run on an emulated node:
``python -m bitps.bench.e2e_rank '<json>'``.

The settings (JSON) say what kind of rank it is:

- ``local``: trains alone with ``torch.optim.Adam`` (compute-only and the no-traffic ceiling:
  forward, backward, clipping and the optimizer step, no exchange);
- ``ddp``: a ``DistributedDataParallel`` rank over gloo (``hook``: ``none`` for fp32,
  ``bf16`` for :func:`bf16_hook`, ``powersgd`` for PowerSGD rank 1), with the same optimizer,
  clipping and schedule as ``local``;
- ``bitps``: a ``PSModel`` over a ``PSClient`` against the run's shards, which hold the optimizer
  and the schedule; with ``bitps.local_sgd`` (``{"inner_steps": H, "adaptive": bool}``) DiLoCo
  instead: ``LocalSGD`` with an inner AdamW at ``lr`` on this rank's own schedule over its own
  ``steps``, the shards running the outer rule; with ``bitps.balance`` each step takes this
  rank's share of the global batch (``BatchBalance``: by the ranks' measured speeds) and weights
  its loss by it.

Every rank reads the demo corpus with its own rank's batches (``worker.demo.batches``), the
same for every run, and prints one JSON line per step (``loss``, its ``samples``, the
wall-clock ``end`` of the step, the ``exposed`` communication ``PSModel`` measured) and a
``done`` line (CPU seconds of this process, bytes pushed on the wire, its peak resident set and
the minor page faults of its steps).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

__all__ = ["bf16_hook", "main"]


def bf16_hook(state, bucket):
    """DDP communication hook: all-reduce the bucket in bfloat16, average, write back.

    The same arithmetic as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
    bf16_compress_hook``, which refuses to run on CPU tensors by name; gloo reduces bf16."""
    import torch
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)


def _wrap_ddp(model, s: dict):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    d = s["ddp"]
    # gloo picks its interface from the hostname, which inside a node's namespace resolves to
    # an address peers cannot reach: name the node's NIC
    os.environ.setdefault("GLOO_SOCKET_IFNAME", d["ifname"])
    dist.init_process_group("gloo", init_method=f"tcp://{d['master']}:{d['port']}",
                            rank=s["rank"], world_size=s["world"])
    hook = d["hook"]
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

        # one bucket: with several, PowerSGD's per-bucket collectives desynchronize gloo
        ddp = DDP(model, bucket_cap_mb=1 << 12)
        state = P.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                start_powerSGD_iter=d["powersgd_start"],
                                random_seed=s["seed"])
        ddp.register_comm_hook(state, P.powerSGD_hook)
        return ddp
    ddp = DDP(model)
    if hook == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif hook != "none":
        raise ValueError(f"ddp hook {hook!r}; expected none, bf16 or powersgd")
    return ddp


def _client(s: dict):
    from bitps.worker.config import ClientConfig
    from bitps.worker.transport.client import PSClient

    return PSClient(ClientConfig(servers=tuple(s["bitps"]["servers"]), rank=s["rank"],
                                 world_size=s["world"], deadline_s=300.0))


def _encoder(s: dict, *, clip: bool):
    """The run's pushes; with ``clip``, every push clipped at DDP's norm, float32 ones too
    (a norm given clips every push: ``EncoderConfig.clip_norm``)."""
    from bitps.proto.codecs import CodecConfig
    from bitps.worker.config import EncoderConfig

    b = s["bitps"]
    return EncoderConfig(push_codec=CodecConfig(name=b["push_codec"]),
                         compress_min_bytes=b["compress_min_bytes"],
                         clip_norm=s["clip_norm"] if clip else 0.0)


def _bitps(model, s: dict):
    from bitps.worker.config import OverlapConfig
    from bitps.worker.training.model import PSModel

    return PSModel(model, _client(s), encoder=_encoder(s, clip=True),
                   overlap=OverlapConfig(mode=s["bitps"]["overlap"],
                                         hold_when_clipping=s["bitps"]["hold_when_clipping"]))


def _local_sgd(model, s: dict):
    """DiLoCo: the inner AdamW and its schedule (this rank's own steps), the clipping done
    here on the inner gradients; the pseudo-gradients go unclipped."""
    import torch

    from bitps.proto.schedule import LRSchedule
    from bitps.worker.algorithms.local_sgd import LocalSGD

    d = s["bitps"]["local_sgd"]
    inner = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, LRSchedule(**s["schedule"]).factor)
    local = LocalSGD(model, _client(s), inner, inner_steps=d["inner_steps"],
                     encoder=_encoder(s, clip=False), adaptive=d["adaptive"])
    return local, sched


def main(argv: list[str] | None = None) -> int:
    import torch

    from bitps.bench.models import MODELS, build
    from bitps.proto.schedule import LRSchedule
    from bitps.worker.demo import batches, load_corpus, loss_fn

    s = json.loads((argv or sys.argv[1:])[0])
    torch.set_num_threads(s.get("threads", 1))
    spec = MODELS[s["model"]]
    device = torch.device(s.get("device", "cpu"))
    model = build(s["model"], s["seed"]).to(device)
    corpus = load_corpus(2_000_000)
    balance, balanced = None, s["kind"] == "bitps" and bool(s["bitps"].get("balance"))
    # a balanced rank reads every rank's stream: a step's global batch is the one every other
    # run trains on at that step (each rank's batch, in rank order), of which it takes its share
    streams = [batches(corpus, batch_size=spec.batch, seq_len=spec.seq_len, rank=q,
                       world_size=s["world"], seed=s["seed"])
               for q in (range(s["world"]) if balanced else (s["rank"],))]
    kind, ps_model, local, opt, sched = s["kind"], None, None, None, None
    if kind == "bitps" and s["bitps"].get("local_sgd"):
        local, sched = _local_sgd(model, s)
        train = model
    elif kind == "bitps":
        ps_model = _bitps(model, s)
        train = model
        if balanced:
            from bitps.worker.algorithms.balance import BatchBalance

            balance = BatchBalance(ps_model, global_batch=spec.batch * s["world"])
    else:
        train = _wrap_ddp(model, s) if kind == "ddp" else model
        schedule = LRSchedule(**s["schedule"])
        opt = torch.optim.Adam(model.parameters(), lr=s["lr"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    print(json.dumps({"event": "start", "rank": s["rank"],
                      "params": sum(p.numel() for p in model.parameters())}), flush=True)
    cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # the client's payload bytes pushed and pulled at the last step's end (bench.e2e_floor)
    last_wire = (0.0, 0.0) if ps_model is None else (
        ps_model.client.metrics.push_wire_bytes.value, ps_model.client.metrics.pull_bytes.value)
    for step in range(s["steps"]):
        t0 = time.time()
        samples, batch = spec.batch, next(streams[0])
        if balance is not None:
            samples = balance.next_batch()
            start = sum(balance.shares[:s["rank"]])
            rows = [batch, *(next(q) for q in streams[1:])]
            batch = tuple(torch.cat([r[i] for r in rows])[start:start + samples] for i in (0, 1))
        input_ids, labels = (t.to(device) for t in batch)
        loss = loss_fn(train, input_ids, labels)
        (loss if balance is None else loss * balance.weight).backward()
        if s["slow"] > 1.0:
            # a straggler: this rank's compute takes ``slow`` x as long
            time.sleep((s["slow"] - 1.0) * (time.time() - t0))
        exposed, traffic = 0.0, {}
        if ps_model is not None:
            ps_model.step()
            exposed = ps_model.last_stats.exposed_s
            # the payload bytes since the last step's end (backward's hooks push before
            # step()), and whether they went after backward (bench.e2e_floor)
            m = ps_model.client.metrics
            wire = (m.push_wire_bytes.value, m.pull_bytes.value)
            traffic = {"push_bytes": wire[0] - last_wire[0], "pull_bytes": wire[1] - last_wire[1],
                       "serial": not ps_model.last_stats.overlapped}
            last_wire = wire
        elif local is not None:
            if s["clip_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_norm"])
            t1 = time.time()
            # a round's exchange blocks in step(): that is its exposed communication
            if local.step():
                exposed = time.time() - t1
            sched.step()
        else:
            if s["clip_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_norm"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(json.dumps({"event": "step", "rank": s["rank"], "step": step,
                          "loss": loss.item(), "samples": samples,
                          "start": t0, "end": time.time(),
                          "exposed": exposed, "cpu": time.process_time() - cpu0,
                          **traffic}), flush=True)
    done = {"event": "done", "rank": s["rank"], "push_wire_bytes": 0.0, "overlap": None}
    if ps_model is not None:
        ps_model.synchronize()
        m = ps_model.client.metrics
        done.update(push_wire_bytes=m.push_wire_bytes.value, pull_bytes=m.pull_bytes.value,
                    overlap=bool(ps_model.decision and ps_model.decision.enabled),
                    held_steps=m.held_steps.value)
        ps_model.close()
    if local is not None:
        m = local.client.metrics
        done.update(push_wire_bytes=m.push_wire_bytes.value, pull_bytes=m.pull_bytes.value,
                    rounds=local.clock)
        local.close()
    done["cpu_s"] = time.process_time() - cpu0
    # memory: the peak resident set, and the pages first touched during the steps (each a
    # fault the kernel zeroes a page for: memory freed to the system and taken back)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    done["max_rss_mib"] = usage.ru_maxrss / 1024
    done["minor_faults"] = usage.ru_minflt - faults0
    if kind == "ddp":
        import torch.distributed as dist

        dist.barrier()
    print(json.dumps(done), flush=True)
    if kind == "ddp":
        # gloo's teardown (destroy_process_group) now and then hung one rank after its peer
        # had exited: both are done and have said so, so leave without it
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
