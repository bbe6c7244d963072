"""Ladder Residual: ladder_layers=0 is HF Llama; the model equals an independent two-stream reference
written from the spec; Llama checkpoints convert and round-trip through the Auto classes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import models
from models.ladder import ZooLadderConfig, ZooLadderForCausalLM

ATOL = 1e-5


def two_stream_reference(model: ZooLadderForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The spec's two-stream form: A = M = embedding; ladder layer: A' = M + Attn(LN1(A)),
    M' = A' + MLP(LN2(M)); a standard layer maps the full stream M to A = M = layer(M)."""
    inner = model.model
    x = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None]
    pe = inner.rotary_emb(x, positions)
    a_stream = m_stream = x
    for i, layer in enumerate(inner.layers):
        if i in model.config.laddered:
            attn = layer.self_attn(layer.input_layernorm(a_stream), pe, None, None)
            mlp = layer.mlp(layer.post_attention_layernorm(m_stream))
            a_stream = m_stream + attn
            m_stream = a_stream + mlp
        else:
            h = m_stream + layer.self_attn(layer.input_layernorm(m_stream), pe, None, None)
            a_stream = m_stream = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(m_stream))


@pytest.mark.parametrize("ladder_layers", [0, 2, 4, [1, 3], [0, 2, 3]])
def test_equals_two_stream_reference(ladder_layers):
    torch.manual_seed(0)
    model = ZooLadderForCausalLM(models.ZOO["ladder"].tiny(ladder_layers=ladder_layers)).eval()
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, two_stream_reference(model, ids), rtol=0, atol=ATOL)


def test_ladder_differs_from_llama_with_same_weights():
    torch.manual_seed(0)
    ladder = ZooLadderForCausalLM(models.ZOO["ladder"].tiny(ladder_layers=2)).eval()
    llama = models.ZOO["llama"].model_class(models.ZOO["llama"].tiny()).eval()
    llama.load_state_dict(ladder.state_dict())
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert not torch.allclose(ladder(ids).logits, llama(ids).logits, atol=1e-3)


@pytest.fixture
def hf_llama_dir(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
    )
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "llama")
    return hf, tmp_path / "llama"


def test_ladder_layers_zero_is_hf_llama(hf_llama_dir):
    hf, path = hf_llama_dir
    ladder = ZooLadderForCausalLM.from_pretrained(path, ladder_layers=0).eval()
    ids = torch.randint(0, 200, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(ladder(ids).logits, hf(ids).logits, rtol=0, atol=ATOL)


def test_llama_checkpoint_converts_and_round_trips_through_auto(hf_llama_dir, tmp_path):
    hf, path = hf_llama_dir
    ladder = ZooLadderForCausalLM.from_pretrained(path, ladder_layers=2).eval()
    assert ladder.config.model_type == "zoo_ladder"
    for (name, p), (hf_name, q) in zip(ladder.state_dict().items(), hf.state_dict().items(), strict=True):
        assert name == hf_name and torch.equal(p, q)
    ladder.save_pretrained(tmp_path / "ladder")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ladder").eval()
    assert type(reloaded) is ZooLadderForCausalLM and reloaded.config.ladder_layers == 2
    ids = torch.randint(0, 200, (1, 10))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ladder(ids).logits)


def test_llama_to_ladder_is_the_registered_converter(hf_llama_dir):
    # What `python -m train.convert` runs by default: the converter's own hooks, from models.CONVERTERS.
    _, path = hf_llama_dir
    converter = models.get_converter("llama_to_ladder")
    assert (converter.source, converter.target, converter.options) == ("llama", "ladder", ("ladder_layers",))
    assert {"llama", "zoo_llama"} <= set(converter.source_types)
    converter.check(path, ladder_layers=1)
    ladder = converter.convert(path, ladder_layers=1)
    assert type(ladder) is models.ZOO[converter.target].model_class
    assert converter.summary(ladder) == {"ladder_layers": 1, "num_hidden_layers": 4}
    with pytest.raises(ValueError, match=r"ladder_layers=5 is out of range; use 0\.\.4"):
        converter.check(path, ladder_layers=5)
    with pytest.raises(ValueError, match=r"Unknown converter 'nope'; the zoo has: .*llama_to_ladder"):
        models.get_converter("nope")


@pytest.mark.parametrize("bad", [5, -1, [4], [1, 1]])
def test_ladder_layers_out_of_range_is_one_clear_error(bad):
    with pytest.raises(ValueError, match=r"ladder_layers=.* (is out of range; use 0\.\.4|must list distinct layer indices in 0\.\.3)"):
        ZooLadderConfig(**{**models.TINY_LLAMA, "ladder_layers": bad})


def test_parallel_block_equals_formula():
    torch.manual_seed(0)
    model = models.ZOO["parallel"].model_class(models.ZOO["parallel"].tiny()).eval()
    ids = torch.randint(0, 256, (1, 8))
    inner = model.model
    x = inner.embed_tokens(ids)
    pe = inner.rotary_emb(x, torch.arange(8)[None])
    with torch.no_grad():
        for layer in inner.layers:
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, pe, None, None) + layer.mlp(h)
        torch.testing.assert_close(model(ids).logits, model.lm_head(inner.norm(x)), rtol=0, atol=ATOL)
