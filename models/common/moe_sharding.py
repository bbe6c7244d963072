"""The shard layout of the MoE family (`moe`, `scmoe`, `moepp`), written once: expert parallelism over ep,
Megatron tensor parallelism over tp. Each architecture's sharding.py states its own layout as one
`MoeLayout(...)`: what differs between them (dense MLPs among the MoE blocks, more Megatron-sharded
modules, the sizes those need tp to divide) and nothing else.

- ep (parallel/ep.py): every MoE block, `model.layers.N.mlp`, keeps E/P of its stacked experts (rank r of P:
  experts [r E/P, (r+1) E/P)) and gets the ep group; each rank routes its own tokens over all E experts
  (the router is replicated) and sends them with the uneven all-to-all: per MoE block one exchange of the
  per-expert counts, then two all-to-alls forward (dispatch, combine) and two backward. Where some layers'
  `mlp` is a dense SwiGLU instead (`dense_mlps`), the pattern takes the "ffn" role, which leaves a dense MLP
  replicated over ep; otherwise "experts". Everything else (router, attention, norms, embedding, head) is
  replicated over ep, its gradients averaged over it by parallel.grad_sync.
- tp: attention as Llama's (q/k/v column-parallel by heads, o_proj row-parallel, one all-reduce); dense MLPs
  as Llama's ("ffn" gives them the "swiglu" role, one all-reduce) and any `tp_modules` an architecture
  names. The MoE blocks are NOT split over tp: router and experts are whole on every tp rank, whose input
  is the same, so the block's output is complete without an all-reduce (the tp ranks of an ep group
  compute the same experts). `model.layers.*` gets the tp group (the layer waits its own all-reduces).
On an ep x tp mesh the ep all-to-alls run among the ranks of one tp coordinate.
"""

from dataclasses import dataclass

from models.registry import Collectives
from parallel.layout import check_divisible, check_planned


@dataclass(frozen=True)
class MoeLayout:
    """One MoE architecture's ep + tp layout (module docstring): `plan` for `shard_plan`, `check` for its
    sharding.py `check_layout`.

    - `dense_mlps`: some layers keep a dense SwiGLU MLP under `mlp` (`config.num_moe_layers` tells whether
      this config has any); then tp must also divide `intermediate_size`.
    - `tp_modules`: more (pattern, role) pairs of the tp plan, after attention and the MLPs.
    - `tp_sizes`: config fields that tp must divide besides the head counts (those `tp_modules` split).
    - `experts_label`: how an ep error names `num_local_experts`.
    """

    dense_mlps: bool
    tp_modules: tuple[tuple[str, str], ...] = ()
    tp_sizes: tuple[str, ...] = ()
    experts_label: str = "num_local_experts"

    @property
    def plan(self) -> dict[str, dict[str, str]]:
        mlp_role = "ffn" if self.dense_mlps else "experts"
        tp = {"model.layers.*.self_attn": "attention"}
        if self.dense_mlps:
            tp["model.layers.*.mlp"] = "ffn"  # dense MLPs Megatron-sharded; MoE blocks whole
        tp.update(self.tp_modules)
        tp["model.layers.*"] = "group"
        return {"ep": {"model.layers.*.mlp": mlp_role}, "tp": tp}

    def check(self, config, degrees: dict[str, int]) -> None:
        """EP splits the experts evenly; TP splits query heads, KV heads, `tp_sizes` and (with dense layers)
        the MLP width evenly; no sequence-parallel forward."""
        check_planned(config, self.plan, degrees)
        check_divisible({self.experts_label: config.num_local_experts}, degrees.get("ep", 1), "ep")
        names = ("num_attention_heads", "num_key_value_heads", *self.tp_sizes)
        sizes = {k: getattr(config, k) for k in names}
        if self.dense_mlps and config.num_moe_layers < config.num_hidden_layers:
            sizes["intermediate_size"] = config.intermediate_size
        check_divisible(sizes, degrees.get("tp", 1), "tp")


def ep_collectives(config, blocks: int, rows_per_token: float) -> dict[str, Collectives]:
    """The ep collectives of one forward over `blocks` MoE blocks (module docstring), for an entry.py's
    `collectives_per_forward`: per block two all-to-alls (dispatch, combine) of `rows_per_token` rows of d
    values per token each, and one exchange of the per-expert counts (8 E bytes per call whatever the batch:
    declared with 0 values per token). With `moe_dispatch="padded"` each all-to-all carries E C rows
    (`config.padded_rows_per_token` per token) and no count is exchanged."""
    d = config.hidden_size
    if config.padded_rows_per_token is not None:
        return {"all_to_all": Collectives(2 * blocks, 2 * blocks * config.padded_rows_per_token * d)}
    return {
        "all_to_all": Collectives(2 * blocks, 2 * blocks * rows_per_token * d),
        "exchange_splits": Collectives(blocks, 0),
    }
