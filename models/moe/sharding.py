"""Shard layout of the vanilla MoE: expert parallelism over ep, Megatron tensor parallelism over tp.

- ep ("ffn", parallel/ep.py): in an MoE layer rank r of P keeps experts [r E/P, (r+1) E/P) and the block
  gets the ep group; each rank routes its own tokens over all E experts (the router is replicated) and
  sends them with the uneven all-to-all: per MoE layer one exchange of the per-expert counts, then two
  all-to-alls forward (dispatch, combine) and two backward. Attention, dense MLPs, norms, embedding and
  head are replicated over ep (their gradients averaged over it by parallel.grad_sync).
- tp: attention as Llama's (q/k/v column-parallel by heads, o_proj row-parallel, one all-reduce); dense
  MLPs as Llama's ("ffn" gives them the "swiglu" role, one all-reduce); MoE blocks are NOT split over tp
  for now: router and experts are whole on every tp rank, whose input is the same, so the block's output
  is complete without an all-reduce (the tp ranks of an ep group compute the same experts).
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
        "model.layers.*": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """EP splits the experts evenly; TP splits query heads, KV heads and (with dense layers) the MLP width
    evenly; no sequence-parallel forward."""
    check_planned(config, PLAN, degrees)
    check_divisible({"num_local_experts": config.num_local_experts}, degrees.get("ep", 1), "ep")
    sizes = {k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads")}
    if config.num_moe_layers < config.num_hidden_layers:
        sizes["intermediate_size"] = config.intermediate_size
    check_divisible(sizes, degrees.get("tp", 1), "tp")
