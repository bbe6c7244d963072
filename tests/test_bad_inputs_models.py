"""Issue 31's model-side cases (a new user's sweep of bad inputs), each now clear, refused or as documented:

- A Ladder model with the config's defaults is laddered: `ladder_layers` defaults to every layer (the paper's
  Ladder Transformer), resolved to `num_hidden_layers` so config.json states it; explicit values (0 = Llama
  exactly, 2, a list) and saved config.json files load as before.
- `generate()` with an attention_mask whose length differs from the prompt's (longer: it generated without a
  word; shorter: it failed inside the rotary embedding) is one ValueError naming both shapes, before any forward.
- HF's fast-generation recipe (`model.forward = torch.compile(model.forward, fullgraph=True)`, then
  `generate(..., cache_implementation="static")`) on the MoE family without `set_moe_dispatch("padded")`:
  the traced forward takes the padded dispatch with C = the rank's tokens (nothing dropped), so the tokens equal
  eager dropless generation; eager forwards keep the dropless dispatch.
"""

import json

import pytest
import torch

import models
from models.ladder import ZooLadderConfig, ZooLadderForCausalLM
from tests.test_models import tiny_model, tokens

# --- the Ladder default ------------------------------------------------------------------------------


def test_ladder_config_default_ladders_every_layer():
    config = ZooLadderConfig()
    assert config.ladder_layers == config.num_hidden_layers
    assert config.laddered == frozenset(range(config.num_hidden_layers))
    assert ZooLadderConfig(num_hidden_layers=3, ladder_layers=None).ladder_layers == 3


def test_build_model_without_ladder_layers_is_laddered_and_says_so(tmp_path):
    model = models.build_model("ladder", **models.TINY_LLAMA).eval()
    assert model.config.ladder_layers == 4 and model.config.laddered == frozenset(range(4))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["ladder_layers"] == 4
    llama = models.build_model("llama", **models.TINY_LLAMA).eval()
    llama.load_state_dict(model.state_dict())
    ids = tokens(1, 9, 256)
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, llama(ids).logits, atol=1e-3)


def test_explicit_zero_is_llama_exactly_and_saved_values_load_as_saved(tmp_path):
    zero = models.build_model("ladder", **models.TINY_LLAMA, ladder_layers=0).eval()
    llama = models.build_model("llama", **models.TINY_LLAMA).eval()
    llama.load_state_dict(zero.state_dict())
    ids = tokens(2, 9, 256)
    with torch.no_grad():
        assert torch.equal(zero(ids).logits, llama(ids).logits)
    for value in (0, 2, [1, 3]):
        models.build_model("ladder", **models.TINY_LLAMA, ladder_layers=value).save_pretrained(tmp_path / str(value))
        reloaded = ZooLadderForCausalLM.from_pretrained(tmp_path / str(value))
        assert reloaded.config.ladder_layers == value
        assert models.ZooLadderConfig.from_pretrained(tmp_path / str(value)).ladder_layers == value


def test_llama_checkpoint_read_as_ladder_without_ladder_layers_ladders_every_layer(tmp_path):
    models.build_model("llama", **models.TINY_LLAMA).save_pretrained(tmp_path)
    assert ZooLadderForCausalLM.from_pretrained(tmp_path).config.ladder_layers == 4
    assert ZooLadderForCausalLM.from_pretrained(tmp_path, ladder_layers=1).config.ladder_layers == 1


def test_conversion_still_states_how_many():
    converter = models.get_converter("llama_to_ladder")
    assert converter.options == ("ladder_layers",)


# --- generate()'s attention_mask -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "moe"])
@pytest.mark.parametrize("ids_len", [5, 10])
def test_generate_refuses_a_mask_of_another_length_before_any_forward(name, ids_len, monkeypatch):
    model = tiny_model(name)
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    ids = tokens(1, ids_len, model.config.vocab_size)
    mask = torch.ones(1, 7, dtype=torch.long)
    want = rf"attention_mask has shape \(1, 7\) but input_ids has shape \(1, {ids_len}\): generate\(\) needs .* \(1, {ids_len}\)"
    with pytest.raises(ValueError, match=want):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=want):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert calls == []


def test_generate_refuses_a_mask_of_another_batch():
    model = tiny_model("llama")
    ids = tokens(2, 5, model.config.vocab_size)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\) but input_ids has shape \(2, 5\)"):
        model.generate(ids, attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=2, do_sample=False)


def test_generate_with_a_fitting_mask_is_unchanged():
    model = tiny_model("llama")
    ids = tokens(2, 5, model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 8) and torch.equal(out[:, :5], ids)
