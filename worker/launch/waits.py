"""Who waits for whom: every shard's ``Status`` asked, merged, printed and explained; the
library under ``bitps-status`` (:mod:`.status`) and the line ``bitps-worker`` logs while a pull
waits (:func:`describe_wait`).

Each shard reports, per worker rank, its clock, whether it is live, left or dropped, how long
ago it was heard from, how far it is ahead of the slowest live worker and behind the fastest,
and its held pulls: the step each one is for, how long it has waited and *whom it waits for*
(the ranks the consistency mode needs to push or advance). :func:`fetch` asks every shard at
once; :func:`merge` folds the replies into one document; :func:`render` prints rich tables and,
for every waited-for rank, one plain sentence::

    rank 1 is waited for by rank 0 on shard 0 for 3.2 s; last heard 0.4 s ago (it still
    heartbeats: its step is stuck or slow; it is at clock 0)

:func:`describe_wait` is the same diagnosis for one rank on one shard, in one line.

No torch and no ``PSClient`` here: plain gRPC stubs, so it runs anywhere the shards are
reachable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from rich.console import Console
from rich.table import Table

from bitps.proto import bitps_pb2 as pb
from bitps.proto import bitps_pb2_grpc as pb_grpc

__all__ = ["SILENT_FRACTION", "ShardAnswer", "describe_wait", "explain_wait", "fetch", "merge",
           "render"]

_TOKEN_METADATA_KEY = "bitps-token"  # the shards check it before they read a request
_STATES = ("dropped", "absent", "left", "live")  # a rank's worst state over shards comes first
SILENT_FRACTION = 0.25
"""A rank unheard for longer than this fraction of the shards' heartbeat timeout is called
silent: workers heartbeat every second by default (``ClientConfig.heartbeat_s``) and shards
drop them after 10 s, so a quarter of it is several heartbeats missed, not one late."""


@dataclass(frozen=True)
class ShardAnswer:
    """What one server said: its ``reply``, or ``error`` (the gRPC status, in words) when it
    did not answer. ``index`` is its place in ``--servers`` (its shard id when listed in
    order)."""

    index: int
    server: str
    reply: pb.StatusReply | None = None
    error: str = ""


def _status(stub: pb_grpc.ControlStub, token: str, timeout_s: float) -> pb.StatusReply:
    return stub.Status(pb.StatusRequest(token=token), timeout=timeout_s,
                       metadata=((_TOKEN_METADATA_KEY, token),) if token else None)


def _rpc_words(err: grpc.RpcError) -> str:
    return f"{err.code().name}: {err.details() or 'no details'}"


def fetch(servers: Sequence[str], *, token: str = "", timeout_s: float = 5.0,
          credentials: grpc.ChannelCredentials | None = None) -> list[ShardAnswer]:
    """Every server's ``Status``, asked at once (one slow shard costs ``timeout_s``, not one
    per shard), in ``servers`` order, over TLS with ``credentials``. Never raises for a shard
    that fails: its answer carries the error."""
    def ask(index: int, server: str) -> ShardAnswer:
        with (grpc.insecure_channel(server) if credentials is None
              else grpc.secure_channel(server, credentials)) as channel:
            try:
                reply = _status(pb_grpc.ControlStub(channel), token, timeout_s)
            except grpc.RpcError as err:
                return ShardAnswer(index, server, error=_rpc_words(err))
        return ShardAnswer(index, server, reply=reply)

    with ThreadPoolExecutor(max_workers=min(len(servers), 32) or 1) as pool:
        return list(pool.map(ask, range(len(servers)), servers))


# -- merging -------------------------------------------------------------------------------------
def _state(w: pb.WorkerStatus) -> str:
    if not w.registered:
        return "absent"
    return "left" if w.left else "dropped" if w.dropped else "live"


def _shard_doc(a: ShardAnswer) -> dict:
    if a.reply is None:
        return {"index": a.index, "server": a.server, "answered": False, "error": a.error}
    r = a.reply
    return {"index": a.index, "server": a.server, "answered": True, "shard_id": r.shard_id,
            "mode": r.mode, "staleness": r.staleness, "min_clock": r.min_clock,
            "max_clock": r.max_clock, "world_size": r.world_size, "initialized": r.initialized,
            "held_pulls": r.held_pulls, "heartbeat_timeout_s": r.heartbeat_timeout_s}


def _waits(answers: Sequence[ShardAnswer]) -> list[dict]:
    """Every held pull the shards list, as ``{rank, shard, clock, waited_s, ...}``."""
    return [{"rank": w.rank, "shard": a.reply.shard_id, "clock": h.clock,
             "waited_s": round(h.waited_s, 3), "deadline_in_s": round(h.deadline_in_s, 3),
             "num_keys": h.num_keys, "waiting_for": list(h.waiting_for), "reason": h.reason}
            for a in answers if a.reply is not None for w in a.reply.workers for h in w.held]


def _workers(answers: Sequence[ShardAnswer], waits: list[dict]) -> list[dict]:
    """One entry per rank over every shard that knows it."""
    by_rank: dict[int, dict] = {}
    for a in answers:
        for w in a.reply.workers if a.reply is not None else ():
            d = by_rank.setdefault(w.rank, {"rank": w.rank, "clocks": {}, "states": {},
                                            "last_heard_s": None, "ahead_of_min": 0,
                                            "behind_fastest": 0, "held_pulls": 0,
                                            "samples_per_s": 0.0})
            sid = str(a.reply.shard_id)
            d["clocks"][sid], d["states"][sid] = w.clock, _state(w)
            heard = round(w.seconds_since_seen, 3)
            d["last_heard_s"] = heard if d["last_heard_s"] is None else min(d["last_heard_s"],
                                                                            heard)
            d["ahead_of_min"] = max(d["ahead_of_min"], w.clock_lead)
            d["behind_fastest"] = max(d["behind_fastest"], w.clock_lag)
            d["held_pulls"] += w.pending_pulls
            # its compute speed as its heartbeats reported (BatchBalance; 0: none); shards a
            # report apart may differ: the largest
            d["samples_per_s"] = max(d["samples_per_s"], round(w.samples_per_s, 3))
    for d in by_rank.values():
        d["clock"] = min(d["clocks"].values())
        d["state"] = min(d["states"].values(), key=_STATES.index)
        d["waits_for"] = sorted({r for x in waits if x["rank"] == d["rank"]
                                 for r in x["waiting_for"]})
    return [by_rank[r] for r in sorted(by_rank)]


def _stalled(waits: list[dict], workers: list[dict]) -> list[dict]:
    """The ranks somebody waits for, each with who waits, where and for how long."""
    known = {w["rank"]: w for w in workers}
    out: dict[int, dict] = {}
    for x in waits:
        for r in x["waiting_for"]:
            s = out.setdefault(r, {"rank": r, "waited_by": set(), "shards": set(),
                                   "waited_s": 0.0})
            s["waited_by"].add(x["rank"])
            s["shards"].add(x["shard"])
            s["waited_s"] = max(s["waited_s"], x["waited_s"])
    for s in out.values():
        w = known.get(s["rank"], {})
        s.update(waited_by=sorted(s["waited_by"]), shards=sorted(s["shards"]),
                 last_heard_s=w.get("last_heard_s"), state=w.get("state", "absent"),
                 clock=w.get("clock"))
    return sorted(out.values(), key=lambda s: -s["waited_s"])


def _listed(word: str, items: Sequence[int]) -> str:
    """``rank 0`` / ``ranks 0, 2``."""
    return f"{word}{'s' if len(items) > 1 else ''} {', '.join(map(str, items))}"


def _stall_sentence(s: dict, timeout_s: float) -> str:
    """The plain sentence naming one waited-for rank, and what its silence suggests."""
    heard = s["last_heard_s"]
    head = (f"rank {s['rank']} is waited for by {_listed('rank', s['waited_by'])} on "
            f"{_listed('shard', s['shards'])} for {s['waited_s']:.1f} s")
    if s["state"] == "absent":
        return head + "; it has not registered (is it running?)"
    # A rank that still heartbeats lives, and its training step is what is late; one silent
    # for several heartbeats (SILENT_FRACTION of the timeout) is likely dead, hung or cut off.
    hint = (f"silent: dead, hung or cut off? shards drop it after {timeout_s:.0f} s of "
            f"silence" if heard > SILENT_FRACTION * timeout_s else
            f"it still heartbeats: its step is stuck or slow; it is at clock {s['clock']}")
    return f"{head}; last heard {heard:.1f} s ago ({hint})"


def merge(answers: Sequence[ShardAnswer]) -> dict:
    """One JSON-ready document from every shard's answer: ``ok`` (every shard answered),
    ``shards``, ``workers`` (by rank, merged over shards: ``clock`` is the lowest any shard
    has, ``state`` the worst of live < left < absent < dropped, ``last_heard_s`` the most
    recent), ``waits`` (every listed held pull and whom it waits for), ``stalled`` (each
    waited-for rank: by whom, on which shards, for how long, longest first) and
    ``findings``, the sentences :func:`render` prints."""
    waits = _waits(answers)
    workers = _workers(answers, waits)
    stalled = _stalled(waits, workers)
    timeout_s = max((a.reply.heartbeat_timeout_s for a in answers if a.reply is not None),
                    default=0.0)
    findings = [f"shard {a.index} ({a.server}) did not answer: {a.error}"
                for a in answers if a.reply is None]
    findings += [_stall_sentence(s, timeout_s) for s in stalled]
    # a held pull that names nobody (a mode that does not say): its own words at least
    findings += [f"rank {x['rank']} waits on shard {x['shard']} for {x['waited_s']:.1f} s: "
                 f"{x['reason']}" for x in waits if not x["waiting_for"]]
    return {"ok": all(a.reply is not None for a in answers), "time": time.time(),
            "shards": [_shard_doc(a) for a in answers], "workers": workers, "waits": waits,
            "stalled": stalled, "findings": findings}


# -- printing ------------------------------------------------------------------------------------
def _shards_table(doc: dict) -> Table:
    t = Table(title="shards")
    for col in ("shard", "server", "mode", "clocks", "held", "status"):
        t.add_column(col)
    for s in doc["shards"]:
        if not s["answered"]:
            t.add_row(str(s["index"]), s["server"], "", "", "", "[red]no answer (see below)")
            continue
        mode = s["mode"] + (f" S={s['staleness']}" if s["mode"] == "ssp" else "")
        t.add_row(str(s["shard_id"]), s["server"], mode, f"{s['min_clock']}..{s['max_clock']}",
                  str(s["held_pulls"]), "ok" if s["initialized"] else "waiting for rank 0")
    return t


def _workers_table(doc: dict) -> Table:
    t = Table(title="workers", caption="lead: clocks ahead of the slowest live worker; lag: "
                                       "behind the fastest")
    for col in ("rank", "state", "clock", "lead", "lag", "last heard", "held", "waits for",
                "samples/s"):
        t.add_column(col)
    waited = {s["rank"] for s in doc["stalled"]}
    for w in doc["workers"]:
        lo, hi = min(w["clocks"].values()), max(w["clocks"].values())
        state = w["state"] if w["state"] == "live" else f"[yellow]{w['state']}"
        rank = f"[bold red]{w['rank']}" if w["rank"] in waited else str(w["rank"])
        t.add_row(rank, state, str(lo) if lo == hi else f"{lo}..{hi}",
                  str(w["ahead_of_min"]), str(w["behind_fastest"]), f"{w['last_heard_s']:.1f} s",
                  str(w["held_pulls"]), ", ".join(map(str, w["waits_for"])) or "-",
                  f"{w['samples_per_s']:g}" if w["samples_per_s"] else "-")
    return t


def render(doc: dict, console: Console) -> None:
    """Print :func:`merge`'s document as tables, then its findings as plain sentences (never
    wrapped, so that a log grep finds them whole)."""
    console.print(_shards_table(doc))
    if doc["workers"]:
        console.print(_workers_table(doc))
    for line in doc["findings"] or ["nobody waits for anybody"]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


# -- one rank, one shard: what a waiting worker logs ---------------------------------------------
def explain_wait(reply: pb.StatusReply, rank: int) -> str:
    """One line: what shard ``reply`` says rank ``rank``'s held pull waits for (the lowest
    clock's), naming each waited-for rank with its clock and when it was last heard."""
    workers = {w.rank: w for w in reply.workers}
    me = workers.get(rank)
    if me is None or not me.held:
        return (f"shard {reply.shard_id} holds no pull of rank {rank} (its reply is on the way, "
                f"or the wait is in the network or on this side)")
    h = me.held[0]
    head = (f"shard {reply.shard_id} holds rank {rank}'s pull for clock {h.clock} "
            f"({h.waited_s:.1f} s, {me.pending_pulls} held)")
    if not h.waiting_for:
        return f"{head}: {h.reason}"
    named = [f"rank {r} (clock {workers[r].clock}, last heard "
             f"{workers[r].seconds_since_seen:.1f} s ago)" if r in workers else f"rank {r}"
             for r in h.waiting_for]
    return f"{head}, waiting for {', '.join(named)}"


def describe_wait(stub: pb_grpc.ControlStub | Callable[[], pb.StatusReply], rank: int, *,
                  token: str = "", timeout_s: float = 2.0) -> str:
    """:func:`explain_wait` of a fresh ``Status``: from ``stub`` (a ``ControlStub``, asked
    with ``token`` within ``timeout_s``) or a callable returning the reply
    (``lambda: client.status(shard)``). Never raises: a worker calls it while it waits, and a
    failed diagnosis must not fail the wait, so a failure is the line's content."""
    try:
        reply = _status(stub, token, timeout_s) if hasattr(stub, "Status") else stub()
    except grpc.RpcError as err:
        return f"the shard did not answer Status: {_rpc_words(err)}"
    except Exception as err:  # a PSError or a transport error from the callable
        return f"the shard did not answer Status: {type(err).__name__}: {err}"
    return explain_wait(reply, rank)
