"""Configuration of the vanilla MoE (`moe`): a Llama config plus Mixtral's router and expert fields.

- `num_local_experts` (E) SwiGLU experts per MoE layer, each `intermediate_size` wide (Mixtral's names);
  `num_experts_per_tok` (k, top-2 by default) of them per token, their softmax scores renormalised.
- `moe_layer_freq`: layer i is an MoE layer when (i + 1) % moe_layer_freq == 0 (1: every layer, as
  Mixtral; 2: every other layer, as GShard / Switch and ScMoE's pairs); the others keep the dense MLP.
- `router_aux_loss_coef`: weight of the load-balance loss E * sum_i f_i P_i, averaged over the MoE layers
  (1 when balanced). 0.01 as Switch Transformer and MoE++ (HF Mixtral defaults to 0.001).
- `router_aux_loss_style`: "zoo" (default: the formula above, per layer, averaged over the MoE layers, every
  token counted) or "hf": transformers' `load_balancing_loss_func` as MixtralForCausalLM computes it (pooled
  over the MoE layers, counted per token, padding left out), to compare with HF-trained runs;
  models/common/moe.py states both conventions. `mixtral_to_moe` sets "hf" and Mixtral's coefficient.
- `capacity_factor`: None = dropless (default); a number caps the tokens each rank sends to one expert at
  k * ceil(capacity_factor * tokens / E) (models/common/moe.py).
- `router_score_func` ("softmax" | "sigmoid") and `router_balance_bias` (DeepSeek-V3's auxiliary-loss-free
  balancing bias; then usually router_aux_loss_coef=0): torchtitan's router options.
- `experts_impl`: "grouped_mm" (default; hidden_size and intermediate_size multiples of 8) or "loop".
- `moe_dispatch` ("dropless", default, or "padded") and `dispatch_capacity_factor` (None: the padded
  capacity is every token, nothing dropped): how tokens reach the experts (models/common/moe_config.py;
  padded for decode under CUDA graphs / torch.compile, `model.set_moe_dispatch` switches at run time).
"""

from models.common.moe import AUX_LOSS_STYLES, SCORE_FUNCS
from models.common.moe_config import MoeConfigMixin
from models.common.residual import check_residual
from models.llama.configuration import ZooLlamaConfig


class ZooMoeConfig(MoeConfigMixin, ZooLlamaConfig):
    model_type = "zoo_moe"

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    moe_layer_freq: int = 1
    router_aux_loss_coef: float = 0.01
    router_aux_loss_style: str = "zoo"
    capacity_factor: float | None = None
    router_score_func: str = "softmax"
    router_balance_bias: bool = False
    experts_impl: str = "grouped_mm"
    moe_dispatch: str = "dropless"
    dispatch_capacity_factor: float | None = None
    # The residual schedule (models/common/residual.py): "ladder" waits each laddered sub-block's last collective
    # one sub-block later (an MoE layer's combine all-to-all, a dense layer's TP all-reduce); `ladder_layers` as
    # Ladder's (None: every layer).
    residual: str = "standard"
    ladder_layers: int | list[int] | None = None

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        self.check_moe_fields()
        self.ladder_layers = check_residual(self.residual, self.ladder_layers, self.num_hidden_layers)
        freq, layers = self.moe_layer_freq, self.num_hidden_layers
        if isinstance(freq, bool) or not isinstance(freq, int) or not 1 <= freq <= layers:
            raise ValueError(
                f"moe_layer_freq={freq!r} must be an integer in 1..num_hidden_layers={layers} (every how many "
                "layers one is an MoE layer; larger leaves the model without any)."
            )
        if self.router_aux_loss_style not in AUX_LOSS_STYLES:
            raise ValueError(
                f"router_aux_loss_style={self.router_aux_loss_style!r} must be one of {AUX_LOSS_STYLES}: 'zoo' (per "
                "layer, averaged, every token) or 'hf' (transformers' load_balancing_loss_func: pooled over layers, "
                "per token, padding excluded)."
            )
        if self.router_score_func not in SCORE_FUNCS:
            raise ValueError(f"router_score_func={self.router_score_func!r} must be one of {SCORE_FUNCS}.")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.moe_layer_freq == 0

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it)."""
        d, f, e = self.hidden_size, self.intermediate_size, self.num_local_experts
        dense_mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        moe_block = d * e + e * 3 * d * f  # router + experts (no biases)
        return super().num_parameters_formula() + self.num_moe_layers * (moe_block - dense_mlp)
