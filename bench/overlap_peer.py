"""The second worker of ``bitps-bench overlap``'s two-worker case, run inside the link's network
namespace: ``python -m bitps.bench.overlap_peer '<json settings>'`` trains the bench's model as one
rank against the given shards and prints its measurements as one JSON line on stdout."""

from __future__ import annotations

import json
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    import torch

    from bitps.bench.overlap import client_config, make_model, overlap_config, train_steps
    from bitps.worker.training.model import PSModel
    from bitps.worker.transport.client import PSClient

    s = json.loads((argv or sys.argv[1:])[0])
    torch.set_num_threads(1)
    device = torch.device(s["device"])
    model = make_model(s["width"], s["depth"], device)
    client = PSClient(client_config(tuple(s["servers"]), s["cfg"], rank=s["rank"],
                                     world_size=s["world_size"]))
    ps_model = PSModel(model, client, overlap=overlap_config(s["mode"], s["cfg"]))
    try:
        result = train_steps(model, s["batch"], s["steps"], s["warmup"], device, ps_model,
                             seed=1 + s["rank"])
    finally:
        ps_model.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
