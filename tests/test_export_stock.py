"""Zoo models exported to stock transformers classes (models/stock_export.py): zoo `llama` ->
LlamaForCausalLM, zoo `moe` -> MixtralForCausalLM (gqla -> DeepseekV3ForCausalLM is models/gqla/stock.py's,
tested in tests/test_deepseek.py; here only that export_stock reaches it), loaded back with plain `AutoModelForCausalLM` (no
trust_remote_code, no zoo code in the folder), tiny random models:

- every weight arrives bit for bit (the stock model's state dict, mapped back, equals the zoo's);
- float64 logits: as shipped within 1e-6 relative. Why not fp64 rounding: the stock classes' RMSNorm casts to
  fp32 whatever the model's dtype, their RoPE table is computed in fp32 arithmetic (the zoo's is fp64,
  rounded: one ulp apart), and both MoE routers score in fp32. With the stock norm and RoPE table made fp64
  (a test-only patch of the loaded model), llama agrees within 1e-12 and Mixtral within 1e-7 (its router);
- the same experts chosen, identical greedy generation;
- every zoo moe setting Mixtral cannot compute, and every other architecture, refused by name;
- `train.convert converter=export_stock` writes the stock checkpoint.
"""

import json
import types
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralForCausalLM

import models
from models.checkpoint import save_checkpoint
from models.common.moe import TopKRouter
from models.stock_export import EXPORT_STOCK, ZOO_TYPES, export_stock, moe_state_to_mixtral, to_stock
from train.convert import convert
from train.data import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHIPPED_RTOL = 1e-6
IDS = torch.randint(0, models.TINY_LLAMA["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3": ("llama", {
        "tie_word_embeddings": True, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_parameters": LLAMA3_ROPE,
    }),
    "moe-top2-llama3": ("moe", {"moe_layer_freq": 1, "router_aux_loss_coef": 0.02, "rope_parameters": LLAMA3_ROPE}),
    "moe-top1-tied": ("moe", {"moe_layer_freq": 1, "num_experts_per_tok": 1, "tie_word_embeddings": True,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}),
}
STOCK = {"llama": LlamaForCausalLM, "moe": MixtralForCausalLM}


def tiny_zoo(arch: str, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = models.ZOO[arch].model_class(models.ZOO[arch].tiny(**overrides)).to(dtype).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped or missing norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def load_stock(directory, arch):
    # transformers' grouped_mm experts do not run in float64; "eager" is its per-expert loop.
    extra = {"experts_implementation": "eager"} if arch == "moe" else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, **extra).eval()


def export_case(case: str, tmp_path_factory):
    arch, overrides = CASES[case]
    zoo = tiny_zoo(arch, **overrides)
    return arch, zoo, export_stock(zoo, tmp_path_factory.mktemp(case) / "stock")


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    return export_case(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(c for c, (arch, _) in CASES.items() if arch == "moe"))
def exported_moe(request, tmp_path_factory):
    return export_case(request.param, tmp_path_factory)


def relative_gap(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_loads_as_the_stock_class_without_remote_code(exported):
    arch, _, out = exported
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["model_type"] == {"llama": "llama", "moe": "mixtral"}[arch]
    assert not list(out.glob("*.py"))
    stock = load_stock(out, arch)
    assert type(stock) is STOCK[arch]
    zoo_config = exported[1].config
    for name in ("rope_parameters", "rms_norm_eps", "tie_word_embeddings", "head_dim", "num_key_value_heads"):
        assert getattr(stock.config, name) == getattr(zoo_config, name), name
    if arch == "moe":
        for name in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"):
            assert getattr(stock.config, name) == getattr(zoo_config, name), name
        assert stock.config.sliding_window is None and stock.config.router_jitter_noise == 0


def test_weights_arrive_bit_for_bit(exported):
    arch, zoo, out = exported
    stock = load_stock(out, arch).state_dict()
    zoo_state = zoo.state_dict()
    expected = moe_state_to_mixtral(zoo_state) if arch == "moe" else zoo_state
    assert set(stock) == set(expected)
    for name, value in expected.items():
        assert torch.equal(stock[name], value), name


def test_logits_equal_as_shipped(exported):
    arch, zoo, out = exported
    with torch.no_grad():
        gap = relative_gap(load_stock(out, arch)(IDS).logits, zoo(IDS).logits)
    assert gap < SHIPPED_RTOL, gap


def fp64_rms_norm(self, hidden_states):
    """The stock RMSNorm's formula without its cast to fp32 (the zoo's RMSNorm keeps fp64)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_logits_equal_to_fp64_rounding_with_fp64_norms_and_rope_table(exported):
    """What the tolerance above allows for is the stock classes' fp32 steps, not the export: with them made
    fp64 llama agrees to fp64 rounding, and Mixtral within what its fp32 router leaves."""
    arch, zoo, out = exported
    stock = load_stock(out, arch)
    for module in stock.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(fp64_rms_norm, module)
    stock.model.rotary_emb.inv_freq.copy_(zoo.model.rotary_emb.inv_freq)
    with torch.no_grad():
        gap = relative_gap(stock(IDS).logits, zoo(IDS).logits)
    assert gap < (1e-12 if arch == "llama" else 1e-7), gap


def test_same_experts_chosen(exported_moe):
    arch, zoo, out = exported_moe
    stock = load_stock(out, arch)
    k = zoo.config.num_experts_per_tok
    found = []
    hooks = [m.register_forward_hook(lambda mod, a, o: found.append(o.expert_idx.view(-1, k)))
             for m in zoo.modules() if isinstance(m, TopKRouter)]
    with torch.no_grad():
        zoo(IDS)
        router_logits = stock(IDS, output_router_logits=True).router_logits
    for h in hooks:
        h.remove()
    assert len(found) == len(router_logits) == zoo.config.num_hidden_layers
    for ours, theirs in zip(found, router_logits, strict=True):
        stock_choice = theirs.float().softmax(-1).topk(k, dim=-1).indices
        assert torch.equal(ours.sort(-1).values, stock_choice.sort(-1).values)


def test_greedy_generation_identical(exported):
    arch, zoo, out = exported
    kwargs = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    prompt = IDS[:, :6]
    assert torch.equal(load_stock(out, arch).generate(prompt, **kwargs), zoo.generate(prompt, **kwargs))


def test_float32_export_stays_float32(tmp_path):
    zoo = tiny_zoo("moe", torch.float32, moe_layer_freq=1)
    stock = to_stock(zoo)
    assert type(stock) is MixtralForCausalLM and stock.dtype == torch.float32
    assert json.loads((export_stock(zoo, tmp_path).joinpath("config.json")).read_text())["dtype"] == "float32"


def test_export_files_follow_the_umask_and_carry_no_loading_options(tmp_path):
    # As save_checkpoint's (tests/test_bad_inputs_eval.py): safetensors writes 0600 and the tokenizer would keep
    # this machine's local_files_only.
    import os

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "train" / "tokenizer", local_files_only=True)
    zoo = tiny_zoo("llama", torch.float32)
    old = os.umask(0o022)
    try:
        out = export_stock(zoo, tmp_path / "stock", tokenizer=tokenizer)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert set(modes.values()) == {0o644}, modes
    assert "local_files_only" not in json.loads((out / "tokenizer_config.json").read_text())


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"moe_layer_freq": 1, "router_score_func": "sigmoid"}, "router_score_func='sigmoid'"),
        ({"moe_layer_freq": 1, "router_balance_bias": True}, "router_balance_bias=True"),
        ({"moe_layer_freq": 1, "capacity_factor": 1.25}, "capacity_factor=1.25"),
        ({"moe_layer_freq": 1, "attention_bias": True}, "attention_bias=True"),
    ],
)
def test_moe_that_mixtral_cannot_compute_refused(overrides, named):
    with pytest.raises(ValueError, match="MixtralForCausalLM cannot compute") as error:
        to_stock(tiny_zoo("moe", torch.float32, **overrides))
    assert named in str(error.value)


@pytest.mark.parametrize("arch", ["ladder", "kraken", "scmoe", "moepp", "linear"])
def test_other_architectures_refused(arch, tmp_path):
    model = tiny_zoo(arch, torch.float32)
    with pytest.raises(ValueError, match="cannot be exported: .*no transformers class computes"):
        export_stock(model, tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_gqla_exports_to_deepseek_v3_at_one_group_per_head(tmp_path):
    """gqla goes through models/gqla/stock.py (tested in full in tests/test_deepseek.py): here, that
    export_stock reaches it, and that a regrouped gqla is refused by its rule."""
    from transformers import DeepseekV3ForCausalLM

    zoo = tiny_zoo("gqla", num_kv_groups=4, kv_a_layernorm=True)
    stock = AutoModelForCausalLM.from_pretrained(export_stock(zoo, tmp_path / "stock")).eval()
    assert type(stock) is DeepseekV3ForCausalLM
    with torch.no_grad():
        assert relative_gap(stock(IDS).logits, zoo(IDS).logits) < SHIPPED_RTOL
    with pytest.raises(ValueError, match="num_kv_groups=2 with num_attention_heads=4"):
        to_stock(tiny_zoo("gqla", torch.float32))


def test_converter_reads_every_zoo_type():
    assert {e.config_class.model_type for e in models.ZOO.values()} <= set(ZOO_TYPES)
    assert models.get_converter("export_stock") is EXPORT_STOCK


def test_train_convert_export_stock(tmp_path):
    tokenizer = load_tokenizer()
    zoo = tiny_zoo("moe", torch.float32, moe_layer_freq=1, vocab_size=len(tokenizer))
    save_checkpoint(zoo, tokenizer, tmp_path / "zoo")
    overrides = ["converter=export_stock", f"source={tmp_path / 'zoo'}", "data.seq_len=32", "data.batch_size=4",
                 "evaluate.max_batches=2", f"paths.output_dir={tmp_path / 'run'}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        result = convert(compose("convert", overrides=overrides))
        with pytest.raises(ValueError, match="retrain.enabled=true: converter=export_stock"):
            convert(compose("convert", overrides=[*overrides, "retrain.enabled=true"]))
    assert result["class"] == "MixtralForCausalLM"
    val = result["val"]
    assert list(val) == ["zoo (source)", "stock, no retraining"]
    assert val["stock, no retraining"]["loss"] == pytest.approx(val["zoo (source)"]["loss"], rel=1e-5)
    out = Path(result["stock_dir"])
    assert not list(out.glob("*.py")) and (out / "tokenizer.json").is_file()
    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(stock) is MixtralForCausalLM
    ids = IDS % len(tokenizer)
    with torch.no_grad():
        assert relative_gap(stock(ids).logits, zoo(ids).logits) < 1e-5


def test_export_stock_of_a_stock_checkpoint_is_one_line_naming_what_it_reads(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    from train.convert import check_source

    MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                     num_experts_per_tok=1)).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(ValueError) as refused:
        check_source(tmp_path, models.get_converter("export_stock"), {})
    message = str(refused.value)
    assert "converts zoo llama / moe / gqla checkpoints to stock transformers class" in message
    assert "zoo_kraken" not in message and "converter=mixtral_to_moe" in message and "\n" not in message
