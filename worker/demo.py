"""Demo model and data for bitps: a tiny byte-level Qwen3-MoE trained on the stdlib's own source.

This is what the examples, integration tests and benchmarks train, so a run needs no download and
no data set: every rank builds identical weights from ``DemoConfig.seed`` and reads bytes of the
Python standard library installed next to it. Not for measuring model quality; the corpus depends
on the Python version, so compare ``Corpus.sha256`` before comparing losses across machines.

The one reader of the demo corpus: ``bitps-worker`` trains this model, the pipeline's ``deep``
model (``worker.pipeline.models``) and the benchmarks draw their bytes from :func:`load_corpus`
and :func:`batches`. A library module at the bottom of ``worker/`` (it imports no other part of
the worker), so every layer above may import it.

Example::

    cfg = DemoConfig()
    model = build_model(cfg)
    corpus = load_corpus(cfg.corpus_bytes)
    data = batches(corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                   rank=0, world_size=1, seed=cfg.seed)
    input_ids, labels = next(data)
    loss_fn(model, input_ids, labels).backward()
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["VOCAB_SIZE", "Corpus", "DemoConfig", "batches", "build_model", "load_corpus", "loss_fn"]

VOCAB_SIZE = 256
"""Bytes: the model's vocabulary."""
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"})


@dataclass(kw_only=True)
class DemoConfig:
    """Sizes of the demo model and of the data it is fed."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers; every one has a sparse MoE block."""
    num_experts: int = 4
    """Experts per MoE block."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k); at most ``num_experts``."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: int = 16
    """Width of one attention head; even, because rotary embeddings rotate pairs."""
    moe_intermediate_size: int = 128
    """Hidden width of each expert's feed-forward network."""
    seq_len: int = 128
    """Tokens (bytes) per training sequence; also the model's maximum position."""
    batch_size: int = 8
    """Sequences per batch on each worker."""
    corpus_bytes: int = 2_000_000
    """How many bytes of stdlib source make up the corpus."""
    seed: int = 0
    """Seeds the weights (same on every rank) and, with the rank, the batch sampler."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_experts", "experts_per_token", "num_heads",
                     "num_kv_heads", "head_dim", "moe_intermediate_size", "seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token must be <= num_experts={self.num_experts}, "
                             f"got {self.experts_per_token}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if self.corpus_bytes <= self.seq_len:
            raise ValueError(f"corpus_bytes must exceed seq_len={self.seq_len}, "
                             f"got {self.corpus_bytes}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def build_model(cfg: DemoConfig) -> torch.nn.Module:
    """Return a freshly initialised fp32 ``Qwen3MoeForCausalLM`` over bytes, in train mode.

    Identical on every rank for the same ``cfg.seed``. Embeddings are untied so each parameter
    appears once in ``model.parameters()``; the router's auxiliary loss is off, so the only loss
    is ``loss_fn``'s.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        # Unused (no dense layers), but must be set so the default 6144 is not recorded.
        intermediate_size=cfg.moe_intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
        output_router_logits=False,
    )
    # Seed immediately before construction: weight init is the only consumer of this RNG state.
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.config.use_cache = False
    model.train()
    return model


@dataclass(frozen=True, eq=False)
class Corpus:
    """Bytes to train on and where they came from."""

    data: np.ndarray
    """uint8 array, read-only because ``load_corpus`` shares it between callers."""
    sha256: str
    """Hex digest of ``data``; equal digests mean equal training data."""
    files: int
    """How many source files contributed bytes (the last one possibly truncated)."""
    source: str
    """Directory the files were read from."""


def _source_files(root: Path) -> list[Path]:
    """Return the ``.py`` files under ``root`` in sorted relative-path order, tests excluded."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and "test" not in d]
        found += [Path(dirpath, f).relative_to(root) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.as_posix())


@functools.lru_cache(maxsize=4)
def load_corpus(budget_bytes: int, *, root: str | None = None) -> Corpus:
    """Concatenate stdlib ``.py`` files (each followed by a newline) up to ``budget_bytes``.

    ``root`` defaults to the directory of the ``os`` module. The result is exactly
    ``budget_bytes`` long unless the sources are smaller, and is cached per process.
    """
    if not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    source = Path(root if root is not None else os.path.dirname(os.__file__))
    chunks, total, files = [], 0, 0
    for rel in _source_files(source):
        if total >= budget_bytes:
            break
        chunk = ((source / rel).read_bytes() + b"\n")[: budget_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        files += 1
    raw = b"".join(chunks)
    data = np.frombuffer(raw, dtype=np.uint8)  # read-only view of immutable bytes
    return Corpus(data=data, sha256=hashlib.sha256(raw).hexdigest(), files=files,
                  source=str(source))


def batches(corpus: Corpus, *, batch_size: int, seq_len: int, rank: int, world_size: int,
            seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(input_ids, labels)`` int64 tensors of shape ``[batch_size, seq_len]`` forever.

    Each row is a random window of ``seq_len + 1`` corpus bytes; ``labels`` is ``input_ids``
    shifted one byte on. Windows are sampled uniformly from the whole corpus with an RNG
    seeded by ``(seed, rank)``, so ranks draw different but identically distributed batches
    and a rerun repeats them. ``world_size`` only checks that ``rank`` is in range.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    n_starts = len(corpus.data) - seq_len
    if n_starts < 1:
        raise ValueError(f"corpus of {len(corpus.data)} bytes is too short for seq_len={seq_len}")
    return _windows(corpus.data, batch_size, seq_len, n_starts, np.random.default_rng([seed, rank]))


def _windows(data: np.ndarray, batch_size: int, seq_len: int, n_starts: int,
             rng: np.random.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, n_starts, size=batch_size)
        window = torch.from_numpy(data[starts[:, None] + offsets].astype(np.int64))
        yield window[:, :-1], window[:, 1:]


def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy; ``labels`` are already aligned with ``input_ids``.

    Labels are not passed to the model because Hugging Face models shift them again.
    """
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
