"""The dense baseline is Hugging Face Llama: same weights give the same logits (fp32, atol 1e-5),
for a full forward and for cached greedy generation, and checkpoints load both ways unchanged."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models.common import rope_inv_freq
from models.llama import ZooLlamaConfig, ZooLlamaForCausalLM

ATOL = 1e-5

SHAPES = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "mha": dict(num_key_value_heads=8),
    "gqa-llama3-rope": dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    "mqa-tied-bias": dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True),
}


@pytest.fixture(params=sorted(CASES))
def hf_checkpoint(request, tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES, **CASES[request.param])
    hf = LlamaForCausalLM(config).eval()
    # Non-trivial norm weights, so a swapped or missing norm cannot pass unnoticed.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    hf.save_pretrained(tmp_path)
    return hf, tmp_path


def test_full_forward_matches_hf(hf_checkpoint):
    hf, path = hf_checkpoint
    zoo = ZooLlamaForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, SHAPES["vocab_size"], (2, 48))  # longer than the llama3 original context
    with torch.no_grad():
        torch.testing.assert_close(zoo(ids).logits, hf(ids).logits, rtol=0, atol=ATOL)


def test_cached_greedy_generation_matches_hf(hf_checkpoint):
    hf, path = hf_checkpoint
    zoo = ZooLlamaForCausalLM.from_pretrained(path).eval()
    prompt = torch.randint(0, SHAPES["vocab_size"], (2, 7))
    kwargs = dict(
        max_new_tokens=12, do_sample=False, use_cache=True, output_scores=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )
    a, b = zoo.generate(prompt, **kwargs), hf.generate(prompt, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), rtol=0, atol=ATOL)


def test_zoo_checkpoint_loads_into_hf_llama(tmp_path):
    torch.manual_seed(0)
    zoo = ZooLlamaForCausalLM(ZooLlamaConfig(**SHAPES, num_key_value_heads=4)).eval()
    zoo.save_pretrained(tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, SHAPES["vocab_size"], (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, zoo(ids).logits, rtol=0, atol=ATOL)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3_ROPE])
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**SHAPES, rope_parameters=dict(rope))
    head_dim = SHAPES["hidden_size"] // SHAPES["num_attention_heads"]
    if rope["rope_type"] == "default":
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    torch.testing.assert_close(rope_inv_freq(rope, head_dim), expected, rtol=1e-6, atol=0)
