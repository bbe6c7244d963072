"""Model-side bad inputs (a new user's sweep), each now clear, refused or as documented:

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
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import models
import models.common.moe as moe_module
import models.moepp.modeling as moepp_modeling
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


# --- HF's compile recipe on the MoE family ----------------------------------------------------------------

# aot_eager for moe (functionalization too); dynamo alone for the other two (the failure was dynamo's), to
# keep each case a few seconds. tests/test_static_cache.py compiles every architecture under -m slow.
MOE_BACKENDS = {"moe": "aot_eager", "scmoe": "eager", "moepp": "eager"}


def _count_padded(monkeypatch) -> list:
    """Calls of the padded dispatch, from SparseMoE (moe, scmoe) and MoE++'s layer alike."""
    calls = []
    for module in (moe_module, moepp_modeling):
        real = module.dispatch_padded

        def counted(*args, _real=real, **kwargs):
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "dispatch_padded", counted)
    return calls


@pytest.mark.parametrize("name", sorted(MOE_BACKENDS))
def test_compiled_static_generate_equals_eager_dropless(name, monkeypatch):
    model = tiny_model(name).float()
    assert model.config.moe_dispatch == "dropless"
    ids = tokens(2, 5, model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    padded_calls = _count_padded(monkeypatch)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert padded_calls == []  # the eager path is unchanged: dropless
    monkeypatch.undo()  # (a counter in the traced code would be a guard: a recompile per step)
    dynamo.reset()
    counter = CompileCounterWithBackend(MOE_BACKENDS[name])
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(out, want), name
    assert counter.frame_count == 2  # one graph for the prefill, one for every decode step
    # It traced with fullgraph=True, which the dropless dispatch cannot (it reads its counts on the host): the
    # padded one ran, with C = the tokens per rank, so nothing was dropped.
    assert model.dropped_assignments() == 0
    # The choice is the traced forward's alone: the model and its config still say dropless.
    assert model.config.moe_dispatch == "dropless"
    assert {b.moe_dispatch for b in moe_module.dispatching_blocks(model)} == {"dropless"}


def test_dispatch_choice_only_under_compile_without_grad(monkeypatch):
    block = moe_module.dispatching_blocks(tiny_model("moe"))[0]
    assert moe_module.dispatch_now(block) == ("dropless", None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert moe_module.dispatch_now(block) == ("dropless", None)  # grad on: a training step keeps its dispatch
    with torch.no_grad():
        assert moe_module.dispatch_now(block) == ("padded", None)
        block.moe_dispatch, block.dispatch_capacity_factor = "padded", 0.5
        assert moe_module.dispatch_now(block) == ("padded", 0.5)  # an explicit padded choice is kept


def test_compiled_generate_over_an_ep_group_names_set_moe_dispatch(monkeypatch):
    model = tiny_model("moe")
    monkeypatch.setattr(moe_module, "_group_size", lambda group: 1 if group is None else 2)
    for block in moe_module.dispatching_blocks(model):
        block.ep_group = object()  # a stand-in for an expert-parallel group of 2
    calls = []
    real_forward = model.forward
    model.forward = torch.compile(lambda *a, **k: calls.append(1) or real_forward(*a, **k), fullgraph=True)
    ids = tokens(1, 5, model.config.vocab_size)
    with pytest.raises(ValueError, match=r"call model\.set_moe_dispatch\(\"padded\"\) before compiling"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static")
    assert calls == []
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"model\.set_moe_dispatch\(\"padded\"\)"):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        moe_module.dispatch_now(moe_module.dispatching_blocks(model)[0])
