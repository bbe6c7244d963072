"""DeepSeek-V2 / V3 (MLA) checkpoints in and out of the zoo's `gqla`, against transformers' own
DeepseekV2ForCausalLM / DeepseekV3ForCausalLM built tiny and random from their config classes (nothing
downloaded), float64:

- `deepseek_to_gqla` (models/gqla/deepseek.py): converted == DeepSeek, logits within 1e-6 relative on both
  decode paths, greedy generation identical; with transformers' fp32 islands lifted (its RMSNorms and V2's
  complex RoPE compute in fp32 whatever the dtype) within 1e-12: the mapping itself is exact. Cases: V2 and
  V3, q_lora_rank null (V2-Lite) and set (V2 / V3: the zoo's new query low-rank path against transformers'),
  interleaved and rotate-half RoPE, tied embeddings; from a saved directory, and with `train.convert`.
- `export_deepseek` (models/gqla/stock.py): a zoo gqla at one group per head loads as plain
  DeepseekV3ForCausalLM (no remote code) with the same logits, and converts back to the same weights bit for
  bit.
- refusals, each naming the field: MoE layers, YaRN, attention biases, rms_norm_eps, other model types; an
  export of a regrouped model or one without the latent norm.
- regrouping (models/gqla/regroup.py): to the same count exact; heads whose up-projections differ by an
  invertible map merge exactly (the folds into query and output are right); the gqa path at fewer groups has
  the smaller cache; impossible counts refused.
"""

from pathlib import Path

import pytest
import torch
import transformers.models.deepseek_v2.modeling_deepseek_v2 as modeling_v2
import transformers.models.deepseek_v3.modeling_deepseek_v3 as modeling_v3
from hydra import compose, initialize_config_dir
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

import models
from models.common import rope_inv_freq
from models.gqla import ZooGQLAForCausalLM
from models.gqla.deepseek import check_options, convert_deepseek, deepseek_to_gqla
from models.gqla.regroup import attention_statistics, check_groups, regroup
from models.gqla.stock import export_deepseek, to_deepseek
from train.convert import convert
from train.data import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-6  # relative to the largest logit: transformers' DeepSeek RMSNorms (and V2's RoPE) run in fp32
EXACT = 1e-12  # the same with those fp32 islands computed in fp64 (observed ~2e-15)
SHAPES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=2,  # >= num_hidden_layers: every layer dense (the zoo's gqla has a dense MLP)
    max_position_embeddings=128,
)
CASES = {
    "v2-lite": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(q_lora_rank=None)),
    "v2-q-lora-tied": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(q_lora_rank=24, tie_word_embeddings=True)),
    "v3-q-lora": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(q_lora_rank=24)),
    "v3-rotate-half-theta": (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    ),
}
IDS = torch.randint(0, SHAPES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))


def tiny_deepseek(case: str, dtype=torch.float64, **overrides):
    config_class, model_class, fields = CASES[case]
    torch.manual_seed(0)
    model = model_class(config_class(**{**SHAPES, **fields, **overrides})).to(dtype).eval()
    with torch.no_grad():  # weights large enough to move the logits, norms non-trivial (a swap shows)
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.2)
    return model


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def logits(model, ids=IDS, path: str | None = None) -> torch.Tensor:
    if path is not None:
        model.set_attn_path(path)
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def fp64_deepseek(monkeypatch):
    """transformers' DeepSeek with its fp32 steps in fp64: RMSNorm without the fp32 cast, V2's RoPE as
    complex128 from cos / sin; and the zoo's fp32 inverse frequencies (it rounds theta^(-2i/d) from fp64,
    transformers computes it in fp32: one ulp apart at some thetas), so that the angles are the same."""

    def inv_freq(config, *args, **kwargs):
        return rope_inv_freq(config.rope_parameters, config.qk_rope_head_dim), 1.0

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary_v2(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.complex(freqs.cos().double(), freqs.sin().double())

    def apply_rotary_v2(xq, xk, freqs_cis):
        as_complex = lambda t: torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous())  # noqa: E731
        f = freqs_cis.unsqueeze(1)
        return torch.view_as_real(as_complex(xq) * f).flatten(3), torch.view_as_real(as_complex(xk) * f).flatten(3)

    for rotary in (modeling_v3.DeepseekV3RotaryEmbedding, modeling_v2.DeepseekV2RotaryEmbedding):
        monkeypatch.setattr(rotary, "compute_default_rope_parameters", staticmethod(inv_freq))
    monkeypatch.setattr(modeling_v3.DeepseekV3RMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_v2.DeepseekV2RMSNorm, "forward", rms_norm)
    monkeypatch.setattr(modeling_v2.DeepseekV2RotaryEmbedding, "forward", rotary_v2)
    monkeypatch.setattr(modeling_v2, "apply_rotary_emb", apply_rotary_v2)


# --- DeepSeek -> gqla ----------------------------------------------------------------------------------


def test_registered():
    converter = models.get_converter("deepseek_to_gqla")
    assert converter.target == "gqla" and converter.source_types == ("deepseek_v2", "deepseek_v3")
    assert converter.options == ("num_kv_groups", "calibration_batches")


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_equals_deepseek(case):
    hf = tiny_deepseek(case)
    zoo = convert_deepseek(hf)
    c = zoo.config
    assert c.num_kv_groups == c.num_attention_heads == 4 and c.kv_a_layernorm
    assert c.q_lora_rank == hf.config.q_lora_rank
    assert (zoo.model.layers[0].self_attn.q_proj is None) == (c.q_lora_rank is not None)
    reference = logits(hf)
    for path in ("absorb", "gqa"):
        assert relative_gap(logits(zoo, path=path), reference) < RTOL, path


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_equals_deepseek_in_fp64(case, fp64_deepseek):
    hf = tiny_deepseek(case)
    zoo = convert_deepseek(hf)
    for path in ("absorb", "gqa"):
        assert relative_gap(logits(zoo, path=path), logits(hf)) < EXACT, path


def test_the_rope_reordering_matters(fp64_deepseek):
    """Without the interleaved -> rotate-half reordering the function differs: the check above can fail."""
    hf = tiny_deepseek("v3-q-lora")
    hf.config.rope_interleave = False  # DeepSeek now pairs (i, i + d_r/2) on the same weights
    assert relative_gap(logits(convert_deepseek(tiny_deepseek("v3-q-lora"))), logits(hf)) > 1e-3


def test_greedy_generation_identical():
    hf = tiny_deepseek("v3-q-lora")
    zoo = convert_deepseek(hf)
    prompt = IDS[:1, :6]
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = hf.generate(prompt, **settings)
        for path in ("absorb", "gqa"):
            zoo.set_attn_path(path)
            assert torch.equal(zoo.generate(prompt, **settings), expected), path


def test_from_directory_and_saved_zoo_checkpoint(tmp_path):
    hf = tiny_deepseek("v2-lite", torch.float32)
    hf.save_pretrained(tmp_path / "deepseek")
    zoo = deepseek_to_gqla(tmp_path / "deepseek")
    assert zoo.dtype == torch.float32
    assert relative_gap(logits(zoo, IDS), logits(hf)) < 1e-5  # fp32 weights and activations
    zoo.save_pretrained(tmp_path / "zoo")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo").eval()
    assert isinstance(again, ZooGQLAForCausalLM) and again.config.q_lora_rank is None
    assert torch.equal(logits(again, path="absorb"), logits(zoo, path="absorb"))


def test_q_lora_rank_saves_and_loads(tmp_path):
    zoo = convert_deepseek(tiny_deepseek("v3-q-lora"))
    zoo.save_pretrained(tmp_path)
    again = ZooGQLAForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.q_lora_rank == 24
    assert torch.equal(logits(again, path="absorb"), logits(zoo, path="absorb"))
    assert sum(p.numel() for p in zoo.parameters()) == zoo.config.num_parameters_formula()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(first_k_dense_replace=1), r"first_k_dense_replace=1 with num_hidden_layers=2: layers 1..1 are DeepSeekMoE"),
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 32}),
            "rope_type='yarn'",
        ),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(rms_norm_eps=1e-5), r"rms_norm_eps=1e-05: DeepSeek's latent norms"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
)
def test_refusals_name_the_field(overrides, match):
    config = DeepseekV3Config(**{**SHAPES, **overrides})
    with pytest.raises(ValueError, match=match):
        check_options(config)


def test_refuses_other_checkpoints(tmp_path):
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="model_type='llama'"):
        check_options(LlamaConfig())
    with pytest.raises(ValueError, match=r"num_kv_groups=3 cannot be reached from the model's 4 groups.*\[1, 2, 4\]"):
        check_options(DeepseekV3Config(**SHAPES), num_kv_groups=3)


def test_train_convert_deepseek_to_gqla(tmp_path):
    tokenizer = load_tokenizer()
    hf = tiny_deepseek("v3-q-lora", torch.float32, vocab_size=len(tokenizer))
    hf.save_pretrained(tmp_path / "deepseek")
    overrides = ["converter=deepseek_to_gqla", f"source={tmp_path / 'deepseek'}", "data.seq_len=32",
                 "data.batch_size=4", "evaluate.max_batches=2", "calibration_batches=1",
                 f"paths.output_dir={tmp_path / 'run'}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("convert", overrides=overrides)
        if "num_kv_groups" not in cfg:  # until conf/convert.yaml has the option
            cfg = compose("convert", overrides=[*overrides, "+num_kv_groups=null"])
        result = convert(cfg)
    assert result["title"] == "DeepSeek-V2 / V3 -> GQLA" and result["num_kv_groups"] == 4
    val = result["val"]
    assert val["gqla, no retraining"]["loss"] == pytest.approx(val["deepseek (source)"]["loss"], rel=1e-5)
    zoo = ZooGQLAForCausalLM.from_pretrained(result["gqla_dir"]).eval()
    assert relative_gap(logits(zoo, IDS), logits(hf, IDS)) < 1e-5


# --- gqla -> DeepseekV3ForCausalLM --------------------------------------------------------------------


def zoo_gqla(**overrides) -> ZooGQLAForCausalLM:
    torch.manual_seed(0)
    config = models.ZOO["gqla"].tiny(
        **{"num_kv_groups": 4, "kv_a_layernorm": True, "initializer_range": 0.2, **overrides}
    )
    model = ZooGQLAForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 12, "tie_word_embeddings": True}], ids=["q_proj", "q_lora"])
def test_export_round_trip(overrides, tmp_path):
    zoo = zoo_gqla(**overrides)
    export_deepseek(zoo, tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no trust_remote_code
    assert type(stock) is DeepseekV3ForCausalLM and stock.dtype == torch.float64
    assert stock.config.first_k_dense_replace == stock.config.num_hidden_layers
    for path in ("absorb", "gqa"):
        assert relative_gap(logits(stock, IDS), logits(zoo, IDS, path)) < RTOL
    back = convert_deepseek(stock)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in zoo.state_dict().items())


def test_export_exact_in_fp64(fp64_deepseek):
    zoo = zoo_gqla(q_lora_rank=12)
    assert relative_gap(logits(to_deepseek(zoo)), logits(zoo, path="absorb")) < EXACT


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_kv_groups": 2}, r"num_kv_groups=2 with num_attention_heads=4: DeepSeek's MLA has one group per head"),
        ({"kv_a_layernorm": False}, "kv_a_layernorm=False"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ],
)
def test_export_refusals(overrides, match):
    with pytest.raises(ValueError, match=match):
        to_deepseek(zoo_gqla(**overrides))


# --- regrouping ---------------------------------------------------------------------------------------


BATCHES = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(3)]


def test_regroup_to_the_same_count_is_exact():
    zoo = zoo_gqla(q_lora_rank=12)
    reference = logits(zoo, IDS, "absorb")
    for stats in (attention_statistics(zoo, BATCHES), None):
        assert relative_gap(logits(regroup(zoo, 4, stats), IDS, "absorb"), reference) < 1e-12


def test_regroup_merges_exactly_what_the_query_and_output_can_absorb():
    """Heads 1 and 3 whose W_UK, W_UV are invertible maps of heads 0 and 2's: 2 groups compute the same
    function, on both paths (the key folds went into the query rows, the value folds into o_proj)."""
    zoo = zoo_gqla()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in zoo.model.layers:
            attn = layer.self_attn
            for g in (1, 3):
                attn.k_up[g] = torch.randn(8, 8, generator=gen, dtype=torch.float64) @ attn.k_up[g - 1]
                attn.v_up[g] = torch.randn(16, 16, generator=gen, dtype=torch.float64) @ attn.v_up[g - 1]
    merged = regroup(zoo, 2, attention_statistics(zoo, BATCHES))
    assert merged.config.num_kv_groups == 2 and merged.model.layers[0].self_attn.k_up.shape == (2, 8, 32)
    reference = logits(zoo, IDS, "absorb")
    for path in ("absorb", "gqa"):
        assert relative_gap(logits(merged, IDS, path), reference) < 1e-10, path
    assert merged.kv_bytes_per_token("gqa") * 2 == zoo.kv_bytes_per_token("gqa")


def test_regroup_is_lossy_in_general_and_refuses_impossible_counts():
    zoo = zoo_gqla()
    merged = regroup(zoo, 2, attention_statistics(zoo, BATCHES))
    assert relative_gap(logits(merged, IDS, "absorb"), logits(zoo, IDS, "absorb")) > 1e-3
    with pytest.raises(ValueError, match=r"num_kv_groups=1 cannot be reached.*use one of \[2, 4\]"):
        check_groups(zoo.config, 1)  # d_c = 32 > 1 x (8 + 16)


# --- TP over groups with DeepSeek's query low-rank path ------------------------------------------------


def _tp_with_q_lora_equals_one_device(rank, world_size):
    import parallel

    mesh = parallel.init_mesh(tp=world_size)
    fields = dict(num_kv_groups=4, q_lora_rank=12, kv_a_layernorm=True, attn_path="gqa", initializer_range=0.05)
    torch.manual_seed(0)
    reference = ZooGQLAForCausalLM(models.ZOO["gqla"].tiny(**fields))
    torch.manual_seed(0)
    sharded = ZooGQLAForCausalLM(models.ZOO["gqla"].tiny(**fields))
    parallel.parallelize(sharded, mesh)
    attn = sharded.model.layers[0].self_attn
    assert attn.q_b_proj.weight.shape[0] == 4 * (8 + 8) // world_size  # the rows of this rank's heads
    assert attn.q_a_proj.weight.shape[0] == 12  # the query latent replicated
    ids = IDS[:, :12] % 256
    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    out = sharded(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=1e-5)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, p in sharded.named_parameters():
        full = ref_grads[name]
        if full.shape != p.grad.shape:
            (dim,) = [d for d, (a, b) in enumerate(zip(full.shape, p.grad.shape, strict=True)) if a != b]
            full = full.chunk(world_size, dim)[rank]
        # q_a_proj / q_a_layernorm get their whole gradient through Megatron's f on q_b_proj's input
        torch.testing.assert_close(p.grad, full, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_tp2_with_q_lora_rank_equals_one_device():
    from tests.distributed import run_ranks

    run_ranks(_tp_with_q_lora_equals_one_device, 2)
