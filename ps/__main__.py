"""``bitps-server``: run one PS shard. The one place that reads shard flags and environment.

Every flag has an environment twin (``--grpc-port`` <- ``BITPS_GRPC_PORT``); flags win.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from bitps.proto.schedule import LRSchedule
from bitps.ps.config import MODES, ONEBIT_MOMENTS, OPTIMIZERS, OptimizerConfig, ServerConfig
from bitps.ps.server import create_server

__all__ = ["main", "parse_config"]


def _env(name: str, default):
    value = os.environ.get("BITPS_" + name.upper().replace("-", "_"))
    if value is None:
        return default
    return type(default)(value) if not isinstance(default, bool) else value.lower() in (
        "1", "true", "yes")


def build_parser() -> argparse.ArgumentParser:
    d, o = ServerConfig(), OptimizerConfig()
    p = argparse.ArgumentParser(prog="bitps-server", description="Run one bitps PS shard.")
    add = p.add_argument
    add("--shard-id", type=int, default=_env("shard-id", d.shard_id), help="this shard's index")
    add("--num-shards", type=int, default=_env("num-shards", d.num_shards), help="shards in all")
    add("--host", default=_env("host", d.host), help="bind address (default 127.0.0.1)")
    add("--grpc-port", type=int, default=_env("grpc-port", d.grpc_port), help="0 = any free port")
    add("--data-port", type=int, default=_env("data-port", d.data_port), help="0 = any free port")
    add("--metrics-port", type=int, default=_env("metrics-port", d.metrics_port),
        help="Prometheus port; 0 = any free port, -1 = off")
    add("--mode", choices=MODES, default=_env("mode", d.mode), help="consistency model")
    add("--staleness", type=int, default=_env("staleness", d.staleness), help="SSP bound S")
    add("--optimizer", choices=OPTIMIZERS, default=_env("optimizer", o.name))
    add("--lr", type=float, default=_env("lr", o.lr), help="learning rate (the peak)")
    s = o.schedule
    add("--lr-warmup", type=int, default=_env("lr-warmup", s.warmup_steps),
        help="clocks of linear learning-rate warm-up")
    add("--lr-decay", type=int, default=_env("lr-decay", s.decay_steps),
        help="clock at which the cosine decay ends (0 = constant after the warm-up)")
    add("--lr-min-ratio", type=float, default=_env("lr-min-ratio", s.min_ratio),
        help="learning-rate factor the cosine ends at")
    add("--momentum", type=float, default=_env("momentum", o.momentum))
    add("--dampening", type=float, default=_env("dampening", o.dampening))
    add("--nesterov", action=argparse.BooleanOptionalAction, default=_env("nesterov", o.nesterov))
    add("--beta1", type=float, default=_env("beta1", o.beta1))
    add("--beta2", type=float, default=_env("beta2", o.beta2))
    add("--eps", type=float, default=_env("eps", o.eps))
    add("--weight-decay", type=float, default=_env("weight-decay", o.weight_decay))
    add("--freeze-step", type=int, default=_env("freeze-step", o.freeze_step),
        help="onebit_adam: warmup clocks of full Adam on bf16 pushes before traffic goes 1-bit")
    add("--onebit-chunk", type=int, default=_env("onebit-chunk", o.onebit_chunk),
        help="onebit_adam: elements per scale of the published updates")
    add("--onebit-scale", choices=("auto", "mean_abs", "rms"),
        default=_env("onebit-scale", o.onebit_scale),
        help="onebit_adam: scale rule of the published sign1 codes")
    add("--onebit-moments", choices=ONEBIT_MOMENTS,
        default=_env("onebit-moments", o.onebit_moments),
        help="onebit_adam, async/ssp: Adam's moments on each worker (auto) or on the shard")
    add("--onebit-warmup-codes", action=argparse.BooleanOptionalAction,
        default=_env("onebit-warmup-codes", o.onebit_warmup_codes),
        help="onebit_adam: sign1 codes of the warmup updates in pull replies, not float32")
    add("--delta-history", type=int, default=_env("delta-history", o.delta_history),
        help="onebit_adam: compressed updates kept per key")
    add("--heartbeat-timeout", type=float, default=_env("heartbeat-timeout",
                                                         d.heartbeat_timeout_s))
    add("--pull-deadline", type=float, default=_env("pull-deadline", d.pull_deadline_s))
    add("--token", default=_env("token", d.token), help="shared secret (empty = none)")
    add("--max-frame-bytes", type=int, default=_env("max-frame-bytes", d.max_frame_bytes))
    add("--reject-nonfinite", action=argparse.BooleanOptionalAction,
        default=_env("reject-nonfinite", d.reject_nonfinite))
    add("--split-lr", action=argparse.BooleanOptionalAction,
        default=_env("split-lr", d.split_lr),
        help="async/ssp: apply each push with lr / live workers")
    add("--lookahead", action=argparse.BooleanOptionalAction,
        default=_env("lookahead", d.lookahead),
        help="async/ssp: answer float32 pulls with the parameters one update ahead per "
             "other live worker")
    add("--staleness-damping", action=argparse.BooleanOptionalAction,
        default=_env("staleness-damping", d.staleness_damping),
        help="async/ssp: also scale the learning rate by 1 / (1 + version gap)")
    add("--log-level", default=_env("log-level", "INFO"))
    return p


def parse_config(argv: list[str] | None = None) -> tuple[ServerConfig, argparse.Namespace]:
    a = build_parser().parse_args(argv)
    schedule = LRSchedule(warmup_steps=a.lr_warmup, decay_steps=a.lr_decay,
                          min_ratio=a.lr_min_ratio)
    opt = OptimizerConfig(name=a.optimizer, lr=a.lr, schedule=schedule, momentum=a.momentum,
                          dampening=a.dampening,
                          nesterov=a.nesterov, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                          weight_decay=a.weight_decay, freeze_step=a.freeze_step,
                          onebit_chunk=a.onebit_chunk, onebit_scale=a.onebit_scale,
                          onebit_moments=a.onebit_moments, delta_history=a.delta_history,
                          onebit_warmup_codes=a.onebit_warmup_codes)
    cfg = ServerConfig(shard_id=a.shard_id, num_shards=a.num_shards, host=a.host,
                       grpc_port=a.grpc_port, data_port=a.data_port, metrics_port=a.metrics_port,
                       mode=a.mode, staleness=a.staleness, optimizer=opt,
                       heartbeat_timeout_s=a.heartbeat_timeout, pull_deadline_s=a.pull_deadline,
                       token=a.token, max_frame_bytes=a.max_frame_bytes,
                       reject_nonfinite=a.reject_nonfinite, split_lr=a.split_lr,
                       lookahead=a.lookahead, staleness_damping=a.staleness_damping)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_config(argv)
    except ValueError as err:
        print(f"bitps-server: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s shard %(process)d %(levelname)s %(message)s")
    shard = create_server(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Only set a flag here: stopping gRPC and joining threads inside a signal handler can
        # deadlock; serve() does the shutdown on the main thread.
        signal.signal(sig, lambda *_: shard.request_stop())
    print(json.dumps(shard.ready_event()), flush=True)
    logging.info("shard %d/%d serving %s (mode %s, optimizer %s)", cfg.shard_id, cfg.num_shards,
                 shard.ports, cfg.mode, cfg.optimizer.name)
    shard.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
