"""The end-to-end bench's models, all byte-level over the demo corpus (``worker.demo``).

``lm``: a 28.6 M-parameter GPT-2-style transformer LM (d 768, 4 layers, FFN 3072, 8 heads,
context 128, tied embeddings), batch 4 x 128 per worker: 114.6 MB of float32 gradients per step,
which is what makes a 1 Gbit/s link the bottleneck. ``moe``: a 13.5 M-parameter Qwen3-MoE
(hidden 256, 4 layers, 8 experts top-2, expert FFN 512, 8 heads of 32, 4 KV heads), batch
16 x 128. ``tiny``: the demo model (smoke tests).

Every model is built in float32 from a seed, identically on every rank; the loss is the mean
next-byte cross-entropy (``worker.demo.loss_fn``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "ModelSpec", "build"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    batch: int
    """Sequences per worker per step."""
    seq_len: int = 128
    description: str = ""


MODELS = {
    "lm": ModelSpec(name="lm", batch=4, description="28.6 M byte LM (GPT-2 style, d 768, "
                                                    "4 layers, FFN 3072, 8 heads)"),
    "moe": ModelSpec(name="moe", batch=16, description="13.5 M Qwen3-MoE (hidden 256, 4 "
                                                       "layers, 8 experts top-2)"),
    "tiny": ModelSpec(name="tiny", batch=8, description="the demo Qwen3-MoE (1 M)"),
}


def build(name: str, seed: int = 0):
    """A fresh float32 model in train mode; the same weights for the same ``seed``."""
    import torch

    from bitps.worker.demo import DemoConfig, build_model

    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of {sorted(MODELS)}")
    if name == "lm":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=128, n_embd=768, n_layer=4, n_head=8,
                            n_inner=3072, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0, use_cache=False)
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config).to(torch.float32)
        model.train()
        return model
    if name == "moe":
        return build_model(DemoConfig(hidden_size=256, num_layers=4, num_experts=8,
                                      experts_per_token=2, num_heads=8, num_kv_heads=4,
                                      head_dim=32, moe_intermediate_size=512, seed=seed))
    return build_model(DemoConfig(seed=seed))
