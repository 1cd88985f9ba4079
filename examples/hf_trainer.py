"""A stock Hugging Face ``Trainer`` script, trained through bitps by the lines marked ``# bitps``
(docs/integrations.md shows them); ``--plain`` runs the same script without them.

    bitps-launch --shards 2 --workers 2 --optimizer adamw --script examples/hf_trainer.py \
        -- --steps 60

or, with shards started by hand, ``BITPS_SERVERS=... torchrun --standalone --nproc-per-node 2
examples/hf_trainer.py``. The model is bitps's demo (a tiny byte-level Qwen3-MoE) and the data
windows of the Python standard library's source; each rank trains on its own windows. The shards
run the update rule (``--optimizer adamw``: the Trainer's default, with its betas and eps); the
Trainer's schedule sets the learning rate each push carries. A rank's last lines say whether
torch.distributed was started and what wraps the model, then ``rank R losses [...]`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import bitps
import bitps.worker.integrations.huggingface as bitps_hf
from bitps.worker.demo import DemoConfig, build_model, load_corpus


class Windows(torch.utils.data.Dataset):
    """``size`` windows of the corpus, drawn by ``seed``: causal-LM examples (the model shifts
    the labels itself)."""

    def __init__(self, corpus: np.ndarray, seq_len: int, size: int, seed: int) -> None:
        starts = np.random.default_rng(seed).integers(0, len(corpus) - seq_len, size)
        self.rows = torch.from_numpy(corpus[starts[:, None] + np.arange(seq_len)].astype(np.int64))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Losses(TrainerCallback):
    """Keeps every logged training loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--plain", action="store_true", help="the same script without bitps")
    p.add_argument("--out", default=os.environ.get("TMPDIR", "/tmp") + "/hf_trainer_out")
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))

    client = None if a.plain else bitps_hf.connect()  # bitps: before TrainingArguments
    demo = DemoConfig(seq_len=64)
    model = build_model(demo)
    corpus = load_corpus(demo.corpus_bytes).data
    data = Windows(corpus, demo.seq_len, a.steps * a.batch_size, seed=rank)  # this rank's part
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, learning_rate=a.lr,
                             per_device_train_batch_size=a.batch_size, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    optimizer = None  # --plain: the Trainer makes its own AdamW
    if client is not None:
        optimizer = bitps.Optimizer(model, client, lr=args.learning_rate,
                                    weight_decay=args.weight_decay)  # bitps
    losses = Losses()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[losses],
                      optimizers=(optimizer, None))  # bitps: Trainer's schedule drives it
    try:
        trainer.train()
    finally:
        if optimizer is not None:
            optimizer.close()  # bitps: leave the shards
    # bitps is the data parallelism: no process group, no DDP around the model
    _say(f"rank {rank} distributed {torch.distributed.is_initialized()} wrapped "
         f"{type(trainer.model_wrapped).__name__}")
    _say(f"rank {rank} losses {json.dumps(losses.losses)}")


def _say(line: str) -> None:
    """One write per line, its newline included: torchrun's ranks share one pipe, unbuffered,
    where print's text and newline are two writes that another rank's line can split."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
