"""``PSModel``: train any ``torch.nn.Module`` through the shards by adding about five lines.

    client = PSClient(ClientConfig(servers=servers, rank=rank, world_size=world_size))
    ps_model = PSModel(model, client)          # plan, register, pull rank 0's initial values
    for x, y in data:
        loss_fn(model(x), y).backward()
        ps_model.step()                        # push grads, pull updated params, zero grads
    ps_model.close()

The optimizer runs on the shards (``bitps-server --optimizer ...``); the worker holds no optimizer
state. Each trainable parameter is flattened and cut into keys by ``proto.keyplan``; on CPU the
pushes read ``param.grad`` in place and pulls write ``param.data`` in place (zero copies beyond
the socket). On CUDA, gradients are staged through pinned host buffers on a separate stream and
parameters copied back after the pull. A parameter without a gradient in a step is pushed as
zeros, as DDP reduces unused parameters.
"""

from __future__ import annotations

import numpy as np
import torch

from proto.keyplan import KeyPlan, ParamSpec, make_plan
from worker.client import PSClient

__all__ = ["PSModel"]


class PSModel:
    """Binds ``model``'s trainable parameters to the shards behind ``client``."""

    def __init__(self, model: torch.nn.Module, client: PSClient) -> None:
        self.model = model
        self.client = client
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for name, p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {name!r} is {p.dtype}; bitps stores float32")
        self.plan: KeyPlan = make_plan(
            [ParamSpec(n, tuple(p.shape)) for n, p in self.params],
            num_shards=client.num_shards, partition_bytes=client.cfg.partition_bytes)
        self.cuda = any(p.is_cuda for _, p in self.params)
        self._index = {n: i for i, (n, _) in enumerate(self.params)}
        self._host = [self._host_buffer(p) for _, p in self.params]
        self._grad_host = [self._host_buffer(p) for _, p in self.params] if self.cuda else None
        self._stream = torch.cuda.Stream() if self.cuda else None
        # Host buffers are written by the next pull only after the last upload has finished.
        self._uploaded = torch.cuda.Event() if self.cuda else None
        self.keys = [k.key for k in self.plan.keys]
        self._outs = self._key_views(self._host)
        values = None
        if client.cfg.rank == 0:
            values = {k.key: v for k, v in zip(self.plan.keys, self._key_views(
                [p.detach().reshape(-1).cpu().numpy() for _, p in self.params]))}
        client.register(self.plan, values)
        self.clock = client.start_clock
        client.pull(self.keys, self._outs, clock=self.clock).wait()
        self._copy_in()

    def _host_buffer(self, p: torch.Tensor) -> np.ndarray:
        if p.is_cuda:
            return torch.empty(p.numel(), dtype=torch.float32, pin_memory=True).numpy()
        # CPU: the flat parameter itself, so pulls land in the model with no extra copy.
        if not p.data.is_contiguous():
            raise ValueError("bitps needs contiguous parameters")
        return p.data.view(-1).numpy()

    def _key_views(self, flats: list[np.ndarray]) -> list[np.ndarray]:
        return [flats[self._index[k.name]][k.offset:k.offset + k.length] for k in self.plan.keys]

    def _grads(self) -> list[np.ndarray]:
        """Flat float32 views of every gradient (zeros where a parameter got none)."""
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not self.cuda:
            return self._key_views([p.grad.detach().reshape(-1).numpy() for _, p in self.params])
        # Download on the side stream once backward's kernels are done, into pinned memory.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for (_, p), host in zip(self.params, self._grad_host):
                torch.from_numpy(host).copy_(p.grad.reshape(-1), non_blocking=True)
        self._stream.synchronize()
        return self._key_views(self._grad_host)

    def _copy_in(self) -> None:
        if not self.cuda:
            return  # pulls wrote the parameters in place
        with torch.no_grad(), torch.cuda.stream(self._stream):
            for (_, p), host in zip(self.params, self._host):
                p.data.view(-1).copy_(torch.from_numpy(host), non_blocking=True)
            self._uploaded.record()
        torch.cuda.current_stream().wait_stream(self._stream)

    def step(self) -> None:
        """Push this step's gradients, pull the parameters the shards computed, zero the grads."""
        cfg = self.client.cfg
        if cfg.push_codec.name != "raw" and cfg.clip_norm > 0:
            # Clip the raw local gradient before error feedback adds the residual (DGC's local
            # clipping): clipping the compensated vector would eat the mass EF is carrying.
            torch.nn.utils.clip_grad_norm_([p for _, p in self.params if p.grad is not None],
                                           cfg.clip_norm)
        grads = self._grads()
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self.client.push_pull(self.keys, grads, self._outs, clock=self.clock).wait()
        self._copy_in()
        self.clock += 1
        self.client.clock = self.clock
        with self.client.metrics.lock:
            self.client.metrics.clock.set(self.clock)
        for _, p in self.params:
            p.grad = None

    def close(self) -> None:
        """Leave the shards and stop the client."""
        self.client.close()
