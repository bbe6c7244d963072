"""Shard layout of the dense Llama (Megatron tensor parallelism): the one place it is stated.

Per layer: q/k/v column-parallel by heads and o_proj row-parallel; gate/up column-parallel and
down_proj row-parallel; the decoder layer all-reduces each sub-block's partial output before adding
it to the residual stream (two all-reduces of B x T x d per layer). Embedding, norms and lm_head are
replicated. The KV cache is sharded by heads for free (each rank caches its own KV heads).
"""

from parallel.layout import check_divisible, check_planned

PLAN = {
    "tp": {
        "model.layers.*.self_attn": "attention",
        "model.layers.*.mlp": "swiglu",
        "model.layers.*": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """The TP degree splits query heads, KV heads (no KV replication) and the MLP width evenly; the
    model has no sequence-parallel forward."""
    check_planned(config, PLAN, degrees)
    sizes = {
        k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    }
    check_divisible(sizes, degrees.get("tp", 1), "tp")
