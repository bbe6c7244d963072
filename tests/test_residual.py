"""The ladder residual schedule as an architecture's config field (models/common/residual.py), for every architecture
that takes it (the registry's `<name>_ladder` variants; the harnesses test_models, test_tp, test_ep, test_static_cache,
test_fsdp and test_activation_checkpointing run each variant as an architecture of its own):

- `residual='ladder', ladder_layers=0` is the standard architecture exactly (logits, and the loss with the balance
  loss in training mode);
- every layer laddered equals an independent per-layer reference of the schedule's two equations (fp64 1e-10);
- TP 2 == one device in float64 (1e-10; the TP harness checks fp32 1e-5, the EP harness fp32 and float64);
- bad values are refused in one line, and so are the architectures that do not take the schedule, with why;
- `train.convert converter=<name>_to_ladder` keeps the weights and changes the schedule.
"""

from pathlib import Path

import pytest
import torch

import models
import parallel
from models.gqla.stock import check_exportable
from tests.distributed import run_ranks
from tests.test_tp import TP4, local_slice

LADDERED = [models.registry.standard_sibling(name) for name in models.variants()]
ROOT = Path(__file__).resolve().parents[1]


def build(name: str = "gqla", tp: int = 1, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    entry = models.get(name)
    shapes = TP4 if tp > 1 else {}
    return entry.model_class(entry.tiny_at({"tp": tp}, **shapes, **overrides)).to(dtype).eval()


def ids(batch=2, length=10, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_every_architecture_with_the_residual_field_has_a_ladder_variant():
    assert set(LADDERED) == {"gqla", "moe", "moepp", "linear", "linear_hybrid"}
    assert {c.name for c in models.CONVERTERS.values() if c.name.endswith("_to_ladder")} >= {
        "gqla_to_ladder", "moe_to_ladder", "moepp_to_ladder", "linear_to_ladder"}


@pytest.mark.parametrize("name", LADDERED)
def test_ladder_layers_0_is_the_standard_architecture_exactly(name):
    standard, ladder = build(name), build(name, residual="ladder", ladder_layers=0)
    ladder.load_state_dict(standard.state_dict())
    x = ids()
    assert torch.equal(ladder(x).logits, standard(x).logits)
    a, b = standard.train()(x, labels=x), ladder.train()(x, labels=x)
    assert torch.equal(a.loss, b.loss)  # an MoE's balance loss included
    assert build(name, residual="ladder").config.ladder_layers == models.get(name).tiny_config["num_hidden_layers"]


def _reference_run_layers(trunk):
    """The spec's two equations per laddered layer, written from the layer's modules (not models/common/residual):
    x = x + a_prev; a = Attn(LN1(x)); x = x + m_prev; m = MLP(LN2(x)); after the last layer x + a + m. An MoE
    layer's MLP is its experts' block (output, aux); MoE++'s also reads the previous layer's router logits."""

    def run_layers(hidden_states, position_embeddings, attention_mask, cache):
        x, a_prev, m_prev, logits = hidden_states, 0, 0, None
        for layer in trunk.layers:
            x = x + a_prev
            a_prev = layer.self_attn(layer.input_layernorm(x), position_embeddings, attention_mask, cache)
            x = x + m_prev
            h = layer.post_attention_layernorm(x)
            if layer.passes_down:  # MoE++: [T, d] rows, the router logits passed on
                out, logits, _ = layer.mlp(h.flatten(0, 1), logits)
                m_prev = out.view_as(h)
            elif getattr(layer, "is_moe", False):
                m_prev = layer.mlp(h)[0]
            else:
                m_prev = layer.mlp(h)
        return x + a_prev + m_prev

    return run_layers


PATHS = [("gqla", "absorb"), ("gqla", "gqa")] + [(name, None) for name in LADDERED if name != "gqla"]


@pytest.mark.parametrize(("name", "path"), PATHS, ids=[f"{n}-{p}" if p else n for n, p in PATHS])
def test_every_layer_laddered_equals_the_per_layer_reference(name, path):
    options = {"attn_path": path} if path else {}
    ladder = build(name, dtype=torch.float64, residual="ladder", **options)
    reference = build(name, dtype=torch.float64, **options)
    reference.load_state_dict(ladder.state_dict())
    reference.model.run_layers = _reference_run_layers(reference.model)
    x = ids()
    got, want = ladder(x).logits, reference(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # ... and it is a different function from the standard block's (the schedule changes what a layer reads)
    assert (got - build(name, dtype=torch.float64, **options)(x).logits).abs().max() > 1e-4


def _tp_float64(rank, world_size, names):
    mesh = parallel.init_mesh(tp=world_size)
    x = ids(length=12)
    for name in names:
        reference, sharded = build(name, world_size, torch.float64), build(name, world_size, torch.float64)
        parallel.parallelize(sharded, mesh)
        assert not sharded.model.runs_layers_whole  # FSDP units and AC regions are the sub-blocks' modules
        ref_logits, logits = reference(x).logits, sharded(x).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (ref_logits * weights).sum().backward()
        (logits * weights).sum().backward()
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
        ref_params = dict(reference.named_parameters())
        for pname, p in sharded.named_parameters():
            expected = local_slice(ref_params[pname].grad, p.grad, rank, world_size)
            torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-10, msg=lambda m, n=f"{name} {pname}": f"{n}: {m}")


def test_tp2_equals_one_device_in_float64_under_the_ladder_schedule():
    run_ranks(_tp_float64, 2, [v for v in models.variants() if "tp" in models.get(v).degrees])


def test_bad_values_and_the_stock_export_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"residual='lader' is not a residual schedule; use one of \['standard', 'ladder'\]"):
        build(residual="lader")
    with pytest.raises(ValueError, match=r"ladder_layers=2 is read only with residual='ladder'"):
        build(ladder_layers=2)
    with pytest.raises(ValueError, match=r"ladder_layers=9 is out of range; use 0\.\.4"):
        build(residual="ladder", ladder_layers=9)
    config = build(residual="ladder", kv_a_layernorm=True, rms_norm_eps=1e-6).config  # one group per head
    with pytest.raises(ValueError, match=r"residual='ladder': DeepSeek's layers add each sub-block's output at once"):
        check_exportable(config)
    with pytest.raises(ValueError, match=r"residual='ladder'"):  # Mixtral adds each sub-block's output at once
        models.to_stock(build("moe_ladder"))


def test_gqla_to_ladder_keeps_the_weights_and_changes_the_schedule(tmp_path):
    """`python -m train.convert converter=gqla_to_ladder source=DIR ladder_layers=2`: the converted checkpoint holds
    the source's weights bit for bit, states the schedule in config.json, and loads through the Auto classes."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM

    from models.checkpoint import save_checkpoint
    from train.convert import convert
    from train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    source = tmp_path / "gqla"
    save_checkpoint(build(vocab_size=len(tokenizer)), tokenizer, source)
    overrides = ["converter=gqla_to_ladder", f"source={source}", "ladder_layers=2", "data.seq_len=32",
                 "data.batch_size=4", "evaluate.max_batches=2", f"paths.output_dir={tmp_path / 'run'}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        result = convert(compose("convert", overrides=overrides))
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "gqla")
    assert (converted.config.residual, converted.config.ladder_layers) == ("ladder", 2)
    original = AutoModelForCausalLM.from_pretrained(source).state_dict()
    assert all(torch.equal(t, original[k]) for k, t in converted.state_dict().items())
    assert set(result["val"]) == {"gqla (source)", "gqla, no retraining"}
    assert result["residual"] == "ladder" and result["ladder_layers"] == 2
    with pytest.raises(ValueError, match=r"this conversion reads 'zoo_gqla'"):
        llama = tmp_path / "llama"
        save_checkpoint(models.build_model("llama", **models.TINY_LLAMA), tokenizer, llama)
        models.get_converter("gqla_to_ladder").convert(llama, ladder_layers=2)


@pytest.mark.parametrize("name", ["llama", "parallel", "ladder", "kraken", "scmoe"])
def test_architectures_without_the_schedule_refuse_it_and_say_why(name):
    why = models.get(name).config_class.residual_refusal
    assert len(why) > 40
    with pytest.raises(ValueError, match=r"has no field 'residual': it takes no other residual schedule\. " + why[:30]):
        models.get(name).tiny(residual="ladder")
    if name != "ladder":
        with pytest.raises(ValueError, match=rf"Unknown architecture '{name}_ladder': {name} takes no ladder residual"):
            models.get(f"{name}_ladder")


@pytest.mark.parametrize("name", [n for n in LADDERED if n not in ("gqla", "linear_hybrid")])
def test_to_ladder_converter_keeps_the_weights(name, tmp_path):
    """`<name>_to_ladder` on a saved standard checkpoint: the same tensors, the schedule set, the function that of
    a model built under the ladder schedule with those weights."""
    standard = build(name)
    standard.save_pretrained(tmp_path)
    converter = models.get_converter(f"{name}_to_ladder")
    converter.check(tmp_path, ladder_layers=2)
    converted = converter.convert(tmp_path, ladder_layers=2).eval()
    assert converter.summary(converted)["residual"] == "ladder" and converted.config.ladder_layers == 2
    assert all(torch.equal(t, standard.state_dict()[k]) for k, t in converted.state_dict().items())
    rebuilt = build(name, residual="ladder", ladder_layers=2)
    rebuilt.load_state_dict(standard.state_dict())
    x = ids()
    torch.testing.assert_close(converted(x).logits, rebuilt(x).logits, rtol=0, atol=0)



def test_a_variant_name_builds_the_variant():
    """`build_config` / `build_model` of `<name>_ladder` give the ladder schedule (every layer unless told),
    not the standard sibling's config; a standard residual under a variant's name is refused."""
    config = models.build_config("moe_ladder", **models.get("moe").tiny_config)
    assert config.residual == "ladder" and config.ladder_layers == config.num_hidden_layers  # every layer
    assert models.build_config("linear_ladder", **models.get("linear").tiny_config).residual == "ladder"
    assert models.build_model("gqla_ladder", **models.get("gqla").tiny_config).config.residual == "ladder"
    with pytest.raises(ValueError, match=r"moe_ladder is moe under the ladder residual schedule.*model\.config\.residual=ladder"):
        models.build_config("moe_ladder", residual="standard")


def test_to_ladder_refuses_a_source_already_under_the_ladder_schedule(tmp_path):
    build("moe", residual="ladder", ladder_layers=2).save_pretrained(tmp_path)
    converter = models.get_converter("moe_to_ladder")
    with pytest.raises(ValueError, match=r"is already under the ladder residual schedule \(ladder_layers=2\)"):
        converter.check(tmp_path, ladder_layers=0)
