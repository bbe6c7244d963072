"""GQLA: both decode paths are the spec's attention, and each other's (fp64); cached decode == full forward;
switching paths mid-sequence; causality; the caches and their KV bytes (28.125% at the Llama-3-8B shape);
the weight names; TP over groups on gloo == one device (logits, gradients, cached decode); bad inputs.

Tolerances: fp64 1e-10 between the paths and between cached and full forwards (the same function in another
op order; observed ~1e-13); 1e-6 against the spec reference (its RoPE angles are fp64, the model's fp32);
fp32 atol 1e-5 across TP degrees (sums over ranks in another order).
"""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers.cache_utils import DynamicCache, DynamicLayer

import models
import parallel
from models.gqla import GroupedKVCache, LatentCache, LatentLayer, ZooGQLAConfig, ZooGQLAForCausalLM
from models.gqla.entry import bench_config
from tests.distributed import run_ranks

TOL = 1e-10
ATOL = 1e-5
# Weights large enough that attention moves the logits well above fp64 rounding.
INIT = 0.2
# Variants of the tiny config (4 heads, 2 groups, d_c 32, d_nope 8, d_r 8, d_v 16): the latent's norm; no nope
# dims (RoPE on every query/key dim, as TransGQLA's exact case); one group (MQA); a group per head.
VARIANTS = {
    "tiny": {},
    "latent-norm": {"kv_a_layernorm": True},
    "all-rope": {"qk_nope_head_dim": 0, "qk_rope_head_dim": 16, "kv_lora_rank": 16},
    "one-group": {"num_kv_groups": 1, "kv_lora_rank": 24},
    "group-per-head": {"num_kv_groups": 4},
}


def build(dtype=torch.float64, **overrides) -> ZooGQLAForCausalLM:
    torch.manual_seed(0)
    config = models.ZOO["gqla"].tiny(**{"initializer_range": INIT, **overrides})
    return ZooGQLAForCausalLM(config).to(dtype).eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits_on(model, path: str, ids, **kwargs) -> torch.Tensor:
    model.set_attn_path(path)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def decode(model, ids, prefill: int, step: int) -> tuple[torch.Tensor, object]:
    """Logits of `ids` from a prefill of `prefill` tokens, then cached chunks of `step` tokens."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for t in range(prefill, ids.shape[1], step):
            pieces.append(model(ids[:, t : t + step], cache=cache, use_cache=True).logits)
    return torch.cat(pieces, 1), cache


# --- the two paths are one function


@pytest.mark.parametrize("variant", VARIANTS)
def test_absorb_equals_gqa_full_forward(variant):
    model = build(**VARIANTS[variant])
    ids = tokens(2, 12)
    absorb, gqa = logits_on(model, "absorb", ids), logits_on(model, "gqa", ids)
    torch.testing.assert_close(absorb, gqa, rtol=0, atol=TOL)
    # The attention matters at these weights: the comparison is not of two nearly-constant functions.
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data.zero_()
    assert (absorb - logits_on(model, "gqa", ids)).abs().max() > 0.1


@pytest.mark.parametrize("q_len", [1, 2])
def test_cached_decode_equals_full_forward_and_paths_agree(q_len):
    model = build()
    ids = tokens(2, 15)
    decoded = {}
    for path in ("absorb", "gqa"):
        full = logits_on(model, path, ids)
        decoded[path], cache = decode(model, ids, prefill=7, step=q_len)
        torch.testing.assert_close(decoded[path], full, rtol=0, atol=TOL)
        assert type(cache) is {"absorb": LatentCache, "gqa": GroupedKVCache}[path]
    torch.testing.assert_close(decoded["absorb"], decoded["gqa"], rtol=0, atol=TOL)


@pytest.mark.parametrize("q_len", [1, 2])
def test_switch_paths_mid_sequence(q_len):
    """Prefill and decode on the absorb path, expand the latent cache, decode on the gqa path."""
    model = build()
    ids = tokens(2, 15)
    full = logits_on(model, "absorb", ids)
    model.set_attn_path("absorb")
    with torch.no_grad():
        out = model(ids[:, :6], use_cache=True)
        pieces, latent = [out.logits], out.cache
        pieces.append(model(ids[:, 6:9], cache=latent).logits)
        cache = model.expand_cache(latent)
        model.set_attn_path("gqa")
        # The expanded cache is the one the gqa path would have filled itself.
        own = model(ids[:, :9], use_cache=True).cache
        for mine, theirs in zip(cache.layers, own.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=TOL)
            torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=TOL)
        for t in range(9, ids.shape[1], q_len):
            pieces.append(model(ids[:, t : t + q_len], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=TOL)
    # The latent cache is left as it was.
    assert latent.get_seq_length() == 9 and cache.get_seq_length() == ids.shape[1]
    assert latent.to_gqa(model).get_seq_length() == 9


@pytest.mark.parametrize("path", ["absorb", "gqa"])
def test_perturbing_a_future_token_leaves_earlier_outputs(path):
    model = build()
    ids, j = tokens(1, 16), 9
    changed = ids.clone()
    changed[0, j] = (ids[0, j] + 1) % 256
    a, b = logits_on(model, path, ids), logits_on(model, path, changed)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=0)
    assert (a[:, j:] - b[:, j:]).abs().max() > 1e-3


def test_generate_gives_the_same_tokens_on_both_paths():
    model = build(torch.float32)
    prompt = tokens(2, 5)
    out = {}
    for path in ("absorb", "gqa"):
        model.set_attn_path(path)
        out[path] = model.generate(
            prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
    assert type(out["absorb"].cache) is LatentCache and type(out["gqa"].cache) is GroupedKVCache
    assert torch.equal(out["absorb"].sequences, out["gqa"].sequences)


# --- the spec's attention, written out head by head


def spec_attention(attn, x: torch.Tensor, rope_theta: float) -> torch.Tensor:
    """Causal attention of the spec, per head, with an explicit softmax: q_h = [q_h^nope ; RoPE(q_h^r)],
    K_g = [W_UK^(g) c ; RoPE(W_KR x)], V_g = W_UV^(g) c, g = h // (H / n_g); RoPE in rotate-half pairing
    (dim i with i + d_r/2) at frequencies theta^(-2i/d_r), angles in fp64."""
    bsz, seq, _ = x.shape
    heads, groups = attn.num_heads, attn.num_groups
    d_nope, d_r = attn.qk_nope_head_dim, attn.qk_rope_head_dim
    half = d_r // 2
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * rope_theta ** (
        -2 * torch.arange(half, dtype=torch.float64) / d_r
    )

    def rope(v):
        a, b = v[..., :half], v[..., half:]
        return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], -1)

    c = attn.kv_a_proj(x)
    if attn.kv_a_layernorm is not None:
        c = attn.kv_a_layernorm(c)
    k_r = rope(attn.k_rope_proj(x))
    q = attn.q_proj(x).view(bsz, seq, heads, d_nope + d_r)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    outs = []
    for h in range(heads):
        g = h // (heads // groups)
        q_h = torch.cat([q[:, :, h, :d_nope], rope(q[:, :, h, d_nope:])], -1)
        k_g = torch.cat([c @ attn.k_up[g].T, k_r], -1)
        v_g = c @ attn.v_up[g].T
        scores = (q_h @ k_g.transpose(1, 2) / math.sqrt(d_nope + d_r)).masked_fill(~causal, float("-inf"))
        outs.append(scores.softmax(-1) @ v_g)
    return attn.o_proj(torch.cat(outs, -1))


@pytest.mark.parametrize("variant", ["tiny", "latent-norm", "all-rope"])
@pytest.mark.parametrize("path", ["absorb", "gqa"])
def test_attention_is_the_spec(path, variant):
    model = build(**VARIANTS[variant])
    model.set_attn_path(path)
    attn = model.model.layers[1].self_attn
    x = torch.randn(
        2, 9, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        rope = model.model.rotary_emb(x, torch.arange(9)[None])
        got = attn(x, rope)
        expected = spec_attention(attn, x, model.config.rope_parameters["rope_theta"])
    assert rope[0].shape[-1] == model.config.qk_rope_head_dim  # RoPE of the d_r dims only
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


# --- weights, caches, KV bytes


def test_weight_names_and_shapes():
    model = build(kv_a_layernorm=True)
    d, h, g = 64, 4, 2
    expected = {
        "q_proj.weight": (h * (8 + 8), d),
        "kv_a_proj.weight": (32, d),
        "kv_a_layernorm.weight": (32,),
        "k_rope_proj.weight": (8, d),
        "k_up": (g, 8, 32),
        "v_up": (g, 16, 32),
        "o_proj.weight": (d, h * 16),
    }
    prefix = "model.layers.0.self_attn."
    got = {
        k.removeprefix(prefix): tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(prefix)
    }
    assert got == expected
    assert "kv_a_layernorm.weight" not in {k.removeprefix(prefix) for k in build().state_dict()}


def test_caches_hold_what_kv_bytes_per_token_says():
    model = build(torch.float32)
    cfg = model.config
    ids = tokens(3, 10)
    for path, width in [("absorb", (1, cfg.kv_lora_rank + 8, 0)), ("gqa", (2, 8 + 8, 16))]:
        model.set_attn_path(path)
        with torch.no_grad():
            cache = model(ids, use_cache=True).cache
        layer = cache.layers[0]
        assert isinstance(layer, LatentLayer if path == "absorb" else DynamicLayer)
        heads, key, value = width
        assert layer.keys.shape == (3, heads, 10, key) and layer.values.shape == (3, heads, 10, value)
        held = sum(lay.keys.nbytes + lay.values.nbytes for lay in cache.layers)
        assert held == model.kv_bytes_per_token(path) * 3 * 10 * cfg.num_hidden_layers
    assert model.kv_bytes_per_token("absorb", torch.bfloat16) == (32 + 8) * 2
    assert model.kv_bytes_per_token("gqa", torch.bfloat16) == 2 * (8 + 8 + 16) * 2


# The bench's Llama 3 8B shape (conf/bench_shape/llama3-8b.yaml).
LLAMA3_8B = {
    k: v
    for k, v in OmegaConf.load(Path(__file__).parents[1] / "conf/bench_shape/llama3-8b.yaml").items()
    if k != "name"
}


def test_kv_bytes_at_llama3_8b_shape_is_28_125_percent():
    config = ZooGQLAConfig(**LLAMA3_8B, kv_lora_rank=512, qk_rope_head_dim=64)
    assert (config.num_kv_groups, config.qk_nope_head_dim, config.v_head_dim) == (8, 64, 128)
    absorb, gqa = config.kv_bytes_per_token("absorb"), config.kv_bytes_per_token("gqa")
    llama_gqa = 2 * 8 * 128 * 2  # K and V, 8 KV heads x 128, bf16
    assert (absorb, gqa) == (576 * 2, llama_gqa)
    assert absorb / gqa == 0.28125
    # The bench's GQLA of the Llama-3-8B shape is this config; on the gqa path each TP rank holds 1/TP.
    bench = bench_config(LLAMA3_8B, {"tp": 4})
    assert bench.kv_bytes_per_token("absorb") == absorb and bench.attn_path == "gqa"
    assert bench.kv_bytes_per_token("gqa", tp=4) == gqa // 4


def test_path_and_cache_form_errors():
    model = build()
    with pytest.raises(ValueError, match=r"attn_path='mla' is not a GQLA decode path; use 'absorb' or 'gqa'"):
        model.set_attn_path("mla")
    model.set_attn_path("absorb")
    with torch.no_grad():
        latent = model(tokens(1, 4), use_cache=True).cache
        model.set_attn_path("gqa")
        with pytest.raises(
            ValueError, match=r"absorb path's form but the model runs attn_path='gqa'; expand it"
        ):
            model(tokens(1, 1), cache=latent)
        grouped = model(tokens(1, 4), use_cache=True).cache
        model.set_attn_path("absorb")
        with pytest.raises(ValueError, match=r"gqa path's form .* cannot be compressed back"):
            model(tokens(1, 1), cache=grouped)
        with pytest.raises(ValueError, match=r"expand_cache takes the absorb path's LatentCache"):
            model.expand_cache(grouped)
        # A plain transformers cache serves whichever one path fills it.
        plain = DynamicCache()
        model(tokens(1, 4), cache=plain)
        assert plain.get_seq_length() == 4


# --- bad input: one clear error each


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"kv_lora_rank": 49},
            r"kv_lora_rank=49 is larger than the full rank .* min\(hidden_size=64, num_kv_groups x "
            r"\(qk_nope_head_dim \+ v_head_dim\) = 2 x \(8 \+ 16\)\) = 48: .* use kv_lora_rank in 1\.\.48",
        ),
        ({"kv_lora_rank": 0}, r"kv_lora_rank=0 must be a positive integer"),
        (
            {"num_kv_groups": 3},
            r"num_attention_heads=4 is not divisible by num_kv_groups=3 .* must be one of \[1, 2, 4\]",
        ),
        ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim=7 must be a positive even integer"),
        ({"attn_path": "mla"}, r"attn_path='mla' is not a GQLA decode path"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        models.ZOO["gqla"].tiny(**overrides)


def test_bad_field_set_after_construction_is_caught_at_build():
    config = models.ZOO["gqla"].tiny()
    config.kv_lora_rank = 100
    with pytest.raises(ValueError, match=r"kv_lora_rank=100 is larger than the full rank"):
        ZooGQLAForCausalLM(config)


def test_tp_that_does_not_fit_is_one_clear_error():
    entry = models.ZOO["gqla"]
    gqa = entry.tiny(attn_path="gqa")  # 2 groups
    with pytest.raises(
        ValueError,
        match=r"TP degree 4 does not divide num_kv_groups=2; TP degrees that fit this model: \[1, 2\]",
    ):
        entry.check_layout(gqa, {"tp": 4})
    with pytest.raises(
        ValueError, match=r"attn_path='absorb' does not shard over TP \(tp=2\).*attn_path='gqa'"
    ):
        entry.check_layout(entry.tiny(), {"tp": 2})
    entry.check_layout(entry.tiny(), {"tp": 1})
    assert entry.tiny_at({"tp": 2}).attn_path == "gqa"
    try:
        mesh = parallel.init_mesh(tp=2, fake=True)
        with pytest.raises(ValueError, match=r"attn_path='absorb' does not shard over TP"):
            parallel.parallelize(ZooGQLAForCausalLM(entry.tiny()), mesh)
        sharded = parallel.parallelize(ZooGQLAForCausalLM(gqa), mesh)
        with pytest.raises(ValueError, match=r"attn_path='absorb' cannot run on a model sharded over TP"):
            sharded.set_attn_path("absorb")
        assert sharded.kv_bytes_per_token("gqa") * 2 == ZooGQLAForCausalLM(gqa).kv_bytes_per_token("gqa")
    finally:
        torch.distributed.destroy_process_group()


# --- TP over groups on gloo


# 2 query heads per group; a small init scale keeps the fp32 logits O(1), so that atol 1e-5 is fair.
TP_CONFIG = dict(num_attention_heads=8, num_kv_groups=4, attn_path="gqa", initializer_range=0.05)


def _tp_equals_one_device(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    reference, sharded = build(torch.float32, **TP_CONFIG), build(torch.float32, **TP_CONFIG)
    parallel.parallelize(sharded, mesh)
    reference.train(), sharded.train()
    ids = tokens(2, 12)

    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    out = sharded(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=ATOL)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in sharded.named_parameters():
        full = ref_grads[name]
        if full.shape != p.grad.shape:  # sharded: q_proj rows, k_up / v_up groups, o_proj columns, MLP
            (dim,) = [d for d, (a, b) in enumerate(zip(full.shape, p.grad.shape, strict=True)) if a != b]
            full = full.chunk(world_size, dim)[rank]
        torch.testing.assert_close(p.grad, full, rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    assert sharded.model.layers[0].self_attn.k_up.shape[0] == 4 // world_size

    reference.eval(), sharded.eval()
    with torch.no_grad():
        full = reference(ids).logits
        decoded, cache = decode(sharded, ids, prefill=5, step=2)
        torch.testing.assert_close(decoded, full, rtol=0, atol=ATOL)
        # Each rank caches its own groups only.
        assert cache.layers[0].keys.shape[1] == cache.layers[0].values.shape[1] == 4 // world_size
        # A latent cache from the unsharded model's absorb path, expanded by each rank to its groups.
        reference.set_attn_path("absorb")
        latent = reference(ids[:, :7], use_cache=True).cache
        expanded = sharded.expand_cache(latent)
        assert expanded.layers[0].keys.shape[1] == 4 // world_size
        rest = sharded(ids[:, 7:], cache=expanded).logits
        torch.testing.assert_close(rest, full[:, 7:], rtol=0, atol=ATOL)


def test_tp2_equals_one_device():
    run_ranks(_tp_equals_one_device, 2)


@pytest.mark.slow
def test_tp4_equals_one_device():
    # TP 4 of the registry's tiny (one head per group) runs in tests/test_tp.py by default; here 2 heads
    # per group.
    run_ranks(_tp_equals_one_device, 4)
