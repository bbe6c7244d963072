"""Shard layout of ScMoE: expert parallelism over ep, Megatron tensor parallelism over tp (as `moe`).

- ep ("ffn", parallel/ep.py): an MoE block's routed experts (`model.layers.N.mlp`, a SparseMoE) are split
  E/P per rank and the block gets the ep group; its shortcut's tokens go out with the uneven all-to-all,
  one exchange of per-expert counts and two all-to-alls forward per MoE block (dispatch, combine: where
  each is issued and waited is `ZooScMoeModel._pair`), two backward. The router, the shared expert, its
  gate, attention, norms, embedding and head are replicated over ep (gradients averaged by
  parallel.grad_sync).
- tp: attention as Llama's (one all-reduce); the dense blocks' MLPs ("ffn" gives them "swiglu") and the
  shared experts ("swiglu") Megatron-sharded, one all-reduce each (the shared expert's gate multiplies
  after it); routed experts whole on every tp rank (their input is replicated over tp, so their output is
  complete without an all-reduce).
On an ep x tp mesh the ep all-to-alls run among the ranks of one tp coordinate.
"""

from parallel.layout import check_divisible, check_planned

PLAN = {
    "ep": {
        "model.layers.*.mlp": "ffn",
    },
    "tp": {
        "model.layers.*.self_attn": "attention",
        "model.layers.*.mlp": "ffn",
        "model.layers.*.shared_expert": "swiglu",
        "model.layers.*": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """EP splits the routed experts evenly; TP splits query heads, KV heads, the shared expert's width and
    (with dense blocks) the MLP width evenly; no sequence-parallel forward."""
    check_planned(config, PLAN, degrees)
    check_divisible({"num_local_experts": config.num_local_experts}, degrees.get("ep", 1), "ep")
    sizes = {
        k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads", "shared_expert_intermediate_size")
    }
    if config.num_moe_layers < config.num_hidden_layers:
        sizes["intermediate_size"] = config.intermediate_size
    check_divisible(sizes, degrees.get("tp", 1), "tp")
