"""TransGQLA (models/gqla/convert.py): a tiny random Llama with one KV head and RoPE on all dims converts
exactly at full rank; with several KV heads the error falls as the latent widens; bad options fail clearly."""

import pytest
import torch

import models
from models.gqla.convert import calibrate, check_options, convert_model
from models.llama.configuration import ZooLlamaConfig
from models.llama.modeling import ZooLlamaForCausalLM

SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def tiny_llama(kv_heads: int, seed: int = 0) -> ZooLlamaForCausalLM:
    torch.manual_seed(seed)
    model = ZooLlamaForCausalLM(ZooLlamaConfig(num_key_value_heads=kv_heads, **SHAPE)).double().eval()
    # Larger weights than the init so that attention is far from uniform and errors show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.normal_(0, 0.1)
    return model


def batches(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=g) for _ in range(n)]


@torch.no_grad()
def mean_squared_logit_error(source, converted) -> float:
    ids = torch.cat(batches(2, seed=7))
    return ((source(input_ids=ids).logits - converted(input_ids=ids).logits) ** 2).mean().item()


@torch.no_grad()
def max_logit_error(source, converted, path: str = "absorb") -> float:
    converted.set_attn_path(path)
    ids = batches(1, seed=7)[0]
    return (source(input_ids=ids).logits - converted(input_ids=ids).logits).abs().max().item()


def test_registered():
    assert models.get_converter("llama_to_gqla").target == "gqla"


@pytest.mark.parametrize("path", ["absorb", "gqa"])
def test_one_kv_head_all_rope_full_rank_is_exact(path):
    source = tiny_llama(kv_heads=1)
    head_dim = source.config.head_dim
    full = head_dim  # n_g x (d_nope + d_v) = 1 x (0 + head_dim)
    converted = convert_model(
        source, calibrate(source, batches()), kv_lora_rank=full, qk_rope_head_dim=head_dim
    )
    assert converted.config.qk_nope_head_dim == 0
    assert max_logit_error(source, converted, path) < 1e-8


def test_error_falls_as_rank_grows():
    source = tiny_llama(kv_heads=2)
    covs = calibrate(source, batches())
    # RoPE kept on 4 of 8 dims: full rank 2 x (4 + 8) = 24; the floor left there is RoRoPE's (dropped residual
    # keys, nope dims without RoPE), the rest is the latent's truncation.
    errors = [
        mean_squared_logit_error(source, convert_model(source, covs, kv_lora_rank=r, qk_rope_head_dim=4))
        for r in (4, 8, 12, 16, 20, 24)
    ]
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < errors[0] / 10, errors


def test_rank_above_full_is_one_clear_error(tmp_path):
    source = tiny_llama(kv_heads=2)
    source.save_pretrained(tmp_path)
    # full rank: min(32, 2 x ((8 - 4) + 8)) = 24
    with pytest.raises(ValueError, match=r"kv_lora_rank=25 is out of range.*1\.\.24"):
        check_options(tmp_path, kv_lora_rank=25, qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="even divisor of head_dim"):
        check_options(tmp_path, kv_lora_rank=8, qk_rope_head_dim=3)


def test_train_convert_refuses_rank_above_full_before_loading(tmp_path):
    from train.convert import check_source

    source = tiny_llama(kv_heads=2)
    source.save_pretrained(tmp_path)
    converter = models.get_converter("llama_to_gqla")
    with pytest.raises(ValueError, match="kv_lora_rank=25 is out of range"):
        check_source(tmp_path, converter, {"kv_lora_rank": 25, "qk_rope_head_dim": 4})
