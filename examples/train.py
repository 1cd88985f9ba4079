"""Train your own model through bitps: a small MLP on synthetic data, one process per rank.

The shards hold the parameters and run the update rule (their ``--optimizer``); each worker
rank runs this script, a plain torch loop whose optimizer is ``bitps.Optimizer`` (its lr rides
with every push, so a torch ``lr_scheduler`` would drive it). Let bitps-launch start both
(shards first, then one copy of the script per rank):

    bitps-launch --shards 2 --workers 2 --script examples/train.py -- --steps 200

or start the shards yourself (README, "Run a cluster by hand") and the ranks with torchrun:

    BITPS_SERVERS=127.0.0.1:50051,127.0.0.1:50061 \
        torchrun --standalone --nproc-per-node 2 examples/train.py --steps 200

Rank and world size come from RANK and WORLD_SIZE (both launchers set them), the shards'
gRPC addresses from --servers or BITPS_SERVERS (``bitps.connect`` reads them). Every
--log-every steps a rank prints ``rank R step N loss X``; at the end ``rank R: first loss A,
last loss B, drop D%``. The exit status is 1 if the drop is below --expect-loss-drop.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import bitps

FEATURES, CLASSES = 16, 8


class MLP(nn.Module):
    """The user's model: nothing in it knows about bitps."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batches(rank: int, batch_size: int):
    """Endless (x, label) batches: Gaussian points labelled by the nearest of CLASSES fixed
    centres. The centres are the same on every rank; the points differ by rank."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234))
    points = torch.Generator().manual_seed(1000 + rank)
    while True:
        x = torch.randn(batch_size, FEATURES, generator=points)
        yield x, torch.cdist(x, centres).argmin(dim=1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", default=os.environ.get("BITPS_SERVERS"),
                   help="every shard's gRPC host:port, comma-separated, in shard-id order "
                        "(default: $BITPS_SERVERS)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--expect-loss-drop", type=float, default=0.0,
                   help="exit 1 unless the last loss is this fraction below the first (0 = off)")
    args = p.parse_args()
    if not args.servers:
        p.error("no shards: give --servers HOST:PORT,... or set BITPS_SERVERS")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main() -> int:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))

    # One seed on every rank: the copies start equal, so no rank has to pull them first.
    torch.manual_seed(0)
    model = MLP()
    loss_fn = nn.CrossEntropyLoss()

    # bitps: connect to the shards (RANK, WORLD_SIZE from the environment) and bind the
    # model's parameters to them; the optimizer's step is the shards'.
    optimizer = bitps.Optimizer(model, bitps.connect(servers=args.servers), lr=args.lr)

    losses = []
    try:
        data = batches(rank, args.batch_size)
        for step in range(args.steps):
            x, y = next(data)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()  # push the gradients, pull the shards' new parameters
            losses.append(loss.item())
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"rank {rank} step {step} loss {losses[-1]:.4f}", flush=True)
    finally:
        optimizer.close()  # leave the shards, so that no peer waits for this rank

    drop = 1 - losses[-1] / losses[0]
    print(f"rank {rank}: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}, "
          f"drop {drop:.1%}", flush=True)
    if drop < args.expect_loss_drop:
        print(f"rank {rank}: expected the loss to drop by >= {args.expect_loss_drop:.0%}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
