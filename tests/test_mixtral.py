"""Mixtral checkpoints into the zoo's `moe` (models/moe/convert.py `mixtral_to_moe`), against transformers' own
MixtralForCausalLM (tiny random models, nothing downloaded):

- both layouts on disk are read: the hub's per-expert `block_sparse_moe.experts.N.w1/w2/w3` (what
  `save_pretrained` writes) and transformers 5's fused `mlp.experts.gate_up_proj` (save_original_format=False);
- converted == Mixtral in float64: logits within 1e-6 relative (Mixtral's RMSNorm and RoPE table are fp32 and both routers
  score in fp32, so not fp64 rounding), the same experts chosen for every token in every layer, identical greedy generation;
- rope theta / llama3 scaling, norm eps, router settings, tied embeddings and dtype carried over;
- each feature the zoo cannot compute is refused by name (sliding window, jitter, dropout, activation, RoPE
  type, quantization), a non-Mixtral checkpoint too; the zoo's from_pretrained refuses a Mixtral checkpoint
  (with ignore_mismatched_sizes=True as well) and random router / expert tensors;
- `train.convert converter=mixtral_to_moe` writes a zoo moe that computes the Mixtral's function.
"""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM

import models
from models.common.moe import TopKRouter
from models.moe import ZooMoeForCausalLM
from models.moe.convert import check_mixtral_to_moe, mixtral_to_moe
from train.convert import convert
from train.data import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-6  # relative to the largest logit: Mixtral's fp32 norm / RoPE table, fp32 routers (models/moe/convert.py)
SHAPES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    experts_implementation="eager",  # transformers' grouped_mm experts do not run in float64
)
CASES = {
    # non-default theta and eps, so a setting left at the zoo's default shows
    "top2": dict(num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "top1-tied-llama3": dict(
        num_local_experts=3, num_experts_per_tok=1, tie_word_embeddings=True, router_aux_loss_coef=0.02,
        head_dim=24,  # not hidden_size / heads
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
}
IDS = torch.randint(0, SHAPES["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))


def tiny_mixtral(dtype=torch.float64, **overrides) -> MixtralForCausalLM:
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**{**SHAPES, **overrides})).to(dtype).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped or missing norm cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def mixtral(request, tmp_path_factory):
    """(MixtralForCausalLM float64, {layout: saved directory})."""
    model = tiny_mixtral(**CASES[request.param])
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "hub")  # transformers 5 writes the hub's per-expert layout by default
    model.save_pretrained(root / "fused", save_original_format=False)
    return model, {"hub": root / "hub", "fused": root / "fused"}


def weight_names(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_both_layouts_are_on_disk(mixtral):
    _, dirs = mixtral
    hub, fused = weight_names(dirs["hub"]), weight_names(dirs["fused"])
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in hub
    assert "model.layers.0.block_sparse_moe.gate.weight" in hub
    assert not any("gate_up_proj" in k for k in hub)
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= fused
    assert not any("block_sparse_moe" in k for k in fused)


def chosen_experts(model, ids) -> list[torch.Tensor]:
    """[tokens, k] expert ids (sorted) chosen in each MoE layer of a zoo moe or a Mixtral."""
    with torch.no_grad():
        if isinstance(model, MixtralForCausalLM):
            logits = model(ids, output_router_logits=True).router_logits
            k = model.config.num_experts_per_tok
            return [lg.float().softmax(-1).topk(k, dim=-1).indices.sort(-1).values for lg in logits]
        found = []
        hooks = [
            m.register_forward_hook(lambda mod, args, out: found.append(out.expert_idx.view(-1, mod.top_k)))
            for m in model.modules()
            if isinstance(m, TopKRouter)
        ]
        model(ids)
        for h in hooks:
            h.remove()
        return [e.sort(-1).values for e in found]


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_converted_equals_mixtral(mixtral, layout):
    hf, dirs = mixtral
    zoo = mixtral_to_moe(dirs[layout]).eval()
    assert type(zoo) is ZooMoeForCausalLM and zoo.dtype == torch.float64
    with torch.no_grad():
        gap = relative_gap(zoo(IDS).logits, hf(IDS).logits)
    assert gap < RTOL, gap
    zoo_experts, hf_experts = chosen_experts(zoo, IDS), chosen_experts(hf, IDS)
    assert len(zoo_experts) == len(hf_experts) == SHAPES["num_hidden_layers"]
    for layer, (a, b) in enumerate(zip(zoo_experts, hf_experts, strict=True)):
        assert torch.equal(a, b), f"layer {layer} routes differently"


def test_gap_is_mixtrals_fp32_steps_not_the_conversion(mixtral):
    """With Mixtral's RMSNorm and RoPE table made fp64 (a test-only patch of a copy), what is left is the two
    fp32 routers' rounding: within 1e-7."""
    import copy
    import types

    hf, dirs = mixtral
    zoo = mixtral_to_moe(dirs["hub"]).eval()
    patched = copy.deepcopy(hf)

    def fp64_rms_norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in patched.modules():
        if type(module).__name__ == "MixtralRMSNorm":
            module.forward = types.MethodType(fp64_rms_norm, module)
    patched.model.rotary_emb.inv_freq.copy_(zoo.model.rotary_emb.inv_freq)
    with torch.no_grad():
        gap = relative_gap(zoo(IDS).logits, patched(IDS).logits)
    assert gap < 1e-7, gap


def test_greedy_generation_identical(mixtral):
    hf, dirs = mixtral
    zoo = mixtral_to_moe(dirs["hub"]).eval()
    prompt = IDS[:, :6]
    kwargs = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    assert torch.equal(zoo.generate(prompt, **kwargs), hf.generate(prompt, **kwargs))


def test_settings_carried_over(mixtral):
    hf, dirs = mixtral
    zoo = mixtral_to_moe(dirs["hub"])
    source, c = hf.config, zoo.config
    assert c.rope_parameters == source.rope_parameters
    assert c.rms_norm_eps == source.rms_norm_eps
    assert (c.num_local_experts, c.num_experts_per_tok) == (source.num_local_experts, source.num_experts_per_tok)
    assert c.router_aux_loss_coef == source.router_aux_loss_coef
    assert c.tie_word_embeddings == source.tie_word_embeddings
    assert c.moe_layer_freq == 1 and c.capacity_factor is None and c.router_score_func == "softmax"
    assert c.head_dim == (source.head_dim or SHAPES["hidden_size"] // SHAPES["num_attention_heads"])
    assert c.router_aux_loss_style == "hf"
    # the option overrides the checkpoint's coefficient; fp32 files convert in fp32
    assert mixtral_to_moe(dirs["hub"], router_aux_loss_coef=0.05).config.router_aux_loss_coef == 0.05


def test_float32_checkpoint_converts_in_float32(tmp_path):
    hf = tiny_mixtral(torch.float32, num_local_experts=4)
    hf.save_pretrained(tmp_path)
    zoo = mixtral_to_moe(tmp_path).eval()
    assert zoo.dtype == torch.float32
    with torch.no_grad():
        assert relative_gap(zoo(IDS).logits, hf(IDS).logits) < 1e-5


REFUSED = {
    "sliding_window": (dict(sliding_window=16), "sliding_window=16"),
    "jitter": (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    "dropout": (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    "gelu": (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "yarn": (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}), "rope_type='yarn'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_feature_refused(tmp_path, case):
    overrides, named = REFUSED[case]
    MixtralConfig(**{**SHAPES, **overrides}).save_pretrained(tmp_path)  # the checks read config.json alone
    with pytest.raises(ValueError, match="cannot be converted to the zoo's moe exactly") as error:
        check_mixtral_to_moe(tmp_path)
    assert named in str(error.value)
    with pytest.raises(ValueError, match="cannot be converted"):
        mixtral_to_moe(tmp_path)


def test_quantized_or_unknown_config_key_refused(tmp_path):
    MixtralConfig(**SHAPES).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"\['quantization_config'\]"):
        check_mixtral_to_moe(tmp_path)


def test_non_mixtral_refused(tmp_path):
    models.build_model("llama", **models.TINY_LLAMA).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type='zoo_llama', not a Mixtral.*llama_to_moe"):
        mixtral_to_moe(tmp_path)


def test_zoo_from_pretrained_refuses_a_mixtral_checkpoint(mixtral):
    _, dirs = mixtral
    for kwargs in ({}, {"ignore_mismatched_sizes": True}):
        with pytest.raises(ValueError, match="is a Mixtral.*mixtral_to_moe"):
            ZooMoeForCausalLM.from_pretrained(dirs["hub"], **kwargs)


def test_ignore_mismatched_sizes_refuses_random_experts(tmp_path):
    """A dense checkpoint loaded into moe with ignore_mismatched_sizes=True: its routers and experts would stay
    random (the issue's logits off by 2.2); refused by name unless asked for."""
    models.build_model("llama", **models.TINY_LLAMA).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"lacks 16 router / expert tensors .*model\.layers\.0\.mlp\.router\.gate"):
        ZooMoeForCausalLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True)  # 4 layers x 4
    model = ZooMoeForCausalLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True, allow_random_experts=True)
    assert model.config.num_moe_layers == 4


def test_train_convert_mixtral_to_moe(tmp_path):
    tokenizer = load_tokenizer()
    hf = tiny_mixtral(torch.float32, num_local_experts=4, vocab_size=len(tokenizer))
    hf.save_pretrained(tmp_path / "mixtral")
    overrides = ["converter=mixtral_to_moe", f"source={tmp_path / 'mixtral'}", "data.seq_len=32",
                 "data.batch_size=4", "evaluate.max_batches=2", f"paths.output_dir={tmp_path / 'run'}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        result = convert(compose("convert", overrides=overrides))
        with pytest.raises(ValueError, match="num_local_experts=4: not an option of converter=mixtral_to_moe"):
            convert(compose("convert", overrides=[*overrides, "num_local_experts=4"]))
    assert result["title"] == "Mixtral -> MoE" and result["num_local_experts"] == 4
    # the conversion costs nothing on the bundled corpus: the same validation loss
    val = result["val"]
    assert list(val) == ["mixtral (source)", "moe, no retraining"]
    assert val["moe, no retraining"]["loss"] == pytest.approx(val["mixtral (source)"]["loss"], rel=1e-5)
    zoo = ZooMoeForCausalLM.from_pretrained(result["moe_dir"]).eval()
    ids = IDS % len(tokenizer)
    with torch.no_grad():
        assert relative_gap(zoo(ids).logits, hf(ids).logits) < 1e-5


# --- the balance loss: the zoo's convention and transformers' ("hf") ------------------------------------


def routed(logits: torch.Tensor, k: int):
    probs = logits.softmax(-1)
    return probs, probs.topk(k, dim=-1).indices.flatten()


@pytest.mark.parametrize("padded", [False, True])
def test_hf_style_equals_transformers_load_balancing_loss_func(padded):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from models.common.moe import balance_statistics, hf_load_balance_loss

    gen = torch.Generator().manual_seed(0)
    layers, batch, seq, experts, k = 3, 2, 10, 4, 2
    logits = [torch.randn(batch * seq, experts, generator=gen) for _ in range(layers)]
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[1, 6:] = 0
    stats = [balance_statistics(*routed(lg, k), experts, mask if padded else None) for lg in logits]
    ours = hf_load_balance_loss(stats, experts)
    theirs = load_balancing_loss_func(tuple(logits), experts, k, mask if padded else None)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    # and the zoo's per-layer convention is transformers' one-layer value / k (counts per assignment)
    from models.common.moe import load_balance_loss

    zoo = load_balance_loss(*routed(logits[0], k), experts)
    torch.testing.assert_close(k * zoo, load_balancing_loss_func((logits[0],), experts, k), rtol=1e-6, atol=0)


def test_converted_mixtral_trains_with_mixtrals_balance_loss(mixtral):
    """The converted model's training loss adds what MixtralForCausalLM adds: router_aux_loss_coef times
    transformers' loss over the real tokens (padding left out), pooled over the layers."""
    hf, dirs = mixtral
    zoo = mixtral_to_moe(dirs["hub"]).train()
    assert zoo.config.router_aux_loss_style == "hf"
    mask = torch.ones_like(IDS)
    mask[1, 30:] = 0  # right padding: the real tokens' routing is the same with or without it
    out = zoo(IDS, attention_mask=mask, labels=IDS)
    with torch.no_grad():
        reference = hf(IDS, attention_mask=mask, output_router_logits=True).aux_loss
    coef = hf.config.router_aux_loss_coef
    # transformers scores the router in fp32; the zoo in max(fp32, the model's dtype): float64 here
    loss = out.aux_losses["load_balance"].detach()
    torch.testing.assert_close(loss, coef * reference.to(loss.dtype), rtol=1e-5, atol=0)
    # the padding matters: without the mask the loss is another number
    unmasked = zoo(IDS, labels=IDS).aux_losses["load_balance"].detach()
    assert not torch.allclose(unmasked, out.aux_losses["load_balance"].detach(), rtol=1e-4, atol=0)
    # gradients reach the routers through it
    out.aux_losses["load_balance"].backward()
    assert all(m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0
               for m in zoo.modules() if isinstance(m, TopKRouter))


def test_zoo_style_stays_the_default_and_bad_style_refused():
    assert models.build_config("moe", **models.TINY_LLAMA).router_aux_loss_style == "zoo"
    with pytest.raises(ValueError, match="router_aux_loss_style='HF' must be one of"):
        models.build_config("moe", **models.TINY_LLAMA, router_aux_loss_style="HF")


def test_sharded_bf16_checkpoint(tmp_path):
    """A checkpoint in several files (as the hub's Mixtral-8x7B, 19 of them) and in bf16 (its dtype): read whole,
    kept in bf16."""
    hf = tiny_mixtral(torch.bfloat16, num_local_experts=4)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    zoo = mixtral_to_moe(tmp_path).eval()
    assert zoo.dtype == torch.bfloat16 and zoo.config.experts_impl == "grouped_mm"
    for name, value in zoo.state_dict().items():
        if name.endswith("experts.gate_proj"):
            gate_up = hf.state_dict()[name.replace("gate_proj", "gate_up_proj")]
            assert torch.equal(value, gate_up[:, : value.shape[1]])


def _hf_style_at_ep2(rank, world_size):
    import parallel
    from tests.test_ep import check_equivalence

    mesh = parallel.init_mesh(ep=2)
    # the whole check of tests/test_ep.py: logits, the balance loss (here pooled over layers and the ep ranks'
    # tokens), the LM loss and every gradient == one process on the concatenated batch
    check_equivalence(mesh, "moe", router_aux_loss_style="hf", router_aux_loss_coef=0.5)


def test_hf_style_at_ep2_equals_one_process():
    from tests.distributed import run_ranks

    run_ranks(_hf_style_at_ep2, 2)


def test_a_mixtral_field_the_converter_does_not_know_is_refused(tmp_path, monkeypatch):
    """A field a newer transformers adds to MixtralConfig is refused until the converter maps it (here
    simulated by forgetting head_dim)."""
    import models.moe.convert as convert_module

    monkeypatch.setattr(convert_module, "MIXTRAL_CARRIED", tuple(f for f in convert_module.MIXTRAL_CARRIED if f != "head_dim"))
    MixtralConfig(**SHAPES).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"MixtralConfig has fields \['head_dim'\] that mixtral_to_moe does not know"):
        check_mixtral_to_moe(tmp_path)


def test_ignore_mismatched_sizes_still_loads_a_complete_moe(tmp_path):
    model = models.build_model("moe", **models.TINY_LLAMA)
    model.save_pretrained(tmp_path)
    loaded = ZooMoeForCausalLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
