"""``BitPSStrategy``: an unchanged ``LightningModule`` trained by a stock Lightning Trainer
through bitps. One sync rank trains exactly as Lightning with torch's AdamW and the module's lr
schedule; two ranks (threads, each its own Trainer and client) learn; what cannot be honoured
is refused before the shards are joined, and the client is closed whatever happened."""

from __future__ import annotations

import logging
import threading

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
from lightning.fabric.utilities.rank_zero import rank_zero_only  # noqa: E402

import bitps  # noqa: E402
from bitps.ps import OptimizerConfig  # noqa: E402
from bitps.worker import ClientConfig, PSClient  # noqa: E402
from bitps.worker.demo import DemoConfig, batches, build_model, load_corpus, loss_fn  # noqa: E402
from bitps.worker.integrations.lightning import BitPSStrategy  # noqa: E402

STEPS = 30
# The shard's own lr and weight decay differ from the module's: only the pushed ones may count.
SHARD = OptimizerConfig(name="adamw", lr=0.5, weight_decay=0.3)
pytestmark = [pytest.mark.filterwarnings("ignore:.*does not have many workers"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec.. is deprecated")]
QUIET = dict(accelerator="cpu", devices=1, enable_checkpointing=False, logger=False,
             enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(autouse=True)
def _keep_lightnings_rank():
    """The strategy sets Lightning's process-wide rank, as DDP does; here ranks are threads."""
    rank = rank_zero_only.rank
    yield
    rank_zero_only.rank = rank


def _servers(shards) -> tuple[str, ...]:
    return tuple(f"127.0.0.1:{s.ports['grpc_port']}" for s in shards)


def _client(shards, rank=0, world=1) -> PSClient:
    return PSClient(ClientConfig(servers=_servers(shards), rank=rank, world_size=world,
                                 partition_bytes=1024))


class Classifier(pl.LightningModule):
    """Two param groups (no decay and another lr on the biases), AdamW, a per-step warm-up."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(),
                                       torch.nn.Linear(24, 3))
        self.losses: list[float] = []
        self.lrs: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.lrs.append([g["lr"] for g in self.trainer.optimizers[0].param_groups])

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                 {"params": rest, "weight_decay": 0.0, "lr": 2e-2}],
                                lr=1e-2, weight_decay=0.01, foreach=False)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _loader(batches: list) -> torch.utils.data.DataLoader:
    """The batches as they are, in order."""
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


def _data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7)
    return _loader([(torch.randn(16, 12, generator=gen),
                     torch.randint(0, 3, (16,), generator=gen)) for _ in range(STEPS)])


def test_one_sync_rank_trains_as_lightning_with_torch_adamw(cluster, caplog):
    caplog.set_level(logging.INFO, logger="bitps.worker.integrations.lightning")
    ref = Classifier()
    pl.Trainer(max_steps=STEPS, gradient_clip_val=1.0, **QUIET).fit(ref, _data())

    shards = cluster(2, mode="sync", metrics_port=-1, optimizer=SHARD)
    module, strategy = Classifier(), BitPSStrategy(_client(shards))
    trainer = pl.Trainer(strategy=strategy, max_steps=STEPS, gradient_clip_val=1.0, **QUIET)
    trainer.fit(module, _data())

    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, bitps.Optimizer)
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert optimizer.param_groups[1]["initial_lr"] == 2e-2  # the scheduler's key came along
    assert module.lrs == ref.lrs and module.lrs[0] != module.lrs[-1]  # it drove the lr
    assert max(abs(a - b) for a, b in zip(module.losses, ref.losses, strict=True)) <= 1e-5
    for (name, got), want in zip(module.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (name, (got - want).abs().max())
    assert "AdamW became a bitps.Optimizer" in caplog.text and "betas, " in caplog.text
    assert strategy.is_global_zero and trainer.world_size == 1
    assert strategy.bitps_optimizer is None  # closed at teardown: once
    strategy.teardown()
    with pytest.raises(RuntimeError, match="served one fit"):
        trainer.fit(module, _data())


class OwnOptimizer(Classifier):
    """Builds its bitps.Optimizer itself, over the strategy's client: kept as it is."""

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        opt = bitps.Optimizer([{"params": decay, "weight_decay": 0.05},
                               {"params": rest, "weight_decay": 0.0, "lr": 2e-2}],
                              self.trainer.strategy.client, lr=1e-2, weight_decay=0.01,
                              model=self)
        self.made = opt
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


@pytest.mark.filterwarnings("ignore:.*(dataloader is not resumable|exists and is not empty)")
def test_a_checkpoint_resumes_on_the_shards(cluster, tmp_path):
    """Lightning saves the optimizer's state (param groups, the worker's clock) on rank 0 and
    restores it into the next fit's; the parameters come from the shards, which kept going."""
    shards = cluster(2, mode="sync", metrics_port=-1, optimizer=SHARD)
    run = dict(QUIET, enable_checkpointing=True, default_root_dir=tmp_path)
    pl.Trainer(strategy=BitPSStrategy(_client(shards)), max_steps=10, **run).fit(
        Classifier(), _data())
    (ckpt,) = tmp_path.glob("**/*.ckpt")
    assert "bitps" in torch.load(ckpt, weights_only=False)["optimizer_states"][0]

    module, strategy = OwnOptimizer(), BitPSStrategy(servers=",".join(_servers(shards)),
                                                     partition_bytes=1024)
    trainer = pl.Trainer(strategy=strategy, max_steps=20, **run)
    trainer.fit(module, _data(), ckpt_path=ckpt)
    assert trainer.optimizers[0] is module.made and module.made.clock == 20
    assert trainer.global_step == 20
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 20
    assert strategy.bitps_optimizer is None


class ByteLM(pl.LightningModule):
    """The demo's byte-level Qwen3-MoE, as a Hugging Face model would be wrapped."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = loss_fn(self.model, *batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.95))
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=60, eta_min=1e-3)]


def test_two_ranks_on_two_shards_learn(cluster):
    cfg = DemoConfig(hidden_size=32, num_layers=1, seq_len=32, batch_size=4,
                     corpus_bytes=200_000)
    corpus, steps = load_corpus(cfg.corpus_bytes), 60
    shards = cluster(2, mode="sync", metrics_port=-1, optimizer=SHARD)
    modules = [ByteLM(build_model(cfg)) for _ in range(2)]  # one seed: built here, not racing
    data = [[b for b, _ in zip(batches(corpus, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                       rank=r, world_size=2, seed=cfg.seed), range(steps))]
            for r in range(2)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:  # the strategy's own client, from its settings (as from torchrun's environment)
            strategy = BitPSStrategy(servers=",".join(_servers(shards)), rank=r, world_size=2,
                                     deadline_s=30.0, register_timeout_s=30.0)  # < the join's
            trainer = pl.Trainer(strategy=strategy, max_steps=steps, **QUIET)
            assert trainer.world_size == 2
            trainer.fit(modules[r], _loader(data[r]))
            assert strategy.is_global_zero == (r == 0)
        except BaseException as err:  # noqa: BLE001 - raised by the test
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    assert not errors, errors
    for m in modules:  # from ln(256) to about half of it: fell by 30 % with a margin
        first, last = m.losses[0], sum(m.losses[-10:]) / 10
        assert len(m.losses) == steps and last <= 0.7 * first, (first, last)
    for a, b in zip(modules[0].parameters(), modules[1].parameters()):
        assert torch.equal(a, b)  # sync: both ranks pulled the same parameters


class TwoOptimizers(Classifier):
    """Manual optimization: Lightning itself takes several optimizers there."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # never reached
        raise AssertionError("trained with two optimizers")

    def configure_optimizers(self):
        return (torch.optim.AdamW(self.net[0].parameters()),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1))


class CyclesMomentum(Classifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)]


class FailsAtStep3(Classifier):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            raise RuntimeError("the module failed at step 3")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("module", "error", "message"), [
    (TwoOptimizers, ValueError, r"exactly one torch optimizer .* returned 2: \['AdamW', 'SGD'\]"),
    (CyclesMomentum, ValueError, r"OneCycleLR schedules momentum .* pass cycle_momentum=False"),
    (FailsAtStep3, RuntimeError, "failed at step 3"),  # after the shards were joined
])
def test_what_cannot_be_kept_is_refused_and_the_client_closed(cluster, module, error, message):
    shards = cluster(1, mode="sync", metrics_port=-1, optimizer=SHARD)
    client = _client(shards)
    strategy = BitPSStrategy(client)
    trainer = pl.Trainer(strategy=strategy, max_steps=STEPS, **QUIET)
    with pytest.raises(error, match=message):
        trainer.fit(module(), _data())
    assert client._closing.is_set() and strategy.bitps_optimizer is None
    with pytest.raises(RuntimeError, match="served one fit"):
        _ = strategy.client
