"""Shard layout of MoE++: expert parallelism over ep, Megatron tensor parallelism over tp, the MoE family's
layout (models/common/moe_sharding.py) with what is MoE++'s own:

- ep ("experts"): every layer is an MoE++ layer, whose FFN experts (`model.layers.N.mlp.experts`) are split
  N_FFN / P per rank. The zero-computation experts (zero, copy, constant) are replicated on every rank, like
  the router and its gating residual: their assignments are filtered out before the dispatch, so the two
  all-to-alls per layer carry only the FFN experts' rows, k_eff = k tau N_FFN / (tau N_FFN + N_ZC) per token
  at the balance the loss aims for, instead of k.
- tp: attention as Llama's (one all-reduce per layer); the MoE++ layer whole on every tp rank (no dense MLP).
"""

from models.common.moe_sharding import MoeLayout

LAYOUT = MoeLayout(dense_mlps=False, experts_label="num_local_experts (FFN experts)")
PLAN = LAYOUT.plan


def check_layout(config, degrees: dict[str, int]) -> None:
    """EP splits the FFN experts evenly (the zero-computation ones are on every rank); TP splits query and
    KV heads evenly; no sequence-parallel forward."""
    LAYOUT.check(config, degrees)
