"""Shard layouts of Linear-Llama (pure and hybrid): sequence parallelism over sp, or Megatron tensor
parallelism over tp; the one place they are stated.

Sequence parallelism (parallel/sequence.py). Rank r of the sp group holds tokens [r*N/P, (r+1)*N/P) of every
sequence and runs the whole model on them; every weight is replicated over sp (its gradient summed over the
group by parallel.grad_sync). What the ranks exchange is the sequence mixing of each layer, issued by the
attention modules once they hold the group (`sp_group`), with the config's `sp_method`:
- `lasp2`: per linear layer one all-gather of the d_k x d_v states (LASP-2: its size does not grow with N),
  per softmax layer of a hybrid all-gathers of K and V (LASP-2H; their backward reduce-scatters dK, dV);
- `lasp1`: the baselines, LASP-1's ring of states (P-1 serial hops) and ring attention (P-1 K/V shifts).
The trunk gets the group too: its `sequence_offset` starts this rank's positions and causal mask at r*N/P.

Tensor parallelism (Megatron, as the dense Llama's). Rank r of P keeps heads [r*H/P, (r+1)*H/P) of every
layer, whatever its mixer:
- a linear layer (`self_attn`, role "linear_heads", registered here): q, k, v and the output gate g_proj
  column-parallel by heads (Megatron's f on their input), o_proj row-parallel; the output norm o_norm (one
  RMSNorm weight over head_dim that every head shares) replicated, its gradient all-reduced over tp (each
  rank's is a sum over its own heads: modeling.HeadNorm); the decay this rank's heads' values (fixed: its
  slice of `fixed_log_decay_bits`, rebuilt from `first_head` after meta-device loading; learned: its slice
  of `decay_logits`, a sharded parameter);
- a softmax layer of a hybrid (the same pattern, the same role): Llama's "attention", query and KV heads
  split (the degree divides num_key_value_heads: no KV replication);
- `mlp` ("swiglu"): gate/up column-parallel, down row-parallel;
- `model.layers.*` ("group"): the decoder layer all-reduces each sub-block's partial output (two all-reduces
  of B x T x d per layer; the ladder residual schedule, config `residual: ladder`, waits each one a
  sub-block later).
Embedding, norms and lm_head are replicated. The cache is sharded by heads for free: a rank's LinearCache
holds the states [B, H/P, d_k, d_v] of its heads and the K/V of its KV heads (dynamic or static alike).

The two are not composed: tp > 1 with sp > 1 is refused (LASP-2 over a tp rank's heads is not written).
No expert parallelism.
"""

from torch import nn

from parallel.layout import ROLES, MeshDim, check_divisible, check_planned, register_role, split_param
from parallel.tp import shard_colwise

PLAN = {
    "sp": {
        "model": "group",  # the trunk: positions and the causal mask offset by the rank (sequence_offset)
        "model.layers.*.self_attn": "group",  # linear and softmax mixers alike
    },
    "tp": {
        "model.layers.*.self_attn": "linear_heads",  # linear and softmax mixers alike
        "model.layers.*.mlp": "swiglu",
        "model.layers.*": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """Any sp degree fits (the sequence length is checked where sequences are split, parallel.sequence.
    split_sequence); the tp degree splits the heads (and a hybrid's KV heads) and the MLP width evenly; tp and
    sp are not composed; ep has no layout."""
    check_planned(config, PLAN, degrees)
    tp, sp = degrees.get("tp", 1), degrees.get("sp", 1)
    if tp > 1 and sp > 1:
        raise ValueError(
            f"{config.model_type} shards over sp or over tp, not both at once (tp={tp} with sp={sp}): its "
            "sequence-parallel and tensor-parallel layouts are not composed (LASP-2 over a tp rank's heads is "
            "not written); use sp=1 or tp=1, and dp for more ranks."
        )
    sizes = {"num_attention_heads": config.num_attention_heads}
    if config.num_linear_layers < config.num_hidden_layers:  # softmax layers: their KV heads split too
        sizes["num_key_value_heads"] = config.num_key_value_heads
    sizes["intermediate_size"] = config.intermediate_size
    check_divisible(sizes, tp, "tp")


@register_role("linear_heads")
def linear_heads(name: str, module: nn.Module, dim: MeshDim) -> None:
    """A layer's sequence mixer split by heads. A softmax layer: Llama's "attention". A linear layer (it has the
    output gate g_proj): the same for q, k, v, o (its KV heads are its heads; Megatron's f on its input), plus
    g_proj column-parallel (it reads the same input, inside that f), the decay's values of this rank's heads
    (`first_head` records where they start) and the tp group for the shared output norm's gradient."""
    ROLES["attention"](name, module, dim)  # divides num_heads (and num_key_value_heads)
    if not hasattr(module, "g_proj"):
        return
    shard_colwise(f"{name}.g_proj", module.g_proj, dim)
    module.tp_region.add(module.g_proj)
    module.first_head += dim.rank * module.num_heads
    module.o_norm.tp_group = dim.group
    if module.decay == "learned":
        split_param(module, "decay_logits", 0, dim, name)
    elif module.decay != "none":
        # A non-persistent buffer (not in checkpoints): this rank's heads' values only.
        module.fixed_log_decay_bits = module.fixed_log_decay_bits.chunk(dim.size)[dim.rank].clone()
