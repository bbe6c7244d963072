"""What shared code needs to know about GQLA beyond its classes (see models/registry.py)."""

from models.gqla.configuration import ZooGQLAConfig
from models.registry import Collectives


def fit_degrees(degrees: dict[str, int]) -> dict:
    """TP runs on the gqa path only (sharding.py): the absorb path's latent cache does not split."""
    return {"attn_path": "gqa"} if degrees.get("tp", 1) > 1 else {}


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooGQLAConfig:
    """The GQLA of a Llama bench shape: n_g = its KV heads (the same field), query heads as wide as its heads
    (d_r = min(64, head_dim / 2) RoPE dims, the rest without), d_v = head_dim, and d_c = min(512, full rank);
    the gqa path at TP > 1. `overrides` are GQLA config fields."""
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    groups = shape.get("num_key_value_heads") or shape["num_attention_heads"]
    d_r = min(64, head_dim // 4 * 2)  # even, at most half the head
    fields = {"qk_rope_head_dim": d_r, "qk_nope_head_dim": head_dim - d_r, "v_head_dim": head_dim}
    fields["kv_lora_rank"] = min(512, shape["hidden_size"], groups * (head_dim - d_r + head_dim))
    return ZooGQLAConfig(**{**shape, **fields, **fit_degrees(degrees), **overrides})


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """TP over groups (sharding.py): an all-reduce of B x T x d after attention and one after the MLP, per
    layer, as Llama's (Megatron's f on the replicated latent communicates in the backward only)."""
    if degrees.get("tp", 1) == 1:
        return {}
    calls = 2 * config.num_hidden_layers
    return {"all_reduce": Collectives(calls, calls * config.hidden_size)}
