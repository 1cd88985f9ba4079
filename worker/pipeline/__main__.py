"""``python -m bitps.worker.pipeline``: one pipeline stage process.

Started by ``bitps-launch --dp D --pp P`` or by torchrun, it reads torchrun's environment:
``RANK``, ``WORLD_SIZE`` (= D x P), ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``. Rank ``r``
is stage ``r % P`` of replica ``r // P``. Every setting is a flag with an environment twin and
a key of the ``--config`` TOML file (``bitps.proto.settings``: flag > environment > file >
default); the parallel layout (``ParallelConfig``) may also come as the file's
``[parallel_config]`` table, spelled as the problem statement's dict::

    [parallel_config]
    data_parallel_size = 2
    pipeline_parallel_size = 4
    micro_batch_size = 8
    gradient_accumulation_steps = 4

The plan is checked (``ParallelConfig.check`` against the model's layer count, and the
schedule's deadlock guard) before ``torch.distributed`` is initialised: a refused one exits 2
with the error, having talked to nobody.

Then: build the whole model from the seed, partition its layers (profiled: global rank 0
measures and broadcasts; or uniform) into P parts, or 2P with ``zb-v`` (stage ``r`` keeps parts
``r`` and ``2P - 1 - r``), keep this stage's layers, register their keys with the
shards (a ``PSClient`` of world size D x P; replica 0 of each stage sends initial values),
run ``--steps`` steps of the schedule through ``StageRuntime``, and (dynamic micro-batching)
adopt a new micro-batch size between steps. With ``--json`` it prints one JSON object per line:
``start``, ``step`` (every ``--log-every`` steps), ``done`` (``final_loss`` = mean of the last
10 steps' losses, on the stage that computes the loss: ``computes_loss``, stage P - 1, or stage
0 with ``zb-v``), or ``error`` naming the error before exiting 1. SIGTERM
ends the run where it is: the stage leaves every shard (so the shards stop waiting for its
keys' pushes), prints ``terminated`` and exits 0; a second SIGTERM kills it.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys

from bitps.worker.config import RunConfig
from bitps.worker.pipeline.settings import check_plan, parse_config
from bitps.worker.pipeline.trainer import run_stage

__all__ = ["emit", "main"]


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler (a BaseException: no ``except
    Exception`` on the way swallows it)."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    raise _Terminated


def emit(run: RunConfig, **event) -> None:
    """One progress event: a JSON line on stdout with ``--json``, else a log line."""
    if run.json:
        print(json.dumps(event), flush=True)
    else:
        logging.info("%s", event)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        check_plan(cfg)
    except ValueError as err:  # SettingError and PlanError are ValueErrors
        print(f"bitps-pipeline: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s stage %(process)d %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run_stage(cfg, emit=functools.partial(emit, cfg.run))
    except _Terminated:  # the step loop has left the shards on its way out
        emit(cfg.run, event="terminated", rank=cfg.client.rank)
        return 0
    except Exception as err:
        logging.exception("rank %d (replica %d, stage %d) failed", cfg.client.rank,
                          cfg.replica, cfg.stage_index)
        emit(cfg.run, event="error", rank=cfg.client.rank, replica=cfg.replica,
             stage=cfg.stage_index, error=f"{type(err).__name__}: {err}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
