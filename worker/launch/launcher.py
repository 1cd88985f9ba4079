"""``bitps-launch``: a local cluster of PS shards and worker ranks, with progress and teardown.

    bitps-launch --shards 2 --workers 2 --mode async -- --steps 150

Everything after ``--`` goes to every ``bitps-worker``. Shards start first (each prints a JSON
``ready`` line with its ports), then workers (``--json`` progress lines). A progress bar shows
step, loss and samples/s; a summary table follows. Any process failing, Ctrl-C or SIGTERM tears the
whole cluster down (each child runs in its own process group and dies with the launcher), and the
exit status is non-zero. Logs, ``cluster.json`` (every endpoint, written once all workers have
started), ``steps.jsonl`` (every worker's step lines) and ``summary.json`` go to ``--run-dir``.
With ``--checkpoints`` every shard checkpoints into the run dir, and SIGHUP to the launcher is a
rolling restart of the shards (``worker.launch.rolling``).

The launcher starts processes; it imports neither ``ps`` nor the torch side of ``worker``, and
restates no default of theirs: ``--mode``, ``--staleness`` and ``--optimizer`` reach the shards
only when given (else each shard reads its own: flag, environment, ``--config`` file, default),
the mode reported is the one the shards' ready lines name, and the progress bars' length is the
step count each worker's ``start`` line names. ``--host`` and ``--lr`` are the launcher's own
(a cluster on loopback; the demo model's learning rate, or DiLoCo's outer one) and always
passed. ``--algorithm`` adds its preset flags (:data:`ALGORITHM_PRESETS`) before the ones
given, which win.

**Your own training script** (``--script FILE``): the shards, then ``--workers`` runs of
``python FILE`` (everything after ``--`` goes to each) instead of ``bitps-worker``, each with
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and ``BITPS_SERVERS``, the shards' gRPC addresses. A script prints text, not
progress lines: every line it writes (stdout and stderr) is shown with its rank's name and
kept in its log; the run fails if any rank exits non-zero (the script checks its own loss)::

    bitps-launch --shards 2 --workers 2 --script examples/train.py -- --steps 200

**Pipelines** (``--dp D --pp P``, or ``--config FILE`` with a ``[parallel_config]`` table):
the shards, then D x P stage processes (``python -m bitps.worker.pipeline``; everything after
``--`` goes to each, e.g. ``--model deep --steps 50``), each with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)::

    bitps-launch --dp 2 --pp 4 --micro-batch-size 8 --gradient-accumulation-steps 4 \
        --schedule 1f1b -- --model deep --steps 50

The whole plan is read and checked first, through the stage processes' own settings reader
and ``ParallelConfig.check`` against the model's layer count (so the one model registry is
imported, with torch): a refused configuration exits 2 naming the value before any directory
is made or any process starts. torchrun can start the stage processes instead, against shards
started by hand (docs/pipeline.md)::

    torchrun --nproc-per-node 8 -m bitps.worker.pipeline --servers HOST:PORT,... \
        --config pp.toml --json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bitps.worker.launch.processes import Child, Cluster
from bitps.worker.launch.rolling import RollingRestart

__all__ = ["main"]

console = Console(stderr=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@dataclass(frozen=True)
class _Preset:
    """What ``--algorithm`` adds to every shard's and every worker's command line (before the
    flags given explicitly, which win)."""

    shard: tuple[str, ...]
    worker: tuple[str, ...]
    lr: float


ALGORITHM_PRESETS = {
    "ps": _Preset(shard=(), worker=(), lr=3e-3),
    # DiLoCo (Douillard et al. 2023): outer SGD with Nesterov momentum 0.9 at lr 0.7
    "diloco": _Preset(shard=("--optimizer", "nesterov", "--momentum", "0.9"),
                      worker=("--algorithm", "diloco", "--push-codec", "sign1",
                              "--compress-min-bytes", "0"), lr=0.7),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bitps-launch", description=__doc__.split("\n")[0],
                                usage="bitps-launch [options] [-- worker args]")
    add = p.add_argument
    add("--shards", type=int, default=2, help="PS shard processes")
    add("--workers", type=int, default=2, help="worker rank processes")
    add("--mode", default=None, help="consistency model of every shard (not given: the "
                                      "shards' own setting)")
    add("--staleness", type=int, default=None,
        help="SSP bound of every shard (not given: the shards' own setting)")
    add("--optimizer", default=None,
        help="server update rule of every shard (not given: the shards' own setting)")
    add("--algorithm", default="ps", choices=tuple(ALGORITHM_PRESETS),
        help="ps: the shards run the optimizer on every step's gradients; diloco: local SGD, "
             "the shards run DiLoCo's outer SGD (Nesterov momentum 0.9, lr 0.7) on sign1 "
             "pseudo-gradients of every tensor (workers get --algorithm diloco --push-codec sign1 "
             "--compress-min-bytes 0; flags given after -- win)")
    add("--lr", type=float, default=None,
        help="server learning rate (default: 3e-3, the demo model's; diloco: 0.7)")
    add("--server-arg", action="append", default=[], help="extra bitps-server flag (repeatable)")
    add("--host", default="127.0.0.1", help="address the shards bind to and workers dial")
    add("--run-dir", default=None, help="logs + summary.json (default runs/<timestamp>)")
    add("--ready-timeout", type=float, default=60.0, help="seconds for shards to become ready")
    add("--curve", action="store_true",
        help="encrypt and authenticate the data plane with CURVE: key pairs for the shards "
             "and one per worker rank are generated into RUN_DIR/keys (bitps-keygen's "
             "layout) and passed to every process")
    add("--checkpoints", action="store_true",
        help="every shard checkpoints into RUN_DIR/checkpoints/shard-I (a final one when it "
             "stops); SIGHUP to the launcher then restarts the shards one at a time while "
             "training runs (a rolling restart)")
    add("--script", default=None, metavar="FILE",
        help="run `python FILE` as each worker rank instead of bitps-worker (everything after "
             "-- goes to it), with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and "
             "BITPS_SERVERS (the shards' gRPC addresses) set; its output is shown per rank and "
             "logged, and any rank exiting non-zero fails the run (not with --algorithm "
             "diloco, --expect-loss-drop or the pipeline options)")
    add("--expect-loss-drop", type=float, default=0.0,
        help="fail unless every rank's final loss is this fraction below its first (0 = off; "
             "pipelines: every last stage's)")
    pp = p.add_argument_group("pipelines", "given any of these, start D x P pipeline stage "
                              "processes (python -m bitps.worker.pipeline) instead of "
                              "--workers bitps-worker ranks; not given: the stages' own "
                              "settings (flag after --, environment, --config file, default)")
    for flag, dest, kind, what in _PIPELINE_FLAGS:
        pp.add_argument(flag, dest=dest, type=kind, default=None, help=what)
    pp.add_argument("--config", default=None, metavar="FILE",
                    help="TOML settings file of the stage processes, e.g. with a "
                         "[parallel_config] table; flags win over it")
    return p


_PIPELINE_FLAGS = (
    ("--dp", "data_parallel_size", int, "data-parallel replicas D"),
    ("--pp", "pipeline_parallel_size", int, "pipeline stages P per replica"),
    ("--micro-batch-size", "micro_batch_size", int, "samples per micro-batch"),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps", int,
     "micro-batches per step (m)"),
    ("--schedule", "schedule", str, "pipeline schedule (gpipe, 1f1b, zb-h1, zb-v, 2bw)"),
)
"""The launcher's pipeline flags: (flag, dest, type, help). Each is passed to every stage as
its ``--<dest with dashes>`` (``--dp 2`` as ``--data-parallel-size 2``), so the stages'
settings reader checks it."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    worker_args = argv[split + 1:]
    if args.script is not None and (refused := _script_refusal(args)) is not None:
        console.print(f"bitps-launch: {refused}", markup=False, highlight=False, soft_wrap=True)
        return 2
    pipeline = None
    if args.config is not None or any(getattr(args, d) is not None
                                      for _, d, _, _ in _PIPELINE_FLAGS):
        try:  # before anything exists: a refused plan starts nothing
            pipeline = _pipeline_plan(args, worker_args)
        except ValueError as err:
            console.print(f"bitps-launch: {type(err).__name__}: {err}", markup=False,
                          highlight=False, soft_wrap=True)
            return 2
        except SystemExit as exit:  # a stage flag argparse refused; it said why
            return 2 if exit.code is None else int(exit.code)
    if args.shards < 1 or args.workers < 1:
        console.print(f"[red]--shards and --workers must be >= 1, got {args.shards}, "
                      f"{args.workers}")
        return 2
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(run_dir)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.script is not None:
            code = _run_script(cluster, args, worker_args)
        elif pipeline is None:
            code = _run(cluster, args, worker_args)
        else:
            code = _run_pipeline(cluster, args, pipeline)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: tearing the cluster down")
        code = 130
    finally:
        cluster.teardown()
    console.print(f"logs: {run_dir}/")
    return code


def _start_shards(cluster: Cluster, args, clients: int | None = None) -> list[dict] | None:
    """Start ``--shards`` shards for ``clients`` worker processes (default ``--workers``);
    their ready lines, or None (explained) if one failed."""
    clients = args.workers if clients is None else clients
    py = sys.executable
    shards = []
    preset = ALGORITHM_PRESETS[args.algorithm]
    lr = preset.lr if args.lr is None else args.lr
    given = [arg for flag, value in (("--mode", args.mode), ("--staleness", args.staleness),
                                     ("--optimizer", args.optimizer)) if value is not None
             for arg in (flag, str(value))]
    argvs = []
    for i in range(args.shards):
        ckpt = ["--checkpoint-dir", str(cluster.run_dir / "checkpoints" / f"shard-{i}")] \
            if args.checkpoints else []
        argvs.append([
            py, "-m", "bitps.ps", "--shard-id", str(i), "--num-shards", str(args.shards),
            "--host", args.host, *preset.shard, *given, "--lr", str(lr), *ckpt,
            *_curve_shard_flags(cluster, args, clients),
            # the local cluster's shards share the cores with its workers (--server-arg wins)
            "--threads", "1", *args.server_arg])
        shards.append(cluster.spawn(f"shard-{i}", argvs[-1]))
    ready = _wait_ready(cluster, shards, args.ready_timeout)
    if ready is None:
        return None
    rolling = RollingRestart(cluster, shards, argvs, ready, console=console,
                             enabled=args.checkpoints)
    signal.signal(signal.SIGHUP, rolling.request)
    for r in ready:
        console.print(f"shard {r['shard_id']}: grpc {r['grpc_port']} data {r['data_port']} "
                      f"metrics http://{args.host}:{r['metrics_port']}/metrics")
    return ready


# -- CURVE (--curve) ----------------------------------------------------------------------------
def _keys(cluster: Cluster) -> Path:
    return cluster.run_dir / "keys"


def _curve_shard_flags(cluster: Cluster, args, clients: int) -> list[str]:
    """The shards' CURVE flags, every client's key pair made first: a shard reads the keys
    it allows when it starts (the shard pair is written with the first client's)."""
    if not args.curve:
        return []
    for rank in range(clients):
        _curve_client_files(cluster, rank)
    keys = _keys(cluster)
    return ["--curve-secret-key", str(keys / "server.key_secret"),
            "--curve-allowed-keys", str(keys / "allowed")]


def _curve_client_files(cluster: Cluster, rank: int) -> tuple[Path, Path]:
    """Rank ``rank``'s key pair (made once, with ``bitps.proto.keys.keygen``): the shards'
    public key and this rank's secret key files."""
    from bitps.proto.keys import keygen

    keys = _keys(cluster)
    secret = keys / f"worker-{rank}.key_secret"
    if not secret.exists():
        keygen(keys, f"worker-{rank}")
    return keys / "server.key", secret


def _curve_client_flags(cluster: Cluster, args, rank: int) -> list[str]:
    if not args.curve:
        return []
    server, secret = _curve_client_files(cluster, rank)
    return ["--curve-server-key", str(server), "--curve-client-key", str(secret)]


def _curve_client_env(cluster: Cluster, args, rank: int) -> dict[str, str]:
    """For a script: the variables ``bitps.connect()`` reads the CURVE keys from."""
    if not args.curve:
        return {}
    server, secret = _curve_client_files(cluster, rank)
    return {"BITPS_CURVE_SERVER_KEY": str(server), "BITPS_CURVE_CLIENT_KEY": str(secret)}


def _run(cluster: Cluster, args, worker_args: list[str]) -> int:
    py = sys.executable
    preset = ALGORITHM_PRESETS[args.algorithm]
    ready = _start_shards(cluster, args)
    if ready is None:
        return 1
    servers = ",".join(f"{args.host}:{r['grpc_port']}" for r in ready)
    workers = [cluster.spawn(f"worker-{r}", [
        py, "-m", "bitps.worker", "--servers", servers, "--rank", str(r), "--world-size",
        str(args.workers), "--json", *preset.worker, *_curve_client_flags(cluster, args, r),
        *worker_args]) for r in range(args.workers)]
    threading.Thread(target=_write_endpoints, args=(cluster, ready, workers), daemon=True).start()
    code = _follow(cluster, workers)
    with (cluster.run_dir / "steps.jsonl").open("w") as f:
        for w in workers:
            for e in w.events:
                if e.get("event") == "step":
                    f.write(json.dumps(e) + "\n")
    summary = {"mode": ready[0].get("mode", args.mode), "shards": ready,
               "workers": [next((e for e in w.events if e["event"] == "done"), None)
                           for w in workers],
               "starts": [next((e for e in w.events if e["event"] == "start"), None)
                          for w in workers]}
    (cluster.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if code == 0:
        code = _report(summary, args.expect_loss_drop)
    return code


def _write_endpoints(cluster: Cluster, ready: list[dict], workers: list[Child]) -> None:
    """``cluster.json`` in the run dir: every metrics endpoint, once every worker has started."""
    while any(not w.events for w in workers):
        if cluster.failed() is not None:
            return
        time.sleep(0.1)
    # the launcher's own pid too: SIGHUP to it is a rolling restart (--checkpoints)
    pids = {"launcher": os.getpid(), **{c.name: c.proc.pid for c in cluster.children}}
    doc = {"shards": ready, "workers": [w.events[0] for w in workers], "pids": pids}
    tmp = cluster.run_dir / "cluster.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(cluster.run_dir / "cluster.json")


def _wait_ready(cluster: Cluster, shards: list[Child], timeout: float) -> list[dict] | None:
    deadline = time.monotonic() + timeout
    ready: dict[int, dict] = {}
    while len(ready) < len(shards):
        if (bad := cluster.failed()) is not None or time.monotonic() > deadline:
            _explain(bad or shards[0], "did not become ready" if bad is None else None)
            return None
        try:
            child, event = cluster.events.get(timeout=0.2)
        except queue.Empty:
            continue
        if event.get("event") == "ready":
            ready[event["shard_id"]] = event
    return [ready[i] for i in range(len(shards))]


def _worker_start(event: dict) -> str:
    return (f"metrics http://127.0.0.1:{event['metrics_port']}/metrics, {event['params']} "
            f"params in {event['keys']} keys, corpus sha256 {event['corpus_sha256'][:16]}…")


def _stage_start(event: dict) -> str:
    return (f"replica {event['replica']} stage {event['stage']}: layers {event['layers']}, "
            f"{event['params']} params in {event['keys']} keys, metrics "
            f"http://127.0.0.1:{event['metrics_port']}/metrics")


def _follow(cluster: Cluster, workers: list[Child],
            describe: Callable[[dict], str] = _worker_start) -> int:
    """Progress bars of ``workers`` until they exit; ``describe`` words a ``start`` line."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        # A bar's length is the steps the worker's start line names (its flag, environment,
        # file or default: the launcher does not parse worker arguments).
        tasks = {w.name: bar.add_task(w.name, total=None, loss="-", rate="-") for w in workers}
        while any(w.proc.poll() is None for w in workers) or not cluster.events.empty():
            if (bad := cluster.failed()) is not None:
                bar.stop()
                _explain(bad, None)
                return 1
            try:
                child, event = cluster.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if child.name in tasks and event.get("event") == "step":
                loss = event.get("loss")  # a pipeline's last stage only has one
                bar.update(tasks[child.name], completed=event["step"] + 1,
                           loss="-" if loss is None else f"{loss:.3f}",
                           rate=f"{event['samples_per_s']:.1f}")
            elif child.name in tasks and event.get("event") == "start":
                bar.update(tasks[child.name], total=event.get("steps"))
                console.print(f"{child.name}: {describe(event)}", markup=False)
            elif event.get("event") == "error":
                console.print(f"{child.name}: {event.get('error')}", style="red", markup=False,
                              highlight=False)
    if (bad := cluster.failed()) is not None:
        _explain(bad, None)
        return 1
    return 0


# -- a user's script ----------------------------------------------------------------------------


def _script_refusal(args) -> str | None:
    """Why ``--script`` cannot run with the other options given, or None."""
    if not Path(args.script).is_file():
        return f"--script {args.script!r}: no such file"
    given = [flag for flag, dest, _, _ in _PIPELINE_FLAGS if getattr(args, dest) is not None]
    given += ["--config"] * (args.config is not None)
    if given:
        return f"--script runs worker ranks, not pipeline stages; got {', '.join(given)}"
    if args.algorithm != "ps":
        return (f"--algorithm {args.algorithm} sets bitps-worker flags; a script trains with "
                f"the shards' optimizer (--algorithm ps)")
    if args.expect_loss_drop:
        return (f"--expect-loss-drop {args.expect_loss_drop} reads bitps-worker's progress "
                f"lines; a script checks its own loss (examples/train.py: --expect-loss-drop "
                f"after --)")
    return None


def _run_script(cluster: Cluster, args, script_args: list[str]) -> int:
    ready = _start_shards(cluster, args)
    if ready is None:
        return 1
    servers = ",".join(f"{args.host}:{r['grpc_port']}" for r in ready)
    env = {"WORLD_SIZE": str(args.workers), "MASTER_ADDR": args.host,
           "MASTER_PORT": str(_free_port(args.host)), "BITPS_SERVERS": servers}
    workers = [cluster.spawn(f"worker-{r}", [sys.executable, args.script, *script_args],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r),
                                      **_curve_client_env(cluster, args, r)), echo=True)
               for r in range(args.workers)]
    doc = {"shards": ready, "servers": servers,
           "pids": {c.name: c.proc.pid for c in cluster.children}}
    tmp = cluster.run_dir / "cluster.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(cluster.run_dir / "cluster.json")
    return _follow_output(cluster, workers)


def _follow_output(cluster: Cluster, workers: list[Child]) -> int:
    """Show the workers' output lines until every one has ended; 1 if a process failed."""
    running = {w.name for w in workers}
    while running:
        if (bad := cluster.failed()) is not None and bad.name not in running:
            _explain(bad, None)  # a shard (a worker is explained once its output has ended)
            return 1
        try:
            child, event = cluster.events.get(timeout=0.2)
        except queue.Empty:
            continue
        if event.get("event") == "output":
            console.print(f"{child.name}: {event['line']}", markup=False, highlight=False,
                          soft_wrap=True)
        elif event.get("event") == "eof":
            running.discard(child.name)
            if child.proc.wait() != 0:
                _explain(child, None)
                return 1
    console.print(f"every rank of {len(workers)} exited 0")
    return 0


# -- pipelines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pipeline:
    """A checked pipeline plan: what every stage process is given, and its layout."""

    argv: list[str]
    """Every stage's arguments (pipeline flags, --config, then those after --)."""
    dp: int
    pp: int
    model: str
    schedule: str


def _pipeline_plan(args, stage_args: list[str]) -> _Pipeline:
    """Read the stage processes' settings exactly as each will (their own reader, this
    environment, the --config file) and check the plan: a ``ValueError`` naming the refused
    value if the model, the schedule or the batch sizes cannot run it."""
    from bitps.worker.pipeline.settings import check_plan, parse_config

    if args.algorithm != "ps":
        raise ValueError(f"--algorithm {args.algorithm}: pipelines train with the shards' "
                         f"optimizer on every step's gradients (--algorithm ps)")
    argv = [*(["--config", args.config] if args.config is not None else [])]
    for _, dest, _, _ in _PIPELINE_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            argv += ["--" + dest.replace("_", "-"), str(value)]
    argv += stage_args
    # The launcher sets the ranks, the world size (D x P, from what was read) and the servers
    # (their ports are known once the shards are up: a stand-in for now).
    given = [*argv, "--rank", "0", "--servers", f"{args.host}:1"]
    p = parse_config([*given, "--world-size", "1"]).parallel
    world = p.data_parallel_size * p.pipeline_parallel_size
    cfg = parse_config([*given, "--world-size", str(world)])
    check_plan(cfg)
    return _Pipeline(argv=argv, dp=p.data_parallel_size, pp=p.pipeline_parallel_size,
                     model=cfg.stage.model, schedule=p.schedule)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run_pipeline(cluster: Cluster, args, plan: _Pipeline) -> int:
    ready = _start_shards(cluster, args, plan.dp * plan.pp)
    if ready is None:
        return 1
    servers = ",".join(f"{args.host}:{r['grpc_port']}" for r in ready)
    world = plan.dp * plan.pp
    console.print(f"pipeline: {plan.dp} replicas x {plan.pp} stages of {plan.model!r}, "
                  f"schedule {plan.schedule!r}")
    torchrun = {"WORLD_SIZE": str(world), "MASTER_ADDR": args.host,
                "MASTER_PORT": str(_free_port(args.host))}
    stages = [cluster.spawn(f"stage-r{r // plan.pp}-s{r % plan.pp}", [
        sys.executable, "-m", "bitps.worker.pipeline", "--servers", servers, "--json",
        *_curve_client_flags(cluster, args, r), *plan.argv],
        env=dict(torchrun, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
    threading.Thread(target=_write_endpoints, args=(cluster, ready, stages), daemon=True).start()
    code = _follow(cluster, stages, _stage_start)
    with (cluster.run_dir / "steps.jsonl").open("w") as f:
        for st in stages:
            for e in st.events:
                if e.get("event") == "step":
                    f.write(json.dumps(e) + "\n")
    summary = {"mode": ready[0].get("mode", args.mode), "shards": ready,
               "parallel": {"dp": plan.dp, "pp": plan.pp, "schedule": plan.schedule,
                            "model": plan.model},
               "stages": [next((e for e in st.events if e["event"] == "done"), None)
                          for st in stages],
               "starts": [next((e for e in st.events if e["event"] == "start"), None)
                          for st in stages]}
    (cluster.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if code == 0:
        code = _report_pipeline(summary, args.expect_loss_drop)
    return code


def _report_pipeline(summary: dict, expect_drop: float) -> int:
    par = summary["parallel"]
    table = Table(title=f"bitps pipeline {par['dp']} x {par['pp']}, {par['schedule']} "
                        f"({summary['mode']}); b = micro-batch size at the end")
    for col in ("replica", "stage", "layers", "steps", "first", "final", "drop", "bubble",
                "b", "samples/s"):
        table.add_column(col, justify="right")
    code = 0
    for done in summary["stages"]:
        if done is None:
            table.add_row(*["-"] * 10)
            code = 1
            continue
        first, final = done.get("first_loss"), done.get("final_loss")
        drop = None if first is None else 1 - final / first
        if drop is not None and drop < expect_drop:
            code = 1
        table.add_row(str(done["replica"]), str(done["stage"]), done["layers"],
                      str(done["steps"]), "-" if first is None else f"{first:.3f}",
                      "-" if final is None else f"{final:.3f}",
                      "-" if drop is None else f"{drop:.0%}", f"{done['bubble']:.2f}",
                      str(done["micro_batch_size"]), f"{done['samples_per_s']:.0f}")
    console.print(table)
    if code:
        console.print(f"[red]expected every last stage's loss to fall by >= {expect_drop:.0%}")
    return code


def _explain(child: Child, why: str | None) -> None:
    status = why or f"exited with status {child.proc.returncode}"
    tail = child.log.read_text(errors="replace").splitlines()[-15:] if child.log.exists() else []
    console.print(f"[red]{child.name} {status}; last lines of {child.log}:")
    for line in tail:
        console.print(f"  {line}", markup=False, highlight=False)


def _report(summary: dict, expect_drop: float) -> int:
    table = Table(title=f"bitps run ({summary['mode']})")
    for col in ("rank", "steps", "first loss", "final loss", "drop", "samples/s", "seconds",
                "overlap", "util"):
        table.add_column(col, justify="right")
    code = 0
    for rank, done in enumerate(summary["workers"]):
        if done is None:
            table.add_row(str(rank), *["-"] * 8)
            code = 1
            continue
        drop = 1 - done["final_loss"] / done["first_loss"]
        if drop < expect_drop:
            code = 1
        table.add_row(str(rank), str(done["steps"]), f"{done['first_loss']:.3f}",
                      f"{done['final_loss']:.3f}", f"{drop:.1%}", f"{done['samples_per_s']:.1f}",
                      f"{done['seconds']:.1f}", "on" if done.get("overlap") else "off",
                      f"{done.get('utilization', 1.0):.2f}")
    console.print(table)
    for rank, done in enumerate(summary["workers"]):
        if done and done.get("overlap_decision"):
            console.print(f"rank {rank}: {done['overlap_decision']}", markup=False)
    if code:
        console.print(f"[red]expected every rank's loss to fall by >= {expect_drop:.0%}")
    return code


if __name__ == "__main__":
    sys.exit(main())
