"""Models a pipeline can train: each an ``nn.Sequential`` whose children are the layers the
partitioner assigns to stages, a loss, and a data source; and the stage slice of one.

Every stage process builds the *whole* model from the same seed (identical weights), then keeps
its layers with :func:`stage_module`, which keeps the whole model's parameter names
(``"3.attn.qkv.weight"`` stays that on every stage), so every stage and replica agrees on one key
plan (:func:`whole_plan`) and a stage's keys are that plan's subset by name.

    spec = MODELS["deep"]
    model = spec.build(seed=0)
    part = stage_module(model, range(0, 4))           # layers 0..3, names kept
    plan = whole_plan(model, num_shards=2)
    data = spec.batches(32, replica=0, replicas=2, seed=0)
    inputs, targets = next(data)                      # one step's replica batch
    loss = spec.loss(model(inputs), targets)

Entries:

- ``"mlp"``: six small dense layers on a fixed random regression teacher; for tests (a step
  takes milliseconds, the loss falls within tens of steps).
- ``"deep"``: a byte-level causal transformer on the demo corpus (``worker.demo``'s
  ``load_corpus`` and ``batches``: the standard library's source): an embedding, ten
  pre-norm attention + MLP blocks and a wide output head, 12 layers. The costs are uneven on
  purpose: the embedding is a lookup (almost free), the head (a 7x-wide MLP and the 256-way
  projection, with the loss) costs about two blocks, so a
  split by layer count leaves the last stage the slowest, and a split by measured time
  (``partition.balance`` over :func:`bitps.worker.pipeline.profile.profile_layers`) evens it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bitps.proto.keyplan import DEFAULT_PARTITION_BYTES, KeyPlan, ParamSpec, make_plan
from bitps.worker.demo import VOCAB_SIZE, batches, load_corpus

__all__ = ["MODELS", "PipelineModel", "chunk_holder", "stage_module", "whole_plan"]

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class PipelineModel:
    """One registry entry: how to build the model, score it and feed it."""

    name: str
    num_layers: int
    """Children of the ``nn.Sequential`` :attr:`build` returns: the most stages it can fill."""
    build: Callable[..., nn.Sequential]
    """``build(seed=0)``: the whole model, fp32, train mode, identical for the same seed."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss(output_of_last_layer, targets)``: the mean loss of a micro-batch."""
    batches: Callable[..., Batches]
    """``batches(batch_size, *, replica, replicas, seed)``: ``(inputs, targets)`` of
    ``batch_size`` samples forever; replicas draw different streams, a rerun the same. A step
    draws its replica batch and cuts it into micro-batches, so the samples a step trains on do
    not depend on the micro-batch size."""


def stage_module(model: nn.Sequential, layers: range) -> nn.Sequential:
    """The layers ``layers`` of ``model`` (the same module objects, not copies) as a
    ``nn.Sequential`` whose children keep their names in ``model``, so parameter names are the
    whole model's. ``layers`` must be a non-empty contiguous range within the model."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"a pipelined model is an nn.Sequential, got {type(model).__name__}")
    n = len(model)
    if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > n:
        raise ValueError(f"layers must be a non-empty contiguous range within 0..{n - 1}, "
                         f"got {layers}")
    names = list(model._modules)  # the children's names, in order
    return nn.Sequential(OrderedDict((names[i], model[i]) for i in layers))


def chunk_holder(chunks: list[nn.Sequential]) -> nn.Sequential:
    """One module holding every child of ``chunks`` (the :func:`stage_module` parts of one
    rank, e.g. the two chunks of a ``zb-v`` rank), the same objects under the same names, so a
    ``PSModel`` over it registers the whole model's names for both chunks at once. It is never
    called (its children are not in model order); raises ``ValueError`` if two chunks share a
    layer name."""
    children = [kv for c in chunks for kv in c.named_children()]
    holder = nn.Sequential(OrderedDict(children))
    if len(holder) != len(children):
        names = [n for n, _ in children]
        raise ValueError(f"chunks must hold disjoint layers, got layer names {names}")
    return holder


def whole_plan(model: nn.Module, num_shards: int,
               partition_bytes: int = DEFAULT_PARTITION_BYTES) -> KeyPlan:
    """The key plan of the whole model's trainable parameters in ``named_parameters`` order:
    the plan every stage of every replica computes alike (names and shapes only), and whose
    subset by name each stage registers."""
    return make_plan([ParamSpec(n, tuple(p.shape)) for n, p in model.named_parameters()
                      if p.requires_grad], num_shards=num_shards, partition_bytes=partition_bytes)


# -- "mlp": a small regression model -------------------------------------------------------------

_MLP_IN, _MLP_WIDTH = 8, 32
_TEACHER_SEED = 12345


class _Dense(nn.Module):
    def __init__(self, n_in: int, n_out: int, act: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.tanh(y) if self.act else y


def _build_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    widths = [_MLP_IN] + [_MLP_WIDTH] * 5
    layers = [_Dense(a, b) for a, b in zip(widths, widths[1:])] + [_Dense(_MLP_WIDTH, 1, False)]
    return nn.Sequential(*layers).to(torch.float32).train()


def _mlp_batches(batch_size: int, *, replica: int, replicas: int, seed: int) -> Batches:
    _check_stream(batch_size, replica, replicas, seed)
    return _mlp_stream(batch_size, torch.Generator().manual_seed(seed * 1_000_003 + replica))


def _mlp_stream(batch_size: int, g: torch.Generator) -> Batches:
    # The teacher is fixed (not seeded by `seed`): every run learns the same function.
    t = torch.Generator().manual_seed(_TEACHER_SEED)
    w1, w2 = torch.randn(_MLP_IN, 16, generator=t), torch.randn(16, 1, generator=t) / 4
    while True:
        x = torch.randn(batch_size, _MLP_IN, generator=g)
        yield x, torch.tanh(x @ w1) @ w2


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


# -- "deep": a byte-level causal transformer on the demo corpus ----------------------------------

_DEEP_WIDTH, _DEEP_HEADS, _DEEP_BLOCKS, _DEEP_SEQ = 64, 4, 10, 64
_DEEP_CORPUS_BYTES = 2_000_000


class _Embed(nn.Module):
    def __init__(self, d: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, d)
        self.positions = nn.Embedding(seq_len, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(pos)


class _Block(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP, each residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Head(nn.Module):
    """Norm, a wide MLP and the byte projection: about two blocks' worth of compute."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.out = nn.Linear(d, 7 * d), nn.Linear(7 * d, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.up(self.norm(x))))


def _build_deep(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [_Embed(_DEEP_WIDTH, _DEEP_SEQ),
              *(_Block(_DEEP_WIDTH, _DEEP_HEADS) for _ in range(_DEEP_BLOCKS)),
              _Head(_DEEP_WIDTH)]
    return nn.Sequential(*layers).to(torch.float32).train()


def _deep_batches(batch_size: int, *, replica: int, replicas: int, seed: int) -> Batches:
    _check_stream(batch_size, replica, replicas, seed)
    return batches(load_corpus(_DEEP_CORPUS_BYTES), batch_size=batch_size, seq_len=_DEEP_SEQ,
                   rank=replica, world_size=replicas, seed=seed)


def _next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _check_stream(batch_size: int, replica: int, replicas: int, seed: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= replica < replicas:
        raise ValueError(f"replica must be in [0, {replicas}), got {replica}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


MODELS: dict[str, PipelineModel] = {
    "mlp": PipelineModel(name="mlp", num_layers=6, build=_build_mlp, loss=_mse,
                         batches=_mlp_batches),
    "deep": PipelineModel(name="deep", num_layers=_DEEP_BLOCKS + 2, build=_build_deep,
                          loss=_next_byte_loss, batches=_deep_batches),
}
"""The models ``python -m bitps.worker.pipeline --model NAME`` trains, by name."""
