"""``bitps-bench scale``: the model's formula against hand-computed values, the shard count it
asks for, and the smallest measured run end to end (smoke: figures from a loaded test
machine prove nothing, so no ratio is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bitps.bench.scale_model import (
    Machines,
    SchemeCosts,
    WireCosts,
    shards_needed,
    step_time,
)

ROOT = Path(__file__).resolve().parents[1]
# 1 ns of shard update per byte, 0.5 ns per push, worker encode 0.2 ns and apply 0.1 ns,
# raw both ways; a 1 GB/s link (8 Gbit/s, no framing), 1 ns of CPU per byte crossing
COSTS = SchemeCosts(shard_fixed=1e-9, shard_per_push=0.5e-9, encode=0.2e-9, apply=0.1e-9,
                    push_bytes=1.0, pull_bytes=1.0)
WIRE = WireCosts(rate_bps=8e9, efficiency={1: 1.0}, cpu_per_byte={10**7: 1e-9}, message_cpu=1e-5,
                 shard_message_cpu=5e-6, worker_message_cpu=2e-6, round_trip=1e-4)
GB = 1e9


def test_a_shared_machine_step_is_the_encode_then_the_pipeline_or_the_cpu():
    """2 workers, 1 shard, 1 GB in 100 keys, 2 shared cores, by hand: the encode 0.2 s (2
    workers on 2 cores); the shard (1 + 0.5 x 2) ns x 1 GB + 5 us x 2 x 100 = 2.001 s, and
    half a worker's decode (0.1 + 2 us x 100 = 0.1002 s) that the 3 threads on 2 cores take
    from it, is the slowest stage (links 2 s), fill 0.1 ms + (2 + 2 + 0.1002) / 100; the
    machine's CPU, (2 + 2 x 0.1 + 1 ns x 2 x 2 x 1 GB + 10 us x 2 x 100) / 2 = 3.101 s, is
    longer still."""
    p = step_time(COSTS, WIRE, Machines(shared_cores=2), workers=2, shards=1, model_bytes=GB,
                  key_bytes=GB / 100)
    fill = 1e-4 + (2 + 2 + 0.1002) / 100
    expected = {"encode": 0.2, "push link": 2.0, "pull link": 2.0,
                "shard CPU": 2.001 + 0.1002 / 2, "worker CPU": 0.1002, "fill": fill,
                "machine CPU": 3.101}
    assert p.terms == pytest.approx(expected, rel=1e-9)
    assert p.bottleneck == "machine CPU" and p.seconds == pytest.approx(0.2 + 3.101)
    # 4 workers on 2 cores encode two at a time
    two_cores = step_time(COSTS, WIRE, Machines(shared_cores=2), workers=4, shards=1,
                          model_bytes=GB, key_bytes=GB / 100)
    assert two_cores.terms["encode"] == pytest.approx(0.4)
    # on 4 cores the shard's NIC, 4 workers' GB each way, is slower than the CPU, (3 + 4 x 0.1
    # + 8 + 10 us x 4 x 100) / 4 = 2.851 s
    four = step_time(COSTS, WIRE, Machines(shared_cores=4), workers=4, shards=1,
                     model_bytes=GB, key_bytes=GB / 100)
    # 5 threads on 4 cores: the shard loses a quarter of a worker's decode
    stages = [4.0, 4.0, 3e-9 * GB + 5e-6 * 4 * 100 + 0.1002 / 4, 0.1 + 2e-6 * 100]
    assert four.terms["machine CPU"] == pytest.approx(2.851)
    assert four.bottleneck == "push link"
    assert four.seconds == pytest.approx(0.2 + 4.0 + 1e-4 + (sum(stages) - 4.0) / 100)


def test_shared_cores_slow_the_kernels_by_how_many_are_busy():
    """The same step with a contention of 1.5 (the kernels take 1.5x their time alone while
    both cores work): the two encodes run at once (0.2 x 1.5); the pipeline's CPU, 2.2 s of
    kernels and 4.002 s of wire and messages, keeps both cores busy (6.202 / max(2.001, 6.202
    / 2) = 2), so the kernels' part of the shard (2 s) and of the worker (0.1 s) take 1.5x,
    and the machine's CPU is (1.5 x 2.2 + 4.002) / 2; the wire's CPU, measured with both its
    ends at work, is not scaled."""
    p = step_time(replace(COSTS, contention=1.5), WIRE, Machines(shared_cores=2), workers=2,
                  shards=1, model_bytes=GB, key_bytes=GB / 100)
    worker = 0.1 * 1.5 + 2e-6 * 100
    assert p.terms["encode"] == pytest.approx(0.3)
    assert p.terms["worker CPU"] == pytest.approx(worker)
    assert p.terms["shard CPU"] == pytest.approx(2.0 * 1.5 + 5e-6 * 2 * 100 + worker / 2)
    assert p.terms["fill"] == pytest.approx(1e-4 + (2 + 2 + worker) / 100)
    assert p.terms["machine CPU"] == pytest.approx((1.5 * 2.2 + 4.002) / 2)
    assert p.seconds == pytest.approx(0.3 + (1.5 * 2.2 + 4.002) / 2)
    one = Machines(shared_cores=1)
    assert one.slowdown(4, 1.5) == 1.0 and Machines(shared_cores=3).slowdown(2, 1.5) == 1.25


def test_the_wire_cpu_per_byte_is_the_nearest_measured_message_size():
    wire = replace(WIRE, cpu_per_byte={33 << 10: 2e-9, 1 << 20: 1e-9})
    assert [wire.cpu_per_byte_at(b) for b in (1024, 40 << 10, 200 << 10, 64 << 20)] == [
        2e-9, 2e-9, 1e-9, 1e-9]


def test_a_port_shared_by_more_flows_takes_their_measured_efficiency():
    """Measured: one flow 100 %, four flows into a port 50 %; two or three flows take the one
    flow's figure (the largest measured count not above theirs)."""
    wire = replace(WIRE, efficiency={1: 1.0, 4: 0.5})
    assert [wire.efficiency_at(k) for k in (1, 2, 3, 4, 64)] == [1.0, 1.0, 1.0, 0.5, 0.5]
    p = step_time(COSTS, wire, Machines(), workers=4, shards=1, model_bytes=GB,
                  key_bytes=GB / 100)
    assert p.terms["push link"] == pytest.approx(4 / 0.5)


def test_dedicated_machines_have_no_cpu_term_and_memory_caps_the_threads():
    """64 workers, 16 shards on their own machines: the shard's update over min(32 cores, 100
    / 10 GB/s) = 10; each shard's NIC takes 64 / 16 workers' pushes; the busiest shard holds
    7 of the 100 keys (4 shards 7, 12 shards 6), each a message of its own from each worker,
    and the fill runs over them."""
    big = Machines(shard_cores=32, core_bandwidth=10e9, machine_bandwidth=100e9)
    assert big.shard_speedup == 10 and Machines(shard_cores=8).shard_speedup == 8
    p = step_time(COSTS, WIRE, big, workers=64, shards=16, model_bytes=GB, key_bytes=GB / 100)
    shard = (1e-9 + 0.5e-9 * 64) * GB / 16 / 10 + 5e-6 * 64 * 7
    assert "machine CPU" not in p.terms
    assert p.terms["push link"] == pytest.approx(4.0) == p.terms["pull link"]
    assert p.terms["shard CPU"] == pytest.approx(shard)
    assert p.terms["encode"] == pytest.approx(0.2)
    stages = [4.0, 4.0, shard, 0.1 + 2e-6 * 100]
    fill = 1e-4 + (sum(stages) - 4.0) / 7
    assert p.bottleneck == "push link"
    assert p.seconds == pytest.approx(0.2 + 4.0 + fill)


def test_compressed_keys_share_messages_as_the_client_cuts_them():
    """The client batches a shard's keys up to 256 KiB on the wire (the larger of push and
    reply): 1 MiB keys go alone raw, seven to a message as sign1 codes (33,280 bytes). 32 keys
    on 1 shard: 5 messages; on 2: 16 keys, 3 messages each; on 3 (11, 11 and 10 keys): 2 each.
    Each message, not each key, costs the per-message CPU."""
    from bitps.bench.scale_costs import wire_sizes
    from bitps.bench.scale_model import message_counts

    n = 1 << 18
    push, pull = wire_sizes("sign1", n)
    sign1 = replace(COSTS, push_bytes=push, pull_bytes=pull)
    counts = [message_counts(sign1, keys=32, shards=s, key_bytes=4 * n) for s in (1, 2, 3)]
    assert counts == [(5, 5), (3, 6), (2, 6)]
    assert message_counts(COSTS, keys=32, shards=3, key_bytes=4 * n) == (11, 32)
    assert message_counts(COSTS, keys=1, shards=4, key_bytes=4 * n) == (1, 1)
    # a smaller limit: two codes a message
    assert message_counts(sign1, keys=32, shards=1, key_bytes=4 * n,
                          message_bytes=70_000) == (16, 16)
    p = step_time(sign1, WIRE, Machines(), workers=2, shards=1, model_bytes=32 * 4 * n,
                  key_bytes=4 * n)
    update = (1e-9 + 0.5e-9 * 2) * 32 * 4 * n
    assert p.terms["shard CPU"] == pytest.approx(update + 5e-6 * 2 * 5)
    assert p.terms["worker CPU"] == pytest.approx(0.1e-9 * 32 * 4 * n + 2e-6 * 5)


def test_fewer_workers_than_shards_leave_each_workers_nic_the_busier_end():
    p = step_time(COSTS, WIRE, Machines(), workers=1, shards=4, model_bytes=GB,
                  key_bytes=GB / 100)
    assert p.terms["push link"] == pytest.approx(1.0)


def test_shards_needed_is_the_fewest_whose_shard_side_keeps_up():
    """Against every count up to 64: the first whose links and shard update fit."""
    big = Machines(shard_cores=32, core_bandwidth=10e9, machine_bandwidth=100e9)

    def fits(s: int, compute_s: float) -> bool:
        t = step_time(COSTS, WIRE, big, workers=64, shards=s, model_bytes=GB,
                      key_bytes=GB / 100).terms
        return max(t["push link"], t["pull link"], t["shard CPU"]) <= compute_s

    for compute_s in (2.0, 8.0, 30.0):
        need = shards_needed(COSTS, WIRE, big, workers=64, model_bytes=GB, key_bytes=GB / 100,
                             compute_s=compute_s)
        assert need == next(s for s in range(1, 65) if fits(s, compute_s))
    # each worker's own NIC (1 s each way) is longer than 0.5 s: no shard count helps
    assert shards_needed(COSTS, WIRE, big, workers=64, model_bytes=GB, key_bytes=GB / 100,
                         compute_s=0.5) is None


@pytest.mark.parametrize("kwargs", [dict(workers=0, shards=1), dict(workers=1, shards=0),
                                    dict(workers=1, shards=1, model_bytes=0.0)])
def test_a_bad_size_is_refused_naming_it(kwargs):
    args = {"model_bytes": GB, "key_bytes": GB / 100, **kwargs}
    with pytest.raises(ValueError, match="expected workers, shards >= 1"):
        step_time(COSTS, WIRE, Machines(), **args)


def test_wire_sizes_come_from_the_codecs():
    """raw: 1 byte per float32 byte; sign1: a bit per element and a float32 scale per 2048;
    1-bit Adam: its shard's chunk of 256."""
    from bitps.bench.scale_costs import wire_sizes

    n = 262144
    assert wire_sizes("fp32", n) == (1.0, 1.0)
    assert wire_sizes("sign1", n) == pytest.approx(((n / 8 + 4 * n / 2048) / (4 * n),) * 2)
    assert wire_sizes("onebit", n) == pytest.approx(((n / 8 + 4 * n / 256) / (4 * n),) * 2)


def test_the_shard_line_through_the_worker_counts_never_falls():
    """a + b W through the measured points; a falling fit (noise) is the flat mean; one point
    is split evenly."""
    from bitps.bench.scale_costs import _line

    assert _line([1, 2, 4], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert _line([1, 2], [24.0, 10.0]) == (17.0, 0.0)
    assert _line([3], [8.0]) == (2.0, 2.0)


def test_the_config_refuses_what_cannot_run_and_quick_sizes_it():
    from bitps.bench.config import ScaleBench

    # 1-bit Adam's warm-up and its switch to compression are never timed
    with pytest.raises(ValueError, match=r"warmup 1, steps 20.*2 <= warmup < steps"):
        ScaleBench(warmup=1)
    with pytest.raises(ValueError, match="tries 0"):
        ScaleBench(tries=0)
    with pytest.raises(ValueError, match="side_rounds -1"):
        ScaleBench(side_rounds=-1)
    quick = ScaleBench(quick=True, workers=(1, 2, 4), shards=(2, 1)).sized()
    assert (quick.mib, quick.workers, quick.shards, quick.steps, quick.warmup,
            quick.side_rounds) == (8, (1, 2), (1,), 5, 2, 1)
    assert ScaleBench(quick=True, side_rounds=0).sized().side_rounds == 0


@pytest.mark.parametrize("codec", ["raw", "sign1"])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_the_models_message_count_is_the_clients_cut(codec, shards):
    """``message_counts`` against ``worker.transport.messages.messages`` itself, on the plan
    a measured point uses (32 keys of 1 MiB, ``bench.scale_rank``): the busiest shard's
    messages and all of them, the replies as large as the pushes (codes both ways)."""
    import numpy as np

    from bitps.bench.scale_costs import wire_sizes
    from bitps.bench.scale_model import message_counts
    from bitps.proto.codecs import RAW, Codec, CodecConfig
    from bitps.proto.keyplan import ParamSpec, make_plan
    from bitps.worker.transport.messages import messages

    n, keys = 1 << 18, 32
    plan = make_plan([ParamSpec("w", (keys * n,))], num_shards=shards, partition_bytes=4 * n)
    c = RAW if codec == "raw" else Codec.from_config(CodecConfig(name=codec))
    ids = [k.key for k in plan.keys]
    outs = [np.empty(k.length, np.float32) for k in plan.keys]
    cut = messages(plan, ids, None, outs, [c] * len(ids), limit=256 << 10,
                   reply_bytes={k.key: c.max_bytes(k.length) for k in plan.keys})
    per_shard = [sum(s == shard for s, *_ in cut) for shard in range(shards)]
    push, pull = wire_sizes("fp32" if codec == "raw" else codec, n)
    model = replace(COSTS, push_bytes=push, pull_bytes=pull)
    assert message_counts(model, keys=keys, shards=shards, key_bytes=4 * n) == (
        max(per_shard), len(cut))


def test_a_points_costs_are_the_mean_of_those_measured_beside_it():
    """The in-process costs before and after a point, averaged field by field, with the
    contention measured beside it; the wire's CPU measured beside it, less the in-process
    per-message figures measured beside it; without side rounds, the run start's."""
    from bitps.bench.scale_beside import beside_costs, beside_wire

    before = replace(COSTS, shard_fixed=2e-9, encode=0.4e-9)
    after = replace(COSTS, shard_fixed=4e-9, apply=0.3e-9)
    c = beside_costs(COSTS, [before, after], contention=1.4)
    assert (c.shard_fixed, c.shard_per_push, c.encode, c.apply, c.contention) == \
        pytest.approx((3e-9, 0.5e-9, 0.3e-9, 0.2e-9, 1.4))
    assert (c.push_bytes, c.pull_bytes) == (COSTS.push_bytes, COSTS.pull_bytes)
    assert beside_costs(COSTS, [], contention=2.0) is COSTS
    cpu = {"cpu_per_byte": {1 << 20: 3e-9}, "message_cpu": 40e-6,
           "shard_message_cpu": 15e-6, "worker_message_cpu": 20e-6}
    w = beside_wire(WIRE, cpu, shard_handle=5e-6, worker_thread=30e-6)
    assert (w.cpu_per_byte, w.message_cpu, w.shard_message_cpu, w.worker_message_cpu) == (
        {1 << 20: 3e-9}, pytest.approx(5e-6), pytest.approx(10e-6), 0.0)
    assert (w.rate_bps, w.efficiency, w.round_trip) == (WIRE.rate_bps, WIRE.efficiency,
                                                         WIRE.round_trip)
    assert beside_wire(WIRE, None, shard_handle=5e-6, worker_thread=30e-6) is WIRE


@pytest.mark.timeout(120)
def test_a_contention_child_that_dies_is_an_error_not_a_hang():
    """A child that exits without its figure (here: a scheme it does not know) closed the
    only write end of its pipe, so the parent reads EOF and says which children failed; it
    used to wait on the pipe forever."""
    from bitps.bench.scale_costs import measure_contention

    with pytest.raises(RuntimeError, match=r"'nope'.*exited without its figure.*exit codes"):
        measure_contention(("nope",), keys=1, n=256, cores=2, rounds=1)


@pytest.mark.timeout(300)
def test_the_smallest_scale_run_writes_its_results(tmp_path):
    """One worker, one shard, fp32 at 10 Gbit/s (namespaces where they can be made, else
    loopback): the costs, the wire's, one measured point beside its prediction, and the
    extrapolation table."""
    out = subprocess.run([sys.executable, "-m", "bitps.bench", "--out", str(tmp_path), "scale",
                          "--quick", "--workers", "1", "--shards", "1", "--rates", "10gbit",
                          "--schemes", "fp32", "--max-shards", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode in (0, 1), out.stderr  # 1 = a point outside the tolerance
    doc = json.loads((tmp_path / "scale.json").read_text())
    [row] = doc["rows"]
    assert (row["rate"], row["scheme"], row["workers"], row["shards"]) == ("10gbit", "fp32",
                                                                          1, 1)
    assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
    assert row["ratio"] == pytest.approx(row["measured_ms"] / row["predicted_ms"])
    # the costs its prediction used were measured beside it, before and after
    assert set(row["beside"]) >= {"before", "after", "contention", "message_cpu_us"}
    assert row["drift"].startswith("shard ")
    assert list(doc["checks"]) == ["10gbit fp32 1x1 within 15%"]
    cfg = doc["config"]
    assert cfg["links"]["10gbit"]["kind"] in ("netns", "loopback")
    assert cfg["costs"]["fp32"]["push_bytes"] == 1.0 and cfg["memcpy_gbps"] > 0
    # the default plan's 1 MiB keys, then 16 MiB keys (their costs measured too)
    assert [(r["scheme"], r["key_mib"], r["link_gbps"]) for r in cfg["extrapolation"]] == [
        ("fp32", k, g) for k in (1, 16) for g in (10, 25, 100)]
    assert set(cfg["cost_figures_ms"]) == {"fp32", "16 MiB keys"}
    assert all(len(r["by_shards"]) == 4 for r in cfg["extrapolation"])
    md = (tmp_path / "scale.md").read_text()
    assert "| 10gbit | fp32 | 1 | 1 |" in md and "## Extrapolation: 64 workers, 30 B" in md
