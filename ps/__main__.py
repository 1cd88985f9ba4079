"""``bitps-server``: run one PS shard. The one place that reads shard flags and environment.

Every setting is a flag with an environment twin (``--grpc-port`` <- ``BITPS_GRPC_PORT``) and a
key of the ``--config`` TOML file (``grpc-port = 50051``): flag > environment > file > default
(``bitps.proto.settings``). Defaults and allowed values come from the dataclasses of
``ps/config.py`` (and ``LRSchedule``, and each update rule's own section, whose flags the
rule lists: ``UpdateRule.settings``); :func:`program` adds only names and help.
``docs/configuration.md`` is rendered from :data:`PROGRAM`.

Plug-ins (``--plugin MODULE``, ``BITPS_PLUGINS``, config key ``plugins``; docs/plugins.md) are
imported before any other setting is read, so ``--optimizer``, ``--mode`` and the codecs
accept what they register, and a plug-in rule's own flags (its ``UpdateRule.settings``) are
flags of this program.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Mapping, Sequence

from bitps.proto.keys import KeyFileError
from bitps.proto.registry import is_builtin
from bitps.proto.schedule import LRSchedule
from bitps.proto.settings import Program, Setting, from_field, option
from bitps.ps.checkpoint import CheckpointError
from bitps.ps.config import RULES, OptimizerConfig, ServerConfig
from bitps.ps.server import ShardFailure, create_server

__all__ = ["PROGRAM", "build_parser", "main", "parse_config", "program", "rule_settings"]

_S, _O, _L = ServerConfig, OptimizerConfig, LRSchedule


def rule_settings(*, builtin: bool = False) -> list[Setting]:
    """The flags of every registered update rule's own config section
    (``UpdateRule.settings``), in registration order, each once (a rule registered as a
    subclass of another shares its flags); ``builtin``: only bitps's own rules'."""
    out: list[Setting] = []
    for rule in RULES.values():
        if builtin and not is_builtin(rule):
            continue
        out += [s for s in rule.settings if not any(s is seen for seen in out)]
    return out


def program(*, builtin: bool = False) -> Program:
    """bitps-server's settings, in ``--help`` order, with the flags of every update rule
    registered now (a plug-in's too, once loaded: ``Program.load_plugins``); ``builtin``:
    of bitps's own rules only."""
    return Program("bitps-server", "Run one bitps PS shard.", _settings(rule_settings(
        builtin=builtin)), plugins=True)


def _settings(rule_flags: list[Setting]) -> tuple[Setting, ...]:
    return (
        from_field(_S, "shard_id", help="this shard's index, 0 .. num-shards - 1"),
        from_field(_S, "num_shards",
                   help="shards in the cluster (workers cut their key plan for the same number)"),
        from_field(_S, "host", help="bind address of the gRPC, data and metrics endpoints "
                                    "(0.0.0.0 inside containers)"),
        from_field(_S, "grpc_port", help="gRPC control port; 0 = any free port (reported in the "
                                         "ready line)"),
        from_field(_S, "data_port", help="ZeroMQ ROUTER data port; 0 = any free port"),
        from_field(_S, "metrics_port", help="Prometheus port; 0 = any free port, -1 = off"),
        from_field(_S, "health_port", help="plaintext gRPC port with only the health service "
                                           "(probes of a TLS shard); 0 = any free port, -1 = "
                                           "off"),
        from_field(_S, "mode", help="consistency model: sync (BSP), async (ASP), ssp (bounded "
                                    "staleness) or a plug-in's"),
        from_field(_S, "staleness", help="SSP bound S: a worker at clock c waits until every live "
                                         "worker has reached c - S"),
        from_field(_O, "name", name="optimizer",
                   help="server-side update rule (a plug-in's too)"),
        from_field(_O, "lr", help="learning rate (the peak, with a schedule)"),
        from_field(_L, "warmup_steps", name="lr-warmup",
                   help="clocks of linear learning-rate warm-up"),
        from_field(_L, "decay_steps", name="lr-decay",
                   help="clock at which the cosine decay ends (0 = constant after the warm-up); "
                        "evaluated at the push's clock (async/ssp) or the step's (sync)"),
        from_field(_L, "min_ratio", name="lr-min-ratio",
                   help="learning-rate factor the cosine ends at"),
        from_field(_O, "momentum", help="momentum factor (momentum)"),
        from_field(_O, "dampening", help="momentum dampening (momentum)"),
        from_field(_O, "nesterov", help="Nesterov momentum (momentum)"),
        from_field(_O, "beta1", help="Adam first-moment decay"),
        from_field(_O, "beta2", help="Adam second-moment decay"),
        from_field(_O, "eps", help="Adam denominator epsilon"),
        from_field(_O, "weight_decay", help="L2 penalty (sgd, momentum, adam) or decoupled decay "
                                            "(adamw, onebit_adam)"),
        *rule_flags,
        from_field(_O, "delta_history",
                   help="compressed pulls and onebit_adam: published codes kept per key; a worker "
                        "further behind gets the parameters"),
        from_field(_S, "heartbeat_timeout_s", name="heartbeat-timeout",
                   help="seconds of silence before a worker is dropped from the live set"),
        from_field(_S, "pull_deadline_s", name="pull-deadline",
                   help="seconds a held pull waits when the request names no deadline"),
        from_field(_S, "token", help="shared secret checked on every gRPC call and data header "
                                     "(empty = none)"),
        from_field(_S, "max_frame_bytes", help="largest payload frame accepted"),
        from_field(_S, "reject_nonfinite",
                   help="refuse NaN/Inf gradients (NON_FINITE error, nothing applied)"),
        from_field(_S, "split_lr", help="async/ssp: apply each push with lr / live workers"),
        from_field(_S, "lookahead", help="async/ssp: answer float32 pulls with the parameters one "
                                         "update ahead per other live worker"),
        from_field(_S, "staleness_damping",
                   help="async/ssp: also scale the learning rate by 1 / (1 + version gap) "
                        "(deprecated: --compensation damping)"),
        from_field(_S, "compensation",
                   help="async/ssp: how a stale push is adjusted: none, damping, gap_aware, "
                        "dc_asgd or a plug-in's (docs/algorithms.md, Staleness)"),
        from_field(_S, "dc_lambda", help="dc_asgd: lambda_0 of the adaptive delay compensation"),
        from_field(_S, "lr_by", help="async/ssp: read a push's learning rate from the schedule at "
                                     "its own clock, or at the job's progress on the key "
                                     "(updates / live pushers)"),
        from_field(_S, "max_clock_lead",
                   help="largest clock step of one request (beyond: BAD_CLOCK, nothing changed)"),
        from_field(_S, "max_held_pulls", help="pulls of one worker held at once (beyond: LIMIT)"),
        from_field(_S, "max_pull_deadline_s", name="max-pull-deadline",
                   help="longest a held pull waits, whatever the request asks for"),
        # BITPS_THREADS, as every shard flag's BITPS_<FLAG>: for a worker it is its torch
        # threads, the same thing (the threads this process computes with)
        from_field(_S, "threads", help="threads updating one message's keys at once (0 = one "
                                       "per core this process may use)"),
        from_field(_S, "max_plan_bytes",
                   help="largest key plan a registration may give this shard (float32 bytes)"),
        from_field(_S, "max_plan_keys", help="most keys a registration may give this shard"),
        from_field(_S, "max_message_keys", help="most keys one data message may name"),
        from_field(_S, "max_workers", help="largest world size a registration may name"),
        from_field(_S, "max_connections", help="most data-plane connections served at once"),
        from_field(_S, "dedup_window",
                   help="ids of each worker's last applied pushes remembered, so a replayed "
                        "push is answered, not applied again (0 = off)"),
        from_field(_S, "checkpoint_dir",
                   help="this shard's checkpoint directory: restored from at start, written to "
                        "periodically and on SIGTERM (empty = no checkpoints)"),
        from_field(_S, "checkpoint_every_updates",
                   help="write a checkpoint every N key updates (0 = not by count)"),
        from_field(_S, "checkpoint_every_s",
                   help="write a checkpoint every T seconds with updates (0 = not by time)"),
        from_field(_S, "checkpoint_keep", help="checkpoints kept, newest first"),
        from_field(_S, "checkpoint_durable",
                   help="a due checkpoint is on disk before its request's replies leave"),
        from_field(_S, "exit_when_done",
                   help="exit 0 once every rank of the world has registered and left (Jobs)"),
        from_field(_S, "curve_secret_key", metavar="FILE",
                   help="the shard's CURVE .key_secret file (bitps-keygen): encrypt the data plane "
                        "and let in only curve-allowed-keys (empty = plain ZeroMQ)"),
        from_field(_S, "curve_allowed_keys", metavar="DIR",
                   help="directory of the public keys (*.key) of the workers allowed on the data "
                        "plane"),
        from_field(_S, "tls_cert_file", metavar="FILE",
                   help="TLS certificate chain (PEM) of the gRPC port (empty = plaintext gRPC)"),
        from_field(_S, "tls_key_file", metavar="FILE", help="private key (PEM) of tls-cert-file"),
        from_field(_S, "tls_client_ca_file", metavar="FILE",
                   help="CA (PEM) that gRPC clients' certificates must be signed by (mutual TLS; "
                        "empty = no client certificate needed)"),
        option("log-level", default="INFO",
               help="log level of stderr (DEBUG, INFO, WARNING, ERROR)"),
    )


PROGRAM = program(builtin=True)
"""bitps-server's settings with bitps's own rules' flags (the configuration reference's)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of a whole ``bitps-server`` command line; a flag not given parses to its
    default. It reads no environment variable and no file (:func:`parse_config` does), so
    it parses a command line the same way wherever it runs."""
    return PROGRAM.parser()


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
                 ) -> tuple[ServerConfig, argparse.Namespace]:
    """The shard's configuration from ``argv`` (default ``sys.argv[1:]``), ``environ``
    (default ``os.environ``) and the ``--config`` file, and every resolved value by its flag's
    dest name (``args.log_level``, ``args.config``). A bad flag exits with status 2 (argparse);
    a bad variable, file or combination raises ``ValueError`` (``SettingError`` when a single
    value is unreadable)."""
    PROGRAM.load_plugins(argv, environ)  # first: the rules they register add flags
    r = program().parse(argv, environ)
    section = RULES.lookup(r["optimizer"]).config
    # every rule's section is read and checked; the running rule's is kept
    sections = {cls: cls(**r.kwargs(cls)) for cls in {s.owner for s in rule_settings()}}
    opt = OptimizerConfig(**r.kwargs(OptimizerConfig), schedule=LRSchedule(**r.kwargs(LRSchedule)),
                          rule_config=sections.get(section) if section is not None else None)
    return ServerConfig(**r.kwargs(ServerConfig), optimizer=opt), r.namespace()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_config(argv)
    except ValueError as err:
        print(f"bitps-server: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s shard %(process)d %(levelname)s %(message)s")
    try:
        shard = create_server(cfg)
    except KeyFileError as err:
        logging.critical("shard %d cannot start: %s", cfg.shard_id, err)
        return 2
    except (CheckpointError, OSError) as err:
        # a checkpoint that does not fit, a directory or port that cannot be used: say which
        logging.critical("shard %d cannot start: %s", cfg.shard_id, err)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Only set a flag here: stopping gRPC and joining threads inside a signal handler can
        # deadlock; serve() does the shutdown on the main thread.
        signal.signal(sig, lambda *_: shard.request_stop())
    # SIGHUP: read the allowed CURVE client keys again (serve() does it, on the main thread)
    signal.signal(signal.SIGHUP, lambda *_: shard.request_reload())
    # The mode too, so that a launcher that left it to the shard (environment, file) reports it.
    print(json.dumps({**shard.ready_event(), "mode": cfg.mode}), flush=True)
    logging.info("shard %d/%d serving %s (mode %s, optimizer %s)", cfg.shard_id, cfg.num_shards,
                 shard.ports, cfg.mode, cfg.optimizer.name)
    try:
        shard.serve()
    except ShardFailure as failure:
        logging.critical("shard %d exits: %s", cfg.shard_id, failure)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
