"""The ladder residual schedule as an architecture's config field (models/common/residual.py), on GQLA.

- `residual='ladder', ladder_layers=0` is the standard architecture exactly;
- every layer laddered equals an independent per-layer reference of the schedule's two equations (fp64);
- cached decode == the full forward (both GQLA decode paths);
- TP 2 == TP 1 under the ladder schedule: logits, every gradient, cached decode (fp32 atol 1e-5);
- bad values and the stock export are refused in one line;
- `train.convert converter=gqla_to_ladder` keeps the weights and changes the schedule.
"""

import math
from pathlib import Path

import pytest
import torch

import models
import parallel
from models.gqla.stock import check_exportable
from tests.distributed import run_ranks
from tests.test_tp import TP4, local_slice

ENTRY = models.ZOO["gqla"]
ROOT = Path(__file__).resolve().parents[1]


def build(tp: int = 1, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    return ENTRY.model_class(ENTRY.tiny_at({"tp": tp}, **TP4, **overrides)).to(dtype).eval()


def ids(batch=2, length=10, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decoded_in_steps(model, x, prompt: int = 7) -> torch.Tensor:
    """Logits of a prefill of `prompt` tokens, then one cached decode step per remaining token, concatenated."""
    step = model(x[:, :prompt], use_cache=True)
    pieces, cache = [step.logits], step.cache
    for t in range(prompt, x.shape[1]):
        step = model(x[:, t : t + 1], cache=cache, use_cache=True)
        pieces.append(step.logits)
    return torch.cat(pieces, 1)


def test_ladder_layers_0_is_the_standard_architecture_exactly():
    standard, ladder = build(), build(residual="ladder", ladder_layers=0)
    ladder.load_state_dict(standard.state_dict())
    x = ids()
    assert torch.equal(ladder(x).logits, standard(x).logits)
    assert build(residual="ladder").config.ladder_layers == ENTRY.tiny_config["num_hidden_layers"]


def _reference_run_layers(trunk):
    """The spec's two equations per laddered layer, written from the layer's modules (not models/common/residual):
    x = x + a_prev; a = Attn(LN1(x)); x = x + m_prev; m = MLP(LN2(x)); after the last layer x + a + m."""

    def run_layers(hidden_states, position_embeddings, attention_mask, cache):
        x, a_prev, m_prev = hidden_states, 0, 0
        for layer in trunk.layers:
            x = x + a_prev
            a_prev = layer.self_attn(layer.input_layernorm(x), position_embeddings, attention_mask, cache)
            x = x + m_prev
            m_prev = layer.mlp(layer.post_attention_layernorm(x))
        return x + a_prev + m_prev

    return run_layers


@pytest.mark.parametrize("path", ["absorb", "gqa"])
def test_every_layer_laddered_equals_the_per_layer_reference(path):
    ladder = build(dtype=torch.float64, residual="ladder", attn_path=path)
    reference = build(dtype=torch.float64, attn_path=path)
    reference.load_state_dict(ladder.state_dict())
    reference.model.run_layers = _reference_run_layers(reference.model)
    x = ids()
    got, want = ladder(x).logits, reference(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # ... and it is a different function from the standard block's (the schedule changes what a layer reads)
    assert (got - build(dtype=torch.float64, attn_path=path)(x).logits).abs().max() > 1e-4


@pytest.mark.parametrize("path", ["absorb", "gqa"])
def test_cached_decode_equals_the_full_forward(path):
    model, x = build(residual="ladder", ladder_layers=2, attn_path=path), ids(length=12)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
    torch.testing.assert_close(decoded_in_steps(model, x), full, rtol=0, atol=1e-5)


def _tp_equals_one_device(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    x = ids(length=12)
    for ladder_layers in (None, 2):
        options = dict(residual="ladder", ladder_layers=ladder_layers, attn_path="gqa")
        reference, sharded = build(world_size, **options), build(world_size, **options)
        parallel.parallelize(sharded, mesh)
        assert not sharded.model.runs_layers_whole  # FSDP units and AC regions are the sub-blocks' modules
        ref_out, out = reference(x, labels=x), sharded(x, labels=x)
        ref_out.loss.backward()
        out.loss.backward()
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=1e-5)
        ref_params = dict(reference.named_parameters())
        for name, p in sharded.named_parameters():
            expected = local_slice(ref_params[name].grad, p.grad, rank, world_size)
            torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        with torch.no_grad():
            full = reference(x, use_cache=False).logits
        torch.testing.assert_close(decoded_in_steps(sharded, x), full, rtol=0, atol=1e-5)


def test_tp2_equals_one_device_under_the_ladder_schedule():
    run_ranks(_tp_equals_one_device, 2)


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


# --- the ladder schedule on an MoE: the combine all-to-all of layer i's experts waited after layer i+1's attention


MOE = models.ZOO["moe"]


def build_moe(degrees=None, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    return MOE.model_class(MOE.tiny_at(degrees or {}, **overrides)).to(dtype)


def _moe_reference_run_layers(trunk):
    """The two equations per laddered layer, an MoE layer's MLP being its experts' block (not residual.py)."""

    def run_layers(hidden_states, position_embeddings, attention_mask, cache):
        x, a_prev, m_prev = hidden_states, 0, 0
        for layer in trunk.layers:
            x = x + a_prev
            a_prev = layer.self_attn(layer.input_layernorm(x), position_embeddings, attention_mask, cache)
            x = x + m_prev
            h = layer.post_attention_layernorm(x)
            m_prev = layer.mlp(h)[0] if layer.is_moe else layer.mlp(h)
        return x + a_prev + m_prev

    return run_layers


def test_moe_ladder_layers_0_is_moe_exactly_and_every_layer_is_the_reference():
    x = ids()
    standard, none_laddered = build_moe(), build_moe(residual="ladder", ladder_layers=0)
    none_laddered.load_state_dict(standard.state_dict())
    a, b = standard.train()(x, labels=x), none_laddered.train()(x, labels=x)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)  # the balance loss included

    ladder = build_moe(dtype=torch.float64, residual="ladder").eval()
    reference = build_moe(dtype=torch.float64).eval()
    reference.load_state_dict(ladder.state_dict())
    reference.model.run_layers = _moe_reference_run_layers(reference.model)
    torch.testing.assert_close(ladder(x).logits, reference(x).logits, rtol=0, atol=1e-10)


def test_moe_ladder_cached_decode_equals_the_full_forward():
    model, x = build_moe(residual="ladder", ladder_layers=2).eval(), ids(length=12)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
    torch.testing.assert_close(decoded_in_steps(model, x), full, rtol=0, atol=1e-5)


def _moe_ladder_sharded(rank, world_size, degrees):
    from tests.test_ep import check_equivalence

    mesh = parallel.init_mesh(**degrees)
    for ladder_layers in (None, 1):
        check_equivalence(mesh, "moe", residual="ladder", ladder_layers=ladder_layers, router_aux_loss_coef=0.5)
    check_equivalence(mesh, "moe", dtype=torch.float64, residual="ladder")


@pytest.mark.parametrize("degrees", [{"ep": 2}, {"ep": 2, "tp": 2}], ids=["ep2", "ep2xtp2"])
def test_moe_ladder_sharded_equals_one_process(degrees):
    """EP 2 and EP 2 x TP 2 == one process on the whole batch: logits, loss with the balance loss, every gradient
    (fp32 atol 1e-5; float64 1e-10), tests/test_ep.py's check with the ladder schedule."""
    run_ranks(_moe_ladder_sharded, math.prod(degrees.values()), degrees)
