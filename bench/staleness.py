"""Exact single-process simulation of SYNC / SEQ (SSP-0) / ASYNC-1 Adam on a parameter-server shard.

The study behind ``ServerConfig.split_lr`` and ``ServerConfig.lookahead`` (results in
``bench/results/staleness.md``).

Usage: python -m bitps.bench.staleness MODEL OUT.jsonl SPEC [SPEC ...]
  MODEL: A (worker.demo model) or B (28.6M GPT-2 byte LM)
  SPEC:  mode:fix:lr:seed[:beta2[:warmup[:clocks]]]
     mode in sync|seq|async ; fix is a '+'-joined subset of {none,a,b,c,d04,d2}
       a  = lr/W per push
       b  = lr/W per push and betas**(1/W)
       c  = lr/(1+gap)
       dX = DC-ASGD, g' = g + lam*g*g*(w_now - w_then), lam = 0.04 (d04) or 0.2 (d2)
"""
from __future__ import annotations

import copy
import json
import sys
import time

import torch

from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn

torch.set_num_threads(1)

W = 2


def make(model_kind: str, seed: int):
    if model_kind == "A":
        cfg = DemoConfig()
        return build_model(DemoConfig(seed=seed)), cfg.batch_size, 300
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=768, n_layer=4,
                                   n_head=8, n_inner=3072, resid_pdrop=0, embd_pdrop=0,
                                   attn_pdrop=0, tie_word_embeddings=True))
    m.train()
    return m, 4, 60


def lossf(model, x, y):
    return loss_fn(model, x, y)  # same formula for both models: CE(logits.reshape(-1,256), labels)


def grad_at(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = lossf(model, x, y)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()], loss.item()


def run(model_kind, mode, fix, lr, seed, beta2=0.999, warmup=0, clocks=None, log_every=None):
    fixes = set(fix.split("+")) - {"none"}
    shard, bs, default_clocks = make(model_kind, seed)
    clocks = clocks or default_clocks
    corpus = load_corpus(DemoConfig().corpus_bytes)
    streams = [batches(corpus, batch_size=bs, seq_len=128, rank=w, world_size=W, seed=seed)
               for w in range(W)]
    b1, b2 = 0.9, beta2
    for t in fixes:  # e.g. "m0.5": explicit beta1 override (asynchrony adds implicit momentum)
        if t.startswith("m"):
            b1 = float(t[1:])
    if mode != "sync" and "b" in fixes:
        b1, b2 = b1 ** (1 / W), b2 ** (1 / W)
    opt = torch.optim.Adam(shard.parameters(), lr=lr, betas=(b1, b2))
    params = list(shard.parameters())
    lam = 0.04 if "d04" in fixes else 0.2 if "d2" in fixes else 0.0
    version = 0
    last_delta = None

    def push(g, then_version, then_params, clock):
        nonlocal version, last_delta
        gap = version - then_version
        step_lr = lr * (min(1.0, (clock + 1) / warmup) if warmup else 1.0)
        if mode != "sync" and ("a" in fixes or "b" in fixes):
            step_lr /= W
        if "c" in fixes:
            step_lr /= 1 + gap
        with torch.no_grad():
            for p, gi, pt in zip(params, g, then_params):
                if lam and gap:
                    gi = gi + lam * gi * gi * (p - pt)
                p.grad = gi
        opt.param_groups[0]["lr"] = step_lr
        if "la" in fixes:
            before = [p.detach().clone() for p in params]
        opt.step()
        if "la" in fixes:
            last_delta = [p.detach() - b for p, b in zip(params, before)]
        version += 1

    workers = [copy.deepcopy(shard) for _ in range(W)] if mode == "async" else None
    held_version = [0] * W
    clock_losses = []
    t0 = time.time()
    for clock in range(clocks):
        losses = []
        if mode in ("sync", "seq"):
            snap = [p.detach().clone() for p in params] if lam else params
            v0 = version
            gs = []
            for w in range(W):
                x, y = next(streams[w])
                if mode == "seq" and "la" in fixes and w and last_delta is not None:
                    # lookahead pull: worker w's push is applied after w others; hand it the
                    # params extrapolated by w x the last applied update
                    with torch.no_grad():
                        for p, d in zip(params, last_delta):
                            p.add_(d, alpha=w)
                    g, loss = grad_at(shard, x, y)
                    with torch.no_grad():
                        for p, d in zip(params, last_delta):
                            p.sub_(d, alpha=w)
                else:
                    g, loss = grad_at(shard, x, y)
                gs.append(g)
                losses.append(loss)
            if mode == "sync":
                push([sum(t) / W for t in zip(*gs)], v0, snap, clock)
            else:
                for g in gs:
                    push(g, v0, snap, clock)
        elif mode == "fresh":  # sanity: alternate workers, each gradient at current params
            for w in range(W):
                x, y = next(streams[w])
                g, loss = grad_at(shard, x, y)
                losses.append(loss)
                push(g, version, params, clock)
        else:  # async-1: w=0,1 alternate; each holds the params it pulled after its last push
            for w in range(W):
                x, y = next(streams[w])
                g, loss = grad_at(workers[w], x, y)
                losses.append(loss)
                push(g, held_version[w], list(workers[w].parameters()), clock)
                with torch.no_grad():
                    if "la" in fixes and last_delta is not None:
                        # lookahead pull: the other W-1 pushes land before this worker's next
                        # push; hand out params extrapolated by (W-1) x the last applied update
                        for pw, ps, d in zip(workers[w].parameters(), params, last_delta):
                            pw.copy_(ps + (W - 1) * d)
                    else:
                        for pw, ps in zip(workers[w].parameters(), params):
                            pw.copy_(ps)
                held_version[w] = version
        clock_losses.append(sum(losses) / W)
        if log_every and (clock + 1) % log_every == 0:
            print(f"  clock {clock + 1:4d} loss {clock_losses[-1]:.3f} "
                  f"(mean10 {sum(clock_losses[-10:]) / len(clock_losses[-10:]):.3f}) "
                  f"{time.time() - t0:.0f}s", flush=True)
    # held-out eval on 8 fixed batches (rank-5 stream, seed 99)
    ev = batches(corpus, batch_size=bs, seq_len=128, rank=5, world_size=6, seed=99)
    with torch.no_grad():
        evl = sum(lossf(shard, *next(ev)).item() for _ in range(8)) / 8
    tail = clock_losses[-30:]
    return dict(model=model_kind, mode=mode, fix=fix, lr=lr, seed=seed, beta2=beta2,
                warmup=warmup, clocks=clocks, train=sum(tail) / len(tail), eval=evl,
                curve=[round(v, 4) for v in clock_losses], secs=round(time.time() - t0, 1))


if __name__ == "__main__":
    kind, out = sys.argv[1], sys.argv[2]
    for spec in sys.argv[3:]:
        f = spec.split(":")
        mode, fix, lr, seed = f[0], f[1], float(f[2]), int(f[3])
        beta2 = float(f[4]) if len(f) > 4 else 0.999
        warmup = int(f[5]) if len(f) > 5 else 0
        clocks = int(f[6]) if len(f) > 6 else None
        r = run(kind, mode, fix, lr, seed, beta2, warmup, clocks,
                log_every=10 if kind == "B" else None)
        print(f"{spec:40s} train {r['train']:.4f} eval {r['eval']:.4f} {r['secs']}s", flush=True)
        with open(out, "a") as fh:
            fh.write(json.dumps(r) + "\n")
