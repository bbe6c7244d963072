"""Sparse upcycling: dense Llama -> `moe` / `scmoe` (models/moe/convert.py, models/scmoe/convert.py).

- the upcycled `moe` computes the dense model's function at initialisation (every expert the dense MLP,
  renormalised top-k gates summing to 1): logits equal in fp32 (atol 1e-5) for an HF Llama and a zoo
  llama, every layer or every other layer MoE, top-1 / top-2 / top-3; in training mode its LM loss is the
  dense loss;
- the upcycled `scmoe` maps every weight where its module doc says (shared and routed experts copies of
  the layer's MLP, the shortcut's norm the layer's post-attention norm, W_cg zero, dense blocks unchanged),
  and is NOT the dense model (its routed experts read the preceding block);
- both converters are registered and run through `train.convert` (validation before / right after /
  after 2 retraining steps), their options read from conf/convert.yaml's top-level keys;
- bad options and sources are one clear error each, before anything is loaded or written.
"""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import LlamaConfig, LlamaForCausalLM

import models
from models.checkpoint import save_checkpoint
from models.llama import ZooLlamaForCausalLM
from models.moe.convert import llama_to_moe, upcycle_to_moe
from models.scmoe.convert import llama_to_scmoe
from train.convert import convert
from train.data import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, models.TINY_LLAMA["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
PROJS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Saved tiny dense checkpoints: an HF LlamaForCausalLM, a zoo llama, a zoo ladder, a llama with MLP
    biases, one with 3 layers and one whose MLP width does not fit grouped_mm."""
    root = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**models.TINY_LLAMA)).save_pretrained(root / "hf_llama")
    for name, overrides in {
        "llama": {},
        "ladder": {},
        "mlp_bias": {"mlp_bias": True},
        "three_layers": {"num_hidden_layers": 3},
        "odd_width": {"intermediate_size": 100},
    }.items():
        arch = "ladder" if name == "ladder" else "llama"
        models.ZOO[arch].model_class(models.ZOO[arch].tiny(**overrides)).save_pretrained(root / name)
    return root


def dense_logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return ZooLlamaForCausalLM.from_pretrained(path).eval()(IDS).logits


# --- moe: the dense model's function --------------------------------------------------------------------


@pytest.mark.parametrize("source", ["hf_llama", "llama"])
@pytest.mark.parametrize(("freq", "top_k"), [(1, 2), (2, 2), (1, 1), (2, 3)])
def test_upcycled_moe_equals_the_dense_model(sources, source, freq, top_k):
    model = llama_to_moe(sources / source, num_local_experts=4, num_experts_per_tok=top_k, moe_layer_freq=freq)
    assert type(model) is models.ZooMoeForCausalLM
    assert model.config.num_moe_layers == 4 // freq
    with torch.no_grad():
        logits = model.eval()(IDS).logits
    torch.testing.assert_close(logits, dense_logits(sources / source), rtol=0, atol=1e-5)


def test_upcycled_moe_weights_and_training_loss(sources):
    dense = ZooLlamaForCausalLM.from_pretrained(sources / "llama")
    torch.manual_seed(3)
    config = models.build_config("moe", **{**dense.config.to_dict(), "num_local_experts": 4, "moe_layer_freq": 2})
    model = upcycle_to_moe(dense, config)
    moe_state, dense_state = model.state_dict(), dense.state_dict()
    for i in range(4):
        if config.is_moe_layer(i):
            for proj in PROJS:
                stacked = moe_state[f"model.layers.{i}.mlp.experts.{proj}"]
                assert stacked.shape[0] == 4
                for e in range(4):
                    assert torch.equal(stacked[e], dense_state[f"model.layers.{i}.mlp.{proj}.weight"])
            # a fresh router from the model's init, not zeros (zeros would send every token to the same experts)
            router = moe_state[f"model.layers.{i}.mlp.router.gate.weight"]
            assert router.shape == (4, config.hidden_size) and 0.01 < router.std() < 0.03
        else:
            for proj in PROJS:
                name = f"model.layers.{i}.mlp.{proj}.weight"
                assert torch.equal(moe_state[name], dense_state[name])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert torch.equal(moe_state[name], dense_state[name])
    # In training mode the loss adds the balance loss; its language-model part is the dense model's loss.
    dense_loss = dense.eval()(IDS, labels=IDS).loss
    out = model.train()(IDS, labels=IDS)
    torch.testing.assert_close(out.lm_loss, dense_loss, rtol=0, atol=1e-5)
    assert set(out.aux_losses) == {"load_balance"} and out.loss > out.lm_loss


# --- scmoe: where every weight goes; not the dense model -------------------------------------------------


@pytest.mark.parametrize("position", [2, 1])
def test_upcycled_scmoe_maps_every_weight(sources, position):
    dense_state = ZooLlamaForCausalLM.from_pretrained(sources / "llama").state_dict()
    model = llama_to_scmoe(sources / "llama", num_local_experts=4, shortcut_position=position)
    state, config = model.state_dict(), model.config
    assert config.shared_expert_intermediate_size == config.intermediate_size
    for i in range(4):
        layer = f"model.layers.{i}"
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"):
            assert torch.equal(state[f"{layer}.{name}"], dense_state[f"{layer}.{name}"])
        if not config.is_moe_layer(i):
            assert position == 2 and i % 2 == 0
            for proj in PROJS:
                assert torch.equal(state[f"{layer}.mlp.{proj}.weight"], dense_state[f"{layer}.mlp.{proj}.weight"])
            continue
        for proj in PROJS:
            mlp = dense_state[f"{layer}.mlp.{proj}.weight"]
            assert torch.equal(state[f"{layer}.shared_expert.{proj}.weight"], mlp)
            assert all(torch.equal(expert, mlp) for expert in state[f"{layer}.mlp.experts.{proj}"])
        assert torch.equal(state[f"{layer}.shortcut_layernorm.weight"], dense_state[f"{layer}.post_attention_layernorm.weight"])
        assert torch.equal(state[f"{layer}.shared_expert_gate.weight"], torch.zeros(1, config.hidden_size))
    # The routed experts read the preceding block (Position 2) or the layer's input (Position 1), and the
    # shared expert is gated by 1/2: not the dense model's function, but near it.
    with torch.no_grad():
        logits = model.eval()(IDS).logits
    reference = dense_logits(sources / "llama")
    gap = (logits - reference).abs().max()
    assert 1e-4 < gap < 0.5 * reference.abs().max()


# --- the converters through train.convert --------------------------------------------------------------


def compose_convert(overrides: list[str], output_dir: Path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("convert", overrides=[*overrides, f"paths.output_dir={output_dir}"])


def run_convert(overrides: list[str], output_dir: Path) -> dict:
    """`python -m train.convert <overrides>` in this process (retraining composes pretrain's config: Hydra
    must be initialised, as it is under the app)."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return convert(compose("convert", overrides=[*overrides, f"paths.output_dir={output_dir}"]))


def test_converters_are_registered():
    for name, target, options in (
        ("llama_to_moe", "moe", {"num_local_experts", "num_experts_per_tok", "moe_layer_freq"}),
        ("llama_to_scmoe", "scmoe", {"num_local_experts", "num_experts_per_tok", "shortcut_position"}),
    ):
        converter = models.get_converter(name)
        assert converter.target == target and options <= set(converter.options)
        assert set(converter.source_types) == {"llama", "zoo_llama"}
    # every converter's options are keys of conf/convert.yaml: `num_local_experts=4` needs no `+`
    cfg = compose_convert(["source=x"], Path("/unused"))
    assert {o for c in models.CONVERTERS.values() for o in c.options} <= set(cfg)


@pytest.fixture(scope="module")
def trained_size_llama(tmp_path_factory):
    """A tiny zoo llama with the bundled tokenizer's vocabulary, saved with it (what train.pretrain writes)."""
    out = tmp_path_factory.mktemp("llama") / "hf"
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    save_checkpoint(models.build_model("llama", **{**models.TINY_LLAMA, "vocab_size": len(tokenizer)}), tokenizer, out)
    return out


RUN = ["data.seq_len=32", "data.batch_size=4", "evaluate.max_batches=2"]
RETRAIN = [
    "trainer.max_steps=2", "trainer.limit_val_batches=2", "trainer.val_check_interval=2", "data.seq_len=32",
    "data.batch_size=4", "logger=none", "callbacks=none", "optimizer.warmup_steps=1",
]


def test_train_convert_upcycles_to_moe_and_retrains(trained_size_llama, tmp_path):
    retrain = "retrain.overrides=[" + ",".join(f"'{o}'" for o in RETRAIN) + "]"
    result = run_convert(
        ["converter=llama_to_moe", f"source={trained_size_llama}", "num_local_experts=4", "moe_layer_freq=2",
         *RUN, "retrain.enabled=true", retrain],
        tmp_path,
    )
    val = result["val"]
    assert list(val) == ["llama (source)", "moe, no retraining", "moe, retrained"]
    # Upcycling keeps the function: no jump (the order of the sums differs, nothing else).
    assert val["moe, no retraining"]["loss"] == pytest.approx(val["llama (source)"]["loss"], rel=1e-5)
    assert result["num_local_experts"] == 4 and result["num_moe_layers"] == 2
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["model_type"] == "zoo_moe" and config["num_local_experts"] == 4 and config["moe_layer_freq"] == 2
    assert result["retrain"]["global_step"] == 2
    assert "Llama -> MoE conversion (num_local_experts=4" in (tmp_path / "conversion.md").read_text()


def test_train_convert_upcycles_to_scmoe(trained_size_llama, tmp_path):
    scmoe = ["converter=llama_to_scmoe", f"source={trained_size_llama}", "num_local_experts=2", *RUN]
    result = run_convert(scmoe, tmp_path)
    assert list(result["val"]) == ["llama (source)", "scmoe, no retraining"]
    assert result["num_local_experts"] == 2 and result["shortcut_position"] == 2
    # the same seed, the same fresh routers
    again = run_convert([*scmoe, "evaluate.enabled=false"], tmp_path / "again")
    first = models.ZooScMoeForCausalLM.from_pretrained(result["scmoe_dir"]).state_dict()
    second = models.ZooScMoeForCausalLM.from_pretrained(again["scmoe_dir"]).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


# --- bad input: one clear error, before anything is loaded or written -----------------------------------


@pytest.mark.parametrize(
    ("source", "overrides", "error", "message"),
    [
        ("llama", ["converter=llama_to_moe", "num_local_experts=2", "num_experts_per_tok=3"], ValueError,
         r"cannot be upcycled to moe with num_local_experts=2, num_experts_per_tok=3: num_experts_per_tok=3 "
         r"experts per token does not fit 2 experts; choose top-k in 1\.\.2"),
        ("llama", ["converter=llama_to_moe", "num_local_experts=0"], ValueError,
         r"The number of experts must be a positive integer, got 0"),
        ("llama", ["converter=llama_to_moe", "moe_layer_freq=5"], ValueError,
         r"moe_layer_freq=5 must be an integer in 1\.\.num_hidden_layers=4"),
        ("odd_width", ["converter=llama_to_moe"], ValueError,
         r"intermediate_size=100 do not fit grouped_mm.*use intermediate_size 96 or 104"),
        ("mlp_bias", ["converter=llama_to_moe"], ValueError,
         r"has mlp_bias=True, but the experts have no biases"),
        ("three_layers", ["converter=llama_to_scmoe"], ValueError,
         r"cannot be upcycled to scmoe with the default options: num_hidden_layers=3 is odd.*shortcut_position=1"),
        ("llama", ["converter=llama_to_scmoe", "shortcut_position=3"], ValueError,
         r"shortcut_position=3 must be 1 .* or 2"),
        ("ladder", ["converter=llama_to_moe"], ValueError,
         r"model_type='zoo_ladder', not a Llama; train\.convert converts Llama checkpoints to MoE"),
        ("llama", ["converter=llama_to_ladder", "num_local_experts=4", "ladder_layers=1"], ValueError,
         r"num_local_experts=4: not an option of converter=llama_to_ladder, which takes: ladder_layers; .*"
         r"\(llama_to_moe, llama_to_scmoe\)"),
        ("llama", ["converter=llama_to_scmoe", "moe_layer_freq=2"], ValueError,
         r"moe_layer_freq=2: not an option of converter=llama_to_scmoe.*\(llama_to_moe\)"),
        ("llama", [], ValueError, r"converter=llama_to_ladder needs ladder_layers=\.\.\.; its options: ladder_layers"),
    ],
    ids=["top-k", "no-experts", "freq", "odd-width", "mlp-bias", "odd-layers", "position", "ladder-source",
         "stray-option", "other-converter-option", "missing-ladder_layers"],
)
def test_bad_upcycling_input_is_one_clear_error(sources, tmp_path, source, overrides, error, message):
    with pytest.raises(error, match=message):
        run_convert([f"source={sources / source}", "evaluate.enabled=false", *overrides], tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written
