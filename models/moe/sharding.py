"""Shard layout of the vanilla MoE: expert parallelism over ep, Megatron tensor parallelism over tp, the
MoE family's layout (models/common/moe_sharding.py) with what is the vanilla MoE's own:

- ep: in an MoE layer rank r of P keeps experts [r E/P, (r+1) E/P) and the block gets the ep group; the
  layers that keep their dense MLP (`moe_layer_freq` > 1) share the pattern `model.layers.*.mlp` ("ffn":
  an MoE block's experts split, a dense MLP replicated over ep).
- tp: attention and the dense MLPs as Llama's, one all-reduce each; MoE blocks whole on every tp rank.
"""

from models.common.moe_sharding import MoeLayout

LAYOUT = MoeLayout(dense_mlps=True)
PLAN = LAYOUT.plan


def check_layout(config, degrees: dict[str, int]) -> None:
    """EP splits the experts evenly; TP splits query heads, KV heads and (with dense layers) the MLP width
    evenly; no sequence-parallel forward."""
    LAYOUT.check(config, degrees)
