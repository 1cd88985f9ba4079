"""Staging: where a ``PSModel``'s gradients and parameters meet the client's arrays.

One :class:`Staging` per ``PSModel`` owns the host side of every parameter and the payload of
every push:

- **host buffers** (``host``): on CPU the flat parameter itself (pulls write the model in place,
  zero copies beyond the socket); on CUDA a pinned float32 copy, uploaded on the comm stream
  after each pull (:meth:`copy_in`, :meth:`copy_bucket_in`). ``outs`` are their per-key views,
  the arrays the client pulls into.
- **weight prediction** (:meth:`predict`, ``worker.training.prediction``): when the shards ask
  for it, ``host`` holds the exact copies the pulls write, and what the model computes with is
  predicted from them after each pull: into the parameters themselves (CPU) or a second pinned
  buffer that is uploaded instead (CUDA).
- **payloads** (:meth:`payload`, and :meth:`bucket_payload` on the communication thread): per
  key the gradient read in place (CPU), downloaded to pinned memory (CUDA), or compressed next
  to it with its device error feedback (``device_codec``: ``worker.training.codec_torch``, the
  same bytes as the host kernels), handed to the encoder as one
  :class:`~bitps.worker.training.payload.Payload`.
- **clipping under overlap** (``clip``, ``worker.training.clip``): each payload's clip factor
  and, with the step's last payload, the corrections of the earlier ones: the device residuals'
  here, the host ones' for the encoder to make once that payload is sent.

The device codec and ``clip`` are decided once the shards have answered the registration (they
depend on the shards' rule); until then they are off. A payload asks nothing of the encoder:
what it needs (which keys the device codec encodes, with which codec) is set beforehand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from bitps import native
from bitps.proto.codecs import Codec
from bitps.proto.keyplan import Key, KeyPlan
from bitps.worker.metrics import WorkerMetrics
from bitps.worker.training import codec_torch
from bitps.worker.training.clip import StepClip
from bitps.worker.training.payload import ClipCorrection, Payload, refused_nonfinite
from bitps.worker.training.prediction import WeightPrediction

__all__ = ["Staging"]


class Staging:
    """The host buffers, payloads and device error feedback of ``params`` (name, tensor) cut
    into ``plan``'s keys, pushed and pulled through ``client``."""

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]], plan: KeyPlan, *,
                 metrics: WorkerMetrics) -> None:
        self.params = params
        self.metrics = metrics
        self.cuda = any(p.is_cuda for _, p in params)
        self.index = {n: i for i, (n, _) in enumerate(params)}
        """Each parameter's position in ``params`` by name."""
        self.host = [self._host_buffer(p) for _, p in params]
        self.grad_host = [self._host_buffer(p) for _, p in params] if self.cuda else None
        self.stream = torch.cuda.Stream() if self.cuda else None
        """The comm stream (CUDA): downloads, device compression and uploads run on it."""
        self.plan_keys = list(plan.keys)
        self.outs = [self.slice(self.host, k) for k in plan.keys]
        """Each key's view of its host buffer, in ``plan.keys`` order."""
        self.out_of = {k.key: out for k, out in zip(plan.keys, self.outs)}
        """The same views by key id (a stage's partial plan has gaps in its ids)."""
        if self.cuda:
            for (_, p), host in zip(params, self.host):
                host[:] = p.detach().reshape(-1).cpu().numpy()
        self.uploaded = self.host
        """What :meth:`copy_in` uploads (CUDA): the host copies, or the predicted ones."""
        self.prediction: WeightPrediction | None = None
        """Set by :meth:`predict`; ``None``: the model computes with the pulled values."""
        self.device_codec: Codec | None = None
        """The codec keys of :attr:`device_keys` are encoded with where the gradients are, or
        ``None``: every key goes to the encoder as a host array (set after registration)."""
        self.device_keys: frozenset[int] = frozenset()
        """The keys the device codec encodes (the push codec compresses them)."""
        self.clip: StepClip | None = None
        """The step's clip factors, or ``None``: no clipping (set after registration)."""
        self.residuals: dict[int, torch.Tensor] = {}
        """Device error feedback per key (``device_codec``)."""
        self._staged: dict[int, torch.Tensor] = {}  # pinned host payloads per key (CUDA)
        self._clip_pending: list = []  # this step's clipped payloads, for their corrections
        self._prepared = 0  # this step's buckets prepared so far (communication thread)

    # -- buffers ------------------------------------------------------------------------------
    def slice(self, flats: Sequence, k: Key):
        """Key ``k``'s slice of its parameter's flat array (``flats`` by parameter: gradients,
        host buffers)."""
        return flats[self.index[k.name]][k.offset:k.offset + k.length]

    def _host_buffer(self, p: torch.Tensor) -> np.ndarray:
        if p.is_cuda:
            return torch.empty(p.numel(), dtype=torch.float32, pin_memory=True).numpy()
        # CPU: the flat parameter itself, so pulls land in the model with no extra copy.
        if not p.data.is_contiguous():
            raise ValueError("bitps needs contiguous parameters")
        return p.data.view(-1).numpy()

    def predict(self, keys: Sequence[Key], *, ahead: int, versions: Mapping[int, int]) -> None:
        """Compute with predicted parameters of ``keys`` from now on (``ahead`` = W - 1 other
        pushers; ``versions``: the client's; the other keys are shown as pulled). On CPU the
        exact copies move out of the parameters into arrays of their own (:attr:`outs` and
        :attr:`out_of` are updated in place, so their holders see the new arrays); on CUDA a
        second pinned buffer is what gets uploaded. Call before the first pull."""
        if self.cuda:
            self.uploaded = [self._host_buffer(p) for _, p in self.params]
            for shown, host in zip(self.uploaded, self.host):
                shown[:] = host
        else:
            self.uploaded = self.host  # the parameters: what the model computes with
            self.host = [a.copy() for a in self.host]
        for i, k in enumerate(self.plan_keys):
            self.outs[i] = self.out_of[k.key] = self.slice(self.host, k)
        wanted = {k.key for k in keys}
        self.prediction = WeightPrediction(
            dict(self.out_of), {k.key: self.slice(self.uploaded, k) for k in self.plan_keys},
            ahead={k.key: ahead if k.key in wanted else 0 for k in self.plan_keys},
            versions=versions)

    def show_exact(self) -> None:
        """Under prediction: make the parameters the exact copies (training is over)."""
        if self.prediction is None:
            return
        self.prediction.reset()
        self.prediction.update(self.prediction.exact)  # shown = exact
        if self.cuda:
            with torch.no_grad():
                for (_, p), shown in zip(self.params, self.uploaded):
                    p.data.view(-1).copy_(torch.from_numpy(shown))

    def copy_in(self) -> None:
        """Every pull is in: predict (:meth:`predict`), then upload on the comm stream, which
        the compute stream then waits for (CUDA; on CPU pulls wrote the parameters in place)."""
        if self.prediction is not None:
            self.prediction.update(self.prediction.exact)
        if not self.cuda:
            return
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for (_, p), host in zip(self.params, self.uploaded):
                p.data.view(-1).copy_(torch.from_numpy(host), non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)

    def copy_bucket_in(self, indices: Sequence[int], ready: torch.cuda.Event | None,
                       keys: Sequence[int] = ()) -> None:
        """A bucket's pull (of ``keys``, parameters at ``indices``) is in, on the comm thread:
        predict its keys (:meth:`predict`), then on CUDA upload its parameters on the comm
        stream and record ``ready`` after them."""
        if self.prediction is not None:
            self.prediction.update(keys)
        if not self.cuda:
            return
        with torch.no_grad(), torch.cuda.stream(self.stream):
            for i in indices:
                self.params[i][1].data.view(-1).copy_(torch.from_numpy(self.uploaded[i]),
                                                      non_blocking=True)
            ready.record()

    # -- payloads -----------------------------------------------------------------------------
    def bucket_payload(self, keys: Sequence[Key], grads: Mapping[int, torch.Tensor], clock: int,
                       produced: torch.cuda.Event | None, *, buckets: int) -> Payload:
        """One bucket's payload, on the communication thread (``Job.prepare``): ``grads`` by
        parameter index, ``clock`` the step, ``buckets`` how many buckets a step has (the
        thread prepares one step's buckets before the next step's, so the step's last is the
        ``buckets``-th). On CUDA the comm stream first waits for ``produced`` (recorded on the
        compute stream after backward made these gradients)."""
        self._prepared += 1
        last = self._prepared == buckets
        if last:
            self._prepared = 0
        whole = buckets == 1  # one bucket holds the step: its factor is exact
        flat: list[torch.Tensor | None] = [None] * len(self.params)
        for i, g in grads.items():
            flat[i] = g.reshape(-1)
        if not self.cuda:
            return self.payload(keys, flat, clock, last=last, whole=whole)
        self.stream.wait_event(produced)
        for g in grads.values():
            g.record_stream(self.stream)  # freed grads are not reused under our reads
        with torch.cuda.stream(self.stream):
            return self.payload(keys, flat, clock, last=last, whole=whole)

    def payload(self, keys: Sequence[Key], flat: Sequence[torch.Tensor], clock: int, *,
                last: bool = True, whole: bool = True) -> Payload:
        """The push of ``keys`` for ``clock`` from the flat gradients ``flat`` (by parameter).
        On CUDA it must run with the comm stream current, after that stream has waited for the
        gradients; compressed keys are encoded on it (device codec) and everything else is
        downloaded to pinned memory, then the stream is synchronized. On CPU gradients are
        read in place. With clipping the payload carries its clip factor
        (``worker.training.clip``), found from the gradients' sum of squares, which is also
        their NaN/Inf check: exact when the payload is ``whole`` (every gradient of the step),
        else predicted and corrected once the step's ``last`` payload is prepared."""
        codec = self.device_codec
        coded = {k.key for k in keys if k.key in self.device_keys}
        scale = None
        if self._clip_pending and self._clip_pending[0][0] != clock:
            # a refused step never pushed its last payload: forget its factors
            self._clip_pending.clear()
            self.clip.reset()
        if codec is not None and (coded or self.clip is not None):
            sum_squares = self._check_device(keys, coded, flat)
            if self.clip is not None:
                scale = self.clip.factor(sum_squares, whole=whole)
        encoded: dict[int, torch.Tensor] = {}
        grads: list[np.ndarray] = []
        for k in keys:
            g = self.slice(flat, k)
            if k.key in coded:
                encoded[k.key] = self._encode(k.key, g, codec, 1.0 if scale is None else scale)
                grads.append(self.slice(self.grad_host, k) if self.cuda else g.detach().numpy())
                continue
            if self.cuda:
                host = self.slice(self.grad_host, k)
                torch.from_numpy(host).copy_(g, non_blocking=True)
                grads.append(host)
            else:
                grads.append(g.detach().numpy())
        if self.cuda:
            self.stream.synchronize()
        if self.clip is not None and codec is None:
            scale = self.clip.factor(self._sum_squares(keys, grads), whole=whole)
        corrections, exact = (), 1.0
        if self.clip is not None:
            self._clip_pending.append((clock, keys, grads, flat, coded, scale))
            if last:
                corrections, exact = self._end_clipped_step()
        return Payload(keys=[k.key for k in keys], grads=grads,
                       outs=[self.out_of[k.key] for k in keys],
                       encoded={key: code.numpy() for key, code in encoded.items()} or None,
                       scale=scale, corrections=corrections, exact=exact)

    def _sum_squares(self, keys: Sequence[Key], grads: Sequence[np.ndarray]) -> float:
        """The host gradients' sum of squares (float64) in one read, which is also their
        NaN/Inf check (``NON_FINITE``, counted; nothing sent, no state touched)."""
        total = 0.0
        for k, grad in zip(keys, grads):
            part = native.sum_squares(grad)
            if not np.isfinite(part):
                raise refused_nonfinite(self.metrics, k.key)
            total += part
        return total

    def _check_device(self, keys: Sequence[Key], coded: set[int],
                      flat: Sequence[torch.Tensor]) -> float:
        """The device codec folds each gradient into a residual kept next to it: refuse NaN/Inf
        before encoding (``NON_FINITE``, counted; residuals unchanged), as the encoder does for
        host codecs: one fused max-|g| per coded key (``torch._foreach_norm``, as
        ``clip_grad_norm_`` uses; the max cannot overflow). With clipping, also every key's
        L2 norm; returns their sum of squares. One device-to-host sync for all of it."""
        checked = [self.slice(flat, k) for k in keys if k.key in coded]
        peaks = torch._foreach_norm(checked, float("inf")) if checked else []
        norms = (torch._foreach_norm([self.slice(flat, k) for k in keys], 2.0)
                 if self.clip is not None else [])
        values = torch.stack([*peaks, *norms]).double().cpu()
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            first = int(torch.nonzero(~finite)[0])
            bad = [k for k in keys if k.key in coded] + list(keys)
            raise refused_nonfinite(self.metrics, bad[first].key)
        return float(values[len(peaks):].square().sum())

    def _end_clipped_step(self) -> tuple[list[ClipCorrection], float]:
        """The step's last payload is made (its device error feedback encoded): the exact clip
        factor is known, and every payload of the step gets ``(exact - used) * g`` folded into
        its error feedback (``worker.training.clip``): device residuals here (on the comm
        stream); the host keys' corrections are returned, with the exact factor, for the
        encoder to make once the last payload is sent."""
        exact = self.clip.end()
        pending, self._clip_pending = self._clip_pending, []
        corrections = []
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for clock, keys, grads, flat, coded, used in pending:
                if used == exact:
                    continue
                alpha = float(np.float32(exact - used))
                for k in keys:
                    if k.key in coded:
                        self.residuals[k.key].add_(self.slice(flat, k) * alpha)
                host = [(k.key, g) for k, g in zip(keys, grads) if k.key not in coded]
                if host:
                    corrections.append(ClipCorrection(clock, [key for key, _ in host],
                                                      [g for _, g in host], used))
        return corrections, exact

    def _encode(self, key: int, g: torch.Tensor, codec, scale: float) -> torch.Tensor:
        """One key's compressed push of ``g * scale`` with its error feedback kept next to the
        gradient; on CUDA the packed bytes are copied to a pinned buffer (not yet
        synchronized)."""
        r = self.residuals.get(key)
        if r is None:
            r = self.residuals[key] = torch.zeros_like(g)
        code = codec_torch.encode(g, r, codec, scale)
        if not self.cuda:
            return code
        host = self._staged.get(key)
        if host is None:
            host = self._staged[key] = torch.empty(code.numel(), dtype=torch.uint8,
                                                   pin_memory=True)
        host.copy_(code, non_blocking=True)
        return host
