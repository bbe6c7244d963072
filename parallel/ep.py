"""Expert-parallel roles, registered for the "ep" (and "tp") plans of MoE architectures' `sharding.py` files.

- "experts": an MoE block, i.e. a module with `experts` (a `models.common.moe.GroupedExperts`: stacked
  weights `gate_proj` / `up_proj` / `down_proj` with the expert along dim 0) and `ep_group`. Rank r of P keeps
  experts [r E/P, (r+1) E/P) (each weight split along dim 0, recorded with a ShardSpec on "ep", so
  `parallel.state` gathers checkpoints and `parallel.grad_sync` does not average them over ep) and the block
  gets the ep group, over which its forward dispatches tokens with the uneven all-to-all. The router stays
  replicated: every rank routes its own tokens over all E experts.
- "ffn": a layer's feed-forward in an architecture where some layers are MoE blocks and others dense SwiGLU
  MLPs (`moe` with `moe_layer_freq` > 1), under one pattern. Over ep: an MoE block as "experts", a dense MLP
  replicated. Over tp: a dense MLP Megatron-sharded ("swiglu"); an MoE block kept whole on every tp rank for
  now (its input is replicated over tp, so its output is complete on every rank and needs no all-reduce;
  the tp ranks of an ep group compute the same experts).

Duck-typed (no import of `models`: `parallel` is imported by model code, not the other way round). An
architecture's `check_layout` refuses an ep degree that does not divide the experts before any role runs.
"""

from torch import nn

from parallel.layout import MeshDim, register_role, split_param
from parallel.tp import swiglu

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def is_moe_block(module: nn.Module) -> bool:
    """An MoE block as the roles here see it: stacked experts and an `ep_group` to receive."""
    return hasattr(module, "ep_group") and hasattr(getattr(module, "experts", None), "num_local_experts")


@register_role("experts")
def experts(name: str, module: nn.Module, dim: MeshDim) -> None:
    if not is_moe_block(module):
        raise ValueError(
            f"{name} ({type(module).__name__}) is not an MoE block: the 'experts' role needs a module with stacked "
            "`experts` (models.common.moe.GroupedExperts) and an `ep_group` attribute."
        )
    grouped = module.experts
    if grouped.num_experts % dim.size:
        fits = [d for d in range(1, grouped.num_experts + 1) if grouped.num_experts % d == 0]
        raise ValueError(
            f"{name} has {grouped.num_experts} experts, which {dim.size} {dim.name} ranks cannot split evenly; "
            f"{dim.name.upper()} degrees that fit: {fits}."
        )
    for weight in EXPERT_WEIGHTS:
        split_param(grouped, weight, 0, dim, f"{name}.experts")
    grouped.num_local_experts = grouped.num_experts // dim.size
    module.ep_group = dim.group


@register_role("ffn")
def ffn(name: str, module: nn.Module, dim: MeshDim) -> None:
    moe = is_moe_block(module)
    if dim.name == "ep" and moe:
        experts(name, module, dim)
    elif dim.name == "tp" and not moe:
        swiglu(name, module, dim)
    elif dim.name not in ("ep", "tp"):
        raise ValueError(f"The 'ffn' role shards over ep or tp, not over {dim.name} ({name}).")
