"""Shard layout of ScMoE: expert parallelism over ep, Megatron tensor parallelism over tp, the MoE family's
layout (models/common/moe_sharding.py) with what is ScMoE's own:

- ep: an MoE block's routed experts (`model.layers.N.mlp`, a SparseMoE) are split E/P per rank and the block
  gets the ep group; its shortcut's tokens go out with the uneven all-to-all (where each all-to-all is issued
  and waited is `ZooScMoeModel._pair`). The dense blocks' MLPs share the pattern ("ffn": replicated over ep);
  the shared expert and its gate are replicated over ep like the router.
- tp: attention and the dense blocks' MLPs as Llama's; the shared experts ("swiglu") Megatron-sharded too,
  one all-reduce each (the shared expert's gate multiplies after it); routed experts whole on every tp rank.
"""

from models.common.moe_sharding import MoeLayout

LAYOUT = MoeLayout(
    dense_mlps=True,
    tp_modules=(("model.layers.*.shared_expert", "swiglu"),),
    tp_sizes=("shared_expert_intermediate_size",),
)
PLAN = LAYOUT.plan


def check_layout(config, degrees: dict[str, int]) -> None:
    """EP splits the routed experts evenly; TP splits query heads, KV heads, the shared expert's width and
    (with dense blocks) the MLP width evenly; no sequence-parallel forward."""
    LAYOUT.check(config, degrees)
