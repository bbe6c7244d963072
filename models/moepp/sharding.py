"""Shard layout of MoE++: expert parallelism over ep, Megatron tensor parallelism over tp (as `moe`).

- ep ("experts", parallel/ep.py): each layer's FFN experts (`model.layers.N.mlp.experts`) are split
  N_FFN / P per rank and the layer gets the ep group. The zero-computation experts (zero, copy, constant)
  are replicated on every rank, like the router and its gating residual: their assignments are filtered
  out before the dispatch, so per layer one exchange of the FFN experts' counts and two all-to-alls
  forward (dispatch, combine) carry only the FFN experts' rows, k_eff = k tau N_FFN / (tau N_FFN + N_ZC)
  per token at the balance the loss aims for, instead of k. Attention, norms, embedding, head and the
  replicated experts have their gradients averaged over ep by parallel.grad_sync.
- tp: attention as Llama's (one all-reduce per layer); the MoE++ layer whole on every tp rank (its input is
  replicated over tp, so its output is complete without an all-reduce).
On an ep x tp mesh the ep all-to-alls run among the ranks of one tp coordinate.
"""

from parallel.layout import check_divisible, check_planned

PLAN = {
    "ep": {
        "model.layers.*.mlp": "experts",
    },
    "tp": {
        "model.layers.*.self_attn": "attention",
        "model.layers.*": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """EP splits the FFN experts evenly; TP splits query and KV heads evenly; no sequence-parallel forward."""
    check_planned(config, PLAN, degrees)
    # Only the FFN experts are split; the zero-computation ones are on every rank.
    check_divisible({"num_local_experts (FFN experts)": config.num_local_experts}, degrees.get("ep", 1), "ep")
    sizes = {k: getattr(config, k) for k in ("num_attention_heads", "num_key_value_heads")}
    check_divisible(sizes, degrees.get("tp", 1), "tp")
