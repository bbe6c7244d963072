"""Shard layout of GQLA: tensor parallelism over groups, on the gqa path; the one place it is stated.

Rank r of P holds groups [r n_g/P, (r+1) n_g/P) and the query heads that read them (heads are ordered by
group, so those are heads [r H/P, (r+1) H/P)):
- `self_attn` ("gqla_groups", registered here): k_up = W_UK and v_up = W_UV split on dim 0 (the groups);
  the query projection that gives the heads, `q_proj` (or, with q_lora_rank, DeepSeek's `q_b_proj`), split
  colwise: the rows of those heads (with Megatron's f on its input); W_DKV (kv_a_proj), W_KR (k_rope_proj),
  the latent's norm and the query latent (q_a_proj, q_a_layernorm) replicated: every rank computes the same
  [c ; k_r] and up-projects it to its own groups, so its KV cache holds its groups only (zero redundancy);
- `self_attn.o_proj` ("rowwise"): the columns of those heads, a partial sum per rank;
- `mlp` ("swiglu"): Megatron's MLP; `model.layers.*` ("group"): the decoder layer all-reduces each
  sub-block's partial output before adding it to the residual stream.
Collectives per forward: two all-reduces of B x T x d per layer, as Llama's. Embedding, norms and lm_head
are replicated.

The absorb path does not shard: its cache [c ; k_r] is the same for every head, so TP would split only the
query heads and replicate the cache on every rank. `check_layout` refuses it at TP > 1 (set attn_path='gqa').
"""

from torch import nn

from parallel.layout import ROLES, MeshDim, check_divisible, check_planned, register_role, split_param

PLAN = {
    "tp": {
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.self_attn": "gqla_groups",
        "model.layers.*.mlp": "swiglu",
        "model.layers.*": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """TP over groups on the gqa path: the degree divides n_g (so heads too) and the MLP width; no sp."""
    check_planned(config, PLAN, degrees)
    tp = degrees.get("tp", 1)
    if tp > 1 and config.attn_path == "absorb":
        raise ValueError(
            f"attn_path='absorb' does not shard over TP (tp={tp}): its latent cache [c ; k_r] is shared by every "
            "head, so each rank would hold all of it; run TP on the gqa path (attn_path='gqa', or "
            "model.set_attn_path('gqa') before parallelize)."
        )
    check_divisible(
        {"num_kv_groups": config.num_kv_groups, "intermediate_size": config.intermediate_size}, tp, "tp"
    )


@register_role("gqla_groups")
def gqla_groups(name: str, module: nn.Module, dim: MeshDim) -> None:
    """The attention's group-indexed up-projections: rank r keeps its groups, and the rows of their heads of
    the query projection (q_proj, or q_b_proj with q_lora_rank: colwise); o_proj has its own rowwise role. It
    gets the group for Megatron's f on the replicated latent (modeling.py)."""
    check_divisible({f"{name}.num_groups": module.num_groups}, dim.size, dim.name)
    query = "q_proj" if module.q_proj is not None else "q_b_proj"
    ROLES["colwise"](f"{name}.{query}", getattr(module, query), dim)
    split_param(module, "k_up", 0, dim, name)
    split_param(module, "v_up", 0, dim, name)
    module.num_heads //= dim.size
    module.num_groups //= dim.size
    module.tp_group = dim.group
