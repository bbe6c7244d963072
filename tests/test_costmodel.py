"""eval.costmodel: FLOPs, bytes and schedules reproduce a hand-computed tiny example; the validation run
writes a table with every published cell, its prediction and the ratio between them."""

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval import costmodel as cm
from parallel.link import LinkPreset

CONF = str(Path(__file__).resolve().parents[1] / "conf")

# d=8, 2 heads of 4 dims, 2 KV heads, MLP 16, vocab 16, 2 layers; at TP 2 a rank has 1 head and 1 KV head.
TINY = cm.Shape(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
# 1 MFLOP/s and 1 MB/s at 100% efficiency: every cost below reads directly as microseconds.
TOY = cm.DevicePreset("toy", peak_flops=1e6, hbm_Bps=1e6)
PLAIN = cm.Settings(device=TOY, eff_flops=1.0, eff_hbm=1.0, dtype_bytes=2, gqa_expand=False, static_kv=False)
# alpha 0, beta 32 kB/s: an all-reduce of 16 bytes at P=2 takes 2*(2-1)/2 * 16 / 32000 s = 500 us.
LINK = LinkPreset("toy", alpha_s=0.0, beta_Bps=32_000.0)
US = 1e-6


def test_forward_costs_by_hand():
    # One decode step (batch 1, 1 new token) over a KV cache of 4 positions, TP 2.
    f = cm.forward_costs(TINY, tp=2, batch=1, tokens=1, kv_len=4, s=PLAIN, logits_tokens=1)
    # Attention weights per rank: q,k,v 8 x (1 + 2*1) x 4 = 96, o 4 x 8 = 32 -> 128 parameters.
    # FLOPs: 2 x 128 (projections) + 4 x 1 token x 4 positions x 1 head x 4 dims (scores, values) = 320.
    assert f.attention.flops == 320
    # Bytes: (128 weights + 8 norm) x 2 + cache K,V 4 x 4 x 2 x 2 = 64 + new K,V 1 x 4 x 2 x 2 = 16
    # + activations in/out 2 x 8 x 2 = 32 -> 272 + 64 + 16 + 32 = 384.
    assert f.attention.bytes == 384
    # MLP: 3 x 8 x 16 / 2 = 192 weights; FLOPs 384; bytes (192 + 8) x 2 + 32 = 432.
    assert (f.mlp.flops, f.mlp.bytes) == (384, 432)
    # Head (replicated): 8 x 16 weights; FLOPs 256; bytes (128 + 8) x 2 + 16 logits x 2 = 304.
    assert (f.head.flops, f.head.bytes) == (256, 304)
    assert f.all_reduce_bytes == 16  # one token x d=8 x 2 bytes
    # Memory-bound on the toy device: time = bytes / (1 MB/s).
    assert f.attention.time(PLAIN) == pytest.approx(384 * US)
    assert f.mlp.time(PLAIN) == pytest.approx(432 * US)


def test_gqa_expansion_adds_the_expanded_copy():
    f = cm.forward_costs(TINY, tp=2, batch=1, tokens=1, kv_len=4, s=cm.Settings(device=TOY, gqa_expand=True), logits_tokens=1)
    # The expanded K,V (1 query head here) is written and read: 2 x 4 x 4 x 2 x 2 = 128 more bytes.
    assert f.attention.bytes == 384 + 128


@pytest.mark.parametrize(
    ("arch", "time_us", "exposed_us"),
    [
        # 2 layers x (attn 384 + AR 500 + MLP 432 + AR 500) + head 304
        ("standard", 2 * (384 + 500 + 432 + 500) + 304, 2000),
        # 2 layers x (attn + MLP 816 + one AR 500) + head
        ("parallel", 2 * (816 + 500) + 304, 1000),
        ("upper_bound", 2 * 816 + 304, 0),
        # FIFO link: A0 384-884 | M0 issued 816, runs 884-1384 | wait A0: 816->884 (68 exposed) | attn1 to 1268,
        # A1 1384-1884 | wait M0: 1268->1384 (116) | MLP1 to 1816, M1 1884-2384 | wait A1 (68), wait M1 (500)
        # -> clock 2384 + head 304 = 2688; exposed 752.
        ("ladder", 2688, 752),
    ],
)
def test_schedules_by_hand(arch, time_us, exposed_us):
    out = cm.schedule(arch, 2, 384 * US, 432 * US, 304 * US, 16, 2, LINK)
    assert out["time"] == pytest.approx(time_us * US)
    assert out["exposed"] == pytest.approx(exposed_us * US)


def test_contention_charges_a_fraction_of_the_overlapped_time():
    # Decode at prompt 3, 2 new tokens, dynamic cache: the decode step's KV length is 3 + 2 // 2 = 4 (as above).
    s = cm.Settings(**{**PLAIN.__dict__, "contention": 0.5})
    ladder = cm.predict(TINY, "ladder", 2, 1, prompt_len=3, new_tokens=2, link=LINK, s=s)
    # Ladder overlapped 4 x 500 - 752 = 1248 us of its 2000 us of link time; half of it is charged.
    assert ladder["decode_overlapped_s"] == pytest.approx(1248 * US)
    assert ladder["decode_s"] == pytest.approx((2688 + 0.5 * 1248) * US)
    # The standard schedule overlaps nothing, so contention costs it nothing.
    standard = cm.predict(TINY, "standard", 2, 1, prompt_len=3, new_tokens=2, link=LINK, s=s)
    assert standard["decode_s"] == pytest.approx(3936 * US)
    # tokens/s as the reference benchmark counts it: batch x new tokens / (prefill + (new - 1) decode steps).
    assert ladder["tok_s"] == pytest.approx(2 / (ladder["prefill_s"] + ladder["decode_s"]))


def test_hidden_fraction_from_tokens_per_second():
    # Times 10, 8 and 6.67 ms per token: (10 - 8) / (10 - 6.67) = 0.6.
    assert cm._hidden(100.0, 125.0, 150.0) == pytest.approx(0.6)


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("costmodel", overrides=list(overrides))
    return {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in ("paths", "hydra")}


def test_validation_table_against_the_published_70b_numbers(tmp_path):
    result = cm.run_costmodel(_compose(), tmp_path)
    assert [(r["batch"], r["tp"]) for r in result["rows"]] == [(1, 8), (4, 8), (16, 8), (1, 4)]
    first = result["rows"][0]
    assert first["standard_published"] == 77.39 and first["ladder_published"] == 101.22
    for r in result["rows"]:
        for arch in cm.ARCHS:
            assert r[f"{arch}_ratio"] == pytest.approx(r[f"{arch}_predicted"] / r[f"{arch}_published"])
    assert 0.0 <= result["settings"]["contention"] <= 1.0 and result["settings"]["contention_fitted"]
    errors = result["mean_abs_log_ratio"]
    assert set(errors) >= {"all_tok_s", "standard", "ladder", "parallel", "upper_bound", "ladder_speedup"}
    assert all(math.isfinite(v) for v in errors.values())
    readme = (tmp_path / "README.md").read_text()
    assert "| batch/TP | standard pub | standard pred | standard ratio |" in readme
    assert "Mean |log(predicted / published)|" in readme
    assert json.loads((tmp_path / "costmodel.json").read_text())["source"].startswith("Zhang, Mishra")
    assert (tmp_path / "costmodel_ratio.png").stat().st_size > 1000


def test_set_contention_is_used_as_given(tmp_path):
    result = cm.run_costmodel(_compose("contention=0.25"), tmp_path)
    assert result["settings"]["contention"] == 0.25 and not result["settings"]["contention_fitted"]


def test_unknown_presets_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown device preset 'tpu'; choose one of"):
        cm.run_costmodel(_compose("device=tpu"), tmp_path)
    with pytest.raises(ValueError, match=r"Unknown link preset 'infiniband' for nvlink"):
        cm.run_costmodel(_compose("links.nvlink=infiniband"), tmp_path)
