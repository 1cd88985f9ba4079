"""Tests for worker.demo: deterministic model, corpus and batches; config validation."""

from __future__ import annotations

import hashlib
import math

import pytest

pytest.importorskip("transformers")

import numpy as np
import torch

from bitps.worker.demo import Corpus, DemoConfig, batches, build_model, load_corpus, loss_fn

SMALL = dict(hidden_size=32, num_layers=1, num_experts=2, experts_per_token=1, num_heads=2,
             num_kv_heads=1, head_dim=16, moe_intermediate_size=32, seq_len=16)


def _corpus(data: bytes) -> Corpus:
    return Corpus(data=np.frombuffer(data, dtype=np.uint8), sha256="", files=1, source="")


def test_build_model_is_deterministic_per_seed():
    cfg = DemoConfig(**SMALL, seed=3)
    a, b = build_model(cfg).state_dict(), build_model(cfg).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    other = build_model(DemoConfig(**SMALL, seed=4)).state_dict()
    assert not torch.equal(a["lm_head.weight"], other["lm_head.weight"])


def test_build_model_is_fp32_untied_and_training():
    model = build_model(DemoConfig(**SMALL))
    assert model.training
    assert model.config.vocab_size == 256
    assert model.config.use_cache is False
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def test_loss_starts_near_uniform_and_backpropagates():
    cfg = DemoConfig(**SMALL)
    model = build_model(cfg)
    input_ids = torch.randint(0, 256, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(model, input_ids, input_ids.roll(-1, dims=1))
    assert loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.2
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_corpus_is_exact_length_and_stable():
    first = load_corpus(50_000)
    load_corpus.cache_clear()
    second = load_corpus(50_000)
    assert first is not second
    assert first.data.dtype == np.uint8 and len(first.data) == 50_000
    assert np.array_equal(first.data, second.data)
    assert first.sha256 == second.sha256 == hashlib.sha256(first.data.tobytes()).hexdigest()
    assert first.files >= 1
    assert not first.data.flags.writeable


def test_corpus_order_truncation_and_skipped_dirs(tmp_path):
    (tmp_path / "b.py").write_bytes(b"bbb")
    (tmp_path / "a.py").write_bytes(b"aa")
    (tmp_path / "notes.txt").write_bytes(b"xx")
    for skipped in ("test", "unittest", "site-packages", "__pycache__", "idlelib"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "a.py").write_bytes(b"skip")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_bytes(b"cc")

    full = load_corpus(1_000, root=str(tmp_path))
    assert full.data.tobytes() == b"aa\nbbb\ncc\n"
    assert full.files == 3 and full.source == str(tmp_path)
    cut = load_corpus(5, root=str(tmp_path))
    assert cut.data.tobytes() == b"aa\nbb" and cut.files == 2


def test_batches_shapes_and_shift():
    corpus = load_corpus(50_000)
    data = batches(corpus, batch_size=4, seq_len=32, rank=0, world_size=2, seed=0)
    for _ in range(3):
        input_ids, labels = next(data)
        assert input_ids.shape == labels.shape == (4, 32)
        assert input_ids.dtype == labels.dtype == torch.int64
        assert torch.equal(input_ids[:, 1:], labels[:, :-1])
        assert int(input_ids.min()) >= 0 and int(input_ids.max()) < 256


def test_labels_follow_inputs_in_the_corpus():
    corpus = _corpus(bytes(range(200)))
    input_ids, labels = next(batches(corpus, batch_size=8, seq_len=10, rank=0, world_size=1,
                                     seed=0))
    assert torch.equal(labels, input_ids + 1)
    assert torch.equal(input_ids[:, 1:] - input_ids[:, :-1], torch.ones(8, 9, dtype=torch.int64))


def test_batches_are_reproducible_and_differ_by_rank():
    corpus = load_corpus(50_000)
    kw = dict(batch_size=4, seq_len=32, world_size=2, seed=7)
    rank0 = [next(batches(corpus, rank=0, **kw))[0] for _ in range(2)]
    rank1 = next(batches(corpus, rank=1, **kw))[0]
    assert torch.equal(rank0[0], rank0[1])
    assert not torch.equal(rank0[0], rank1)


@pytest.mark.parametrize("kwargs", [
    dict(experts_per_token=5, num_experts=4),
    dict(num_heads=4, num_kv_heads=3),
    dict(hidden_size=0),
    dict(head_dim=15),
    dict(seed=-1),
    dict(seq_len=128, corpus_bytes=100),
])
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        DemoConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(rank=2, world_size=2),
    dict(rank=0, world_size=1, seq_len=300),
    dict(rank=0, world_size=1, seed=-1),
])
def test_bad_batches_arguments_raise(kwargs):
    args = dict(batch_size=2, seq_len=8, seed=0) | kwargs
    with pytest.raises(ValueError):
        batches(_corpus(bytes(256)), **args)
