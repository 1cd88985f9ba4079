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
parameters copied back after the pull; with a sign1 or bf16 push codec they are compressed on the
GPU first (``worker.codec_torch``, the same bytes as the CPU kernels) and only the packed bytes
cross to the host. A parameter without a gradient in a step is pushed as zeros, as DDP reduces
unused parameters.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from proto import bitps_pb2 as pb
from proto.codecs import MEAN_ABS
from proto.keyplan import KeyPlan, ParamSpec, make_plan
from worker import codec_torch
from worker.client import PSClient

__all__ = ["PSModel"]


class PSModel:
    """Binds ``model``'s trainable parameters to the shards behind ``client``."""

    def __init__(self, model: torch.nn.Module, client: PSClient, *,
                 device_codec: bool | None = None) -> None:
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
        self.device_codec = self._wants_device_codec(device_codec)
        self._residuals: dict[int, torch.Tensor] = {}  # device EF per key (device_codec)
        self._staged: dict[int, torch.Tensor] = {}  # pinned host payloads per key (CUDA)
        client.pull(self.keys, self._outs, clock=self.clock).wait()
        self._copy_in()

    def _wants_device_codec(self, asked: bool | None) -> bool:
        """Compress where the gradients are (CUDA) with ``worker.codec_torch``: sign1 and bf16
        pushes, outside 1-bit Adam (whose sync mode pushes momenta). ``True`` on CPU runs the
        same torch path on CPU tensors (it produces the bytes of the numba kernels)."""
        name = self.client.cfg.push_codec.name
        possible = name in ("sign1", "bf16") and not self.client.freeze_step
        if asked and not possible:
            raise ValueError(f"device_codec needs a sign1 or bf16 push codec and a shard "
                             f"without onebit_adam; push codec is {name!r}")
        return possible and (self.cuda if asked is None else asked)

    def _encode_on_device(self) -> dict[int, np.ndarray] | None:
        """This step's payloads for the keys the push codec compresses, encoded next to the
        gradients (on CUDA: on the side stream, then only packed bytes go to pinned memory)."""
        keys = [k for k in self.plan.keys if self.client.compresses(k.key, self.clock)]
        if not keys:
            return None
        codec = self.client.push_codec_at(self.clock)
        flat = {name: p.grad.reshape(-1) for name, p in self.params}
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
        out = {}
        with torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext():
            for k in keys:
                g = flat[k.name][k.offset:k.offset + k.length]
                r = self._residuals.get(k.key)
                if r is None:
                    r = self._residuals[k.key] = torch.zeros_like(g)
                if codec.id == pb.CODEC_SIGN1:
                    code = codec_torch.sign1_encode(g, r, chunk=codec.chunk,
                                                    mean_abs=bool(codec.flags & MEAN_ABS))
                else:
                    code = codec_torch.bf16_encode(g, r)
                if self.cuda:
                    host = self._staged.get(k.key)
                    if host is None:
                        host = self._staged[k.key] = torch.empty(
                            code.numel(), dtype=torch.uint8, pin_memory=True)
                    host.copy_(code, non_blocking=True)
                    code = host
                out[k.key] = code
        if self.cuda:
            self._stream.synchronize()
        return {key: code.numpy() for key, code in out.items()}

    def _host_buffer(self, p: torch.Tensor) -> np.ndarray:
        if p.is_cuda:
            return torch.empty(p.numel(), dtype=torch.float32, pin_memory=True).numpy()
        # CPU: the flat parameter itself, so pulls land in the model with no extra copy.
        if not p.data.is_contiguous():
            raise ValueError("bitps needs contiguous parameters")
        return p.data.view(-1).numpy()

    def _key_views(self, flats: list[np.ndarray]) -> list[np.ndarray]:
        return [flats[self._index[k.name]][k.offset:k.offset + k.length] for k in self.plan.keys]

    def _fill_missing_grads(self) -> None:
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _grads(self, skip=frozenset()) -> list[np.ndarray]:
        """Flat float32 views of every gradient (zeros where a parameter got none); on CUDA
        the keys in ``skip`` (sent encoded) are not downloaded."""
        if not self.cuda:
            return self._key_views([p.grad.detach().reshape(-1).numpy() for _, p in self.params])
        # Download on the side stream once backward's kernels are done, into pinned memory.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            if not skip:
                for (_, p), host in zip(self.params, self._grad_host):
                    torch.from_numpy(host).copy_(p.grad.reshape(-1), non_blocking=True)
            else:
                flat = {name: p.grad.reshape(-1) for name, p in self.params}
                for k in self.plan.keys:
                    if k.key not in skip:
                        host = self._grad_host[self._index[k.name]]
                        torch.from_numpy(host[k.offset:k.offset + k.length]).copy_(
                            flat[k.name][k.offset:k.offset + k.length], non_blocking=True)
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
        self._fill_missing_grads()
        if cfg.clip_norm > 0 and not self.client.push_codec_at(self.clock).is_raw:
            # Clip the raw local gradient before error feedback adds the residual (DGC's local
            # clipping): clipping the compensated vector would eat the mass EF is carrying.
            torch.nn.utils.clip_grad_norm_([p for _, p in self.params], cfg.clip_norm)
        encoded = self._encode_on_device() if self.device_codec else None
        grads = self._grads(skip=frozenset(encoded or ()))
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self.client.push_pull(self.keys, grads, self._outs, clock=self.clock,
                              encoded=encoded).wait()
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
