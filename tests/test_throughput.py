"""train.flops and train.throughput: FLOPs per token counted on the meta device against hand formulas, the MFU
arithmetic, and the callback's three metrics in a two-step CPU run."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn

import models
from train.flops import flops_per_token, peak_flops, train_flops_per_token
from train.throughput import ThroughputMonitor, throughput_metrics

SEQ = 32


def attention_projections(c) -> int:
    """Multiply-adds per token of one layer's q, k, v, o projections."""
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_key_value_heads * head_dim


def attention_scores(c, seq_len: int) -> int:
    """FLOPs per token of one layer's two attention matmuls (Q K^T, P V), forward, over the full T x T square."""
    return 2 * 2 * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) * seq_len


def test_llama_matches_the_hand_count():
    c = models.get("llama").tiny()  # vocab 256, d 64, f 176, 4 layers, 4 heads of 16, 2 KV heads
    d, f, L_, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    matmul_params = (
        L_ * (attention_projections(c) + 3 * d * f) + d * V
    )  # + lm_head; the embedding is a gather
    forward = 2 * matmul_params + L_ * attention_scores(c, SEQ)
    assert forward == 434176  # 2 x 200704 + 4 x 8192
    got = flops_per_token("llama", c, SEQ)
    assert got.forward == pytest.approx(forward, rel=1e-6)
    # The backward, measured: twice the forward (dX and dW of every matmul; the first layer's dX feeds the
    # embedding's gradient). Together PaLM's 6 N + 12 L H Q T.
    assert got.backward == pytest.approx(2 * forward, rel=1e-6)
    assert got.train == pytest.approx(
        6 * matmul_params + 12 * L_ * c.num_attention_heads * 16 * SEQ, rel=1e-6
    )
    # A dict of config fields gives the same count as the config object.
    assert flops_per_token("llama", dict(models.TINY_LLAMA), SEQ) == got


def test_moe_counts_only_the_routed_experts():
    entry = models.get("moe")
    c = entry.tiny()  # 4 experts of width 176, top-2, MoE in layers 2 and 4
    d, f, L_, E = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_local_experts
    moe_layers = L_ // c.moe_layer_freq
    assert moe_layers == 2
    expert = 3 * d * f  # one SwiGLU expert's multiply-adds per token
    forward = 2 * (
        L_ * attention_projections(c)
        + (L_ - moe_layers) * expert
        + moe_layers * (2 * expert + d * E)
        + d * c.vocab_size
    ) + L_ * attention_scores(c, SEQ)
    top2 = flops_per_token("moe", c, SEQ)
    assert top2.forward == pytest.approx(forward, rel=1e-6)
    top1 = flops_per_token("moe", entry.tiny(num_experts_per_tok=1), SEQ)
    # One expert fewer per token in each MoE layer: its three matmuls, forward and backward (x3).
    assert top2.train - top1.train == pytest.approx(3 * moe_layers * 2 * expert, rel=1e-6)
    assert top2.train - top1.train == 405504
    # Four experts in the layer, two of them per token: not the dense count of all four.
    top4 = flops_per_token("moe", entry.tiny(num_experts_per_tok=4), SEQ)
    assert top4.train - top2.train == pytest.approx(2 * (top2.train - top1.train), rel=1e-6)


@pytest.mark.parametrize("name", sorted(models.ZOO))
def test_every_architecture_counts_its_training_step(name):
    got = flops_per_token(name, models.get(name).tiny(), SEQ)
    assert got.forward > 0
    # Every matmul's backward is its two gradient matmuls; linear attention's decay terms and first-layer
    # inputs that need no gradient make it a little less than 2x.
    assert 1.9 * got.forward <= got.backward <= 2.0 * got.forward * (1 + 1e-9)


def test_recompute_adds_the_forward():
    got = flops_per_token("llama", models.get("llama").tiny(), SEQ)
    assert got.with_recompute("none") == got.train
    assert got.with_recompute("full") - got.train == pytest.approx(got.forward, rel=1e-12)
    # Selective saves every matmul and attention output: every op the counter counts, so nothing is added.
    assert got.forward_unsaved == 0
    assert got.with_recompute("selective") == got.train
    assert (
        train_flops_per_token("llama", models.get("llama").tiny(), SEQ, recompute="full")
        == got.train + got.forward
    )
    with pytest.raises(ValueError, match="recompute='some'"):
        got.with_recompute("some")


def test_mfu_by_hand():
    fpt = train_flops_per_token("llama", models.get("llama").tiny(), SEQ)
    assert fpt == 3 * 434176 == 1302528
    # 16 sequences of 32 tokens on each of 2 data replicas, a 0.25 s step, 4 devices (dp 2 x tp 2), an H100.
    peak = peak_flops("h100-sxm")
    assert peak == 989e12
    out = throughput_metrics(
        tokens=16 * 32 * 2, seconds=0.25, devices=4, flops_per_token=fpt, peak_flops_per_s=peak
    )
    assert out["tokens_per_s_per_device"] == 1024.0
    assert out["mfu"] == pytest.approx(1024 * 1302528 / 989e12, rel=1e-12)
    assert out["mfu"] == pytest.approx(1.34863e-6, rel=1e-5)
    assert "mfu" not in throughput_metrics(1024, 1.0, 1, fpt, None)
    assert peak_flops("h200", peak_tflops=312) == 312e12  # an explicit setting wins
    if not torch.cuda.is_available():
        assert peak_flops() is None
    with pytest.raises(ValueError, match="Unknown device preset 'tpu'"):
        peak_flops("tpu")


class _Captured(Logger):
    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []

    @property
    def name(self):
        return "captured"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.steps.append(dict(metrics))


class _Toy(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = [torch.randint(0, 16, (8,)) for _ in range(8)]
        return torch.utils.data.DataLoader(
            data, batch_size=2, collate_fn=lambda xs: {"input_ids": torch.stack(xs)}
        )


def test_callback_logs_three_metrics_per_step(tmp_path):
    fpt, peak = 1302528.0, 1e9
    logger = _Captured()
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=logger, callbacks=[ThroughputMonitor(fpt, peak, devices=1)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_Toy())
    steps = [m for m in logger.steps if "train/tokens_per_s_per_device" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["train/tokens_per_s_per_device"] > 0
        assert m["train/mfu"] == pytest.approx(m["train/tokens_per_s_per_device"] * fpt / peak, rel=1e-6)
        assert 0 < m["train/peak_memory_gb"] < 1024 and math.isfinite(m["train/peak_memory_gb"])
