"""Configuration of ScMoE (Cai et al., ICML 2025, arXiv 2404.05019): a Llama config plus the MoE fields.

- `shortcut_position` 2 (the paper's recommended Position 2): the layers come in pairs, a dense block
  (attention + dense MLP) then an MoE block (attention + a gated shared expert + top-k routed experts
  reading the dense block's post-attention stream); `num_hidden_layers` must be even. 1: every layer is an
  MoE block whose routed experts read the layer's input (the preceding block's output). The MoE blocks
  are the layers `moe` puts its MoE layers in with `moe_layer_freq` 2 (Position 2) or 1 (Position 1).
- `num_local_experts` (E, Mixtral's name as in `moe`) routed SwiGLU experts, each `intermediate_size`
  wide like the dense MLP; top `num_experts_per_tok` (1 in the paper) by softmax score.
- `shared_expert_intermediate_size` (default: `intermediate_size`): the shared expert, a dense SwiGLU on
  the MoE block's own stream, gated per token by sigmoid(W_cg x) ("CG-1"). Top-1 + shared expert has the
  compute per token of `moe`'s top-2 at the same widths.
- `shortcut` (True): False feeds the routed experts the MoE block's own post-attention stream instead
  (top-k MoE + gated shared expert, no shortcut: the paper's baseline shape, nothing to overlap).
- `router_aux_loss_coef` (0.01): weight of the load-balance loss E * sum_i f_i P_i, averaged over the MoE
  blocks, in the training loss (as in `moe`).
- `capacity_factor`: None = dropless (default); a number caps the tokens each rank sends to one expert
  (models/common/moe.py `capacity`). `experts_impl`: "grouped_mm" (widths multiples of 8) or "loop".
- `moe_dispatch` ("dropless", default, or "padded") and `dispatch_capacity_factor` (None: the padded
  capacity is every token, nothing dropped): how tokens reach the experts (models/common/moe_config.py;
  padded for decode under CUDA graphs / torch.compile, `model.set_moe_dispatch` switches at run time).
- `moe_overlap` (True): issue each all-to-all as early and wait it as late as the schedule allows
  (modeling.py); False waits each at once (the serial schedule: the same values, nothing hidden).
"""

from models.common.moe_config import MoeConfigMixin
from models.llama.configuration import ZooLlamaConfig


class ZooScMoeConfig(MoeConfigMixin, ZooLlamaConfig):
    model_type = "zoo_scmoe"

    residual_refusal = (
        "ScMoE already schedules each layer pair around its all-to-alls: the routed experts read the shortcut (the "
        "dense block's post-attention stream), so the dispatch overlaps MLP_l and the combine Attn_{l+1} and the "
        "shared expert. A ladder on top would change which stream the shortcut reads, a model neither paper "
        "defines, so the zoo does not offer it."
    )

    num_local_experts: int = 8
    num_experts_per_tok: int = 1
    shared_expert_intermediate_size: int | None = None
    shortcut_position: int = 2
    shortcut: bool = True
    router_aux_loss_coef: float = 0.01
    capacity_factor: float | None = None
    experts_impl: str = "grouped_mm"
    moe_dispatch: str = "dropless"
    dispatch_capacity_factor: float | None = None
    moe_overlap: bool = True

    def __post_init__(self, **kwargs):
        if self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = self.intermediate_size
        super().__post_init__(**kwargs)

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        position, n = self.shortcut_position, self.num_hidden_layers
        if position not in (1, 2) or isinstance(position, bool):
            raise ValueError(
                f"shortcut_position={position!r} must be 1 (every layer an MoE block, routed experts reading the "
                "layer's input) or 2 (dense/MoE pairs, routed experts reading the dense block's post-attention "
                "stream)."
            )
        if position == 2 and n % 2:
            raise ValueError(
                f"num_hidden_layers={n} is odd, but shortcut_position=2 builds (dense, MoE) pairs; use {n - 1} or "
                f"{n + 1} layers, or shortcut_position=1 (every layer an MoE block)."
            )
        width = self.shared_expert_intermediate_size
        if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
            raise ValueError(f"shared_expert_intermediate_size={width!r} must be a positive int (the shared expert's width).")
        self.check_moe_fields()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """The second block of each pair (Position 2), or every block (Position 1)."""
        return self.shortcut_position == 1 or layer_idx % 2 == 1

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it)."""
        d, f, e, s = self.hidden_size, self.intermediate_size, self.num_local_experts, self.shared_expert_intermediate_size
        bias = self.mlp_bias
        dense_mlp = 3 * d * f + (2 * f + d if bias else 0)
        moe_block = (
            d * e + e * 3 * d * f  # router + routed experts (no biases)
            + 3 * d * s + (2 * s + d if bias else 0)  # shared expert
            + d  # W_cg, the shared expert's gate
            + d  # the shortcut's own RMSNorm
        )
        # Llama's count, each MoE block trading its dense MLP for the MoE parts.
        return super().num_parameters_formula() + self.num_moe_layers * (moe_block - dense_mlp)
