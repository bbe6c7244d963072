"""Configuration of MoE++ (Jin et al., ICLR 2025): a Llama config plus the MoE fields.

Every layer is an MoE++ layer whose router picks the top `num_experts_per_tok` (2) of
N = N_FFN + N_ZC experts:

- `num_local_experts` (N_FFN; Mixtral's name, as in `moe`) SwiGLU experts, each `intermediate_size` wide;
- zero-computation experts (N_ZC in all): `num_zero_experts` zero experts E(x) = 0, `num_copy_experts`
  copy experts E(x) = x and `num_constant_experts` constant experts E(x) = a1 x + a2 v with
  [a1, a2] = softmax(W_c x) and v learned. The paper's configurations (FFN + zero/copy/constant):
  0.6B 8+1/1/2, 1B 16+1/1/2, 2B 32+1/1/6, 7B 16+1/1/2.
  Expert ids: FFN experts 0..N_FFN-1, then the zero, the copy and the constant experts, in that order.
- `gating_residual` (True): layer j's router adds W_g^j (N x N) times layer j-1's router logits to its own.
- `tau` (0.75): the heterogeneous balance loss weighs the zero-computation experts by tau and the FFN
  experts by 1; `router_aux_loss_coef` (0.01) is its weight: L = L_ce + 0.01 L_b, L_b averaged over the
  layers (as `moe` averages its balance loss).
- `drop_tokens` (False) and `capacity_gamma` (1.1): with `drop_tokens` each expert takes at most its
  capacity, C_FFN = gamma tau T / (tau N_FFN + N_ZC) and C_ZC = gamma T / (tau N_FFN + N_ZC)
  (modeling.py `expert_capacities`), the rest being dropped. Dropless is the default: a token's output
  then does not depend on the other tokens of its batch (cached decode == full forward, expert parallel
  == one process), and the spec's capacities are one switch away.
- `experts_impl`: "grouped_mm" (widths multiples of 8) or "loop".
- `moe_dispatch` ("dropless", default, or "padded") and `dispatch_capacity_factor` (None: the padded
  capacity is every token, nothing dropped): how tokens reach the experts (models/common/moe_config.py;
  padded for decode under CUDA graphs / torch.compile, `model.set_moe_dispatch` switches at run time).
- `residual` ("standard" | "ladder") with `ladder_layers`: the residual schedule (models/common/residual.py).
  "ladder" waits each laddered layer's combine all-to-all (and attention all-reduce under TP) one sub-block
  later; the router logits still go to the next layer's gating residual at once (they exist before the dispatch).
"""

from models.common.moe_config import MoeConfigMixin, is_number
from models.common.residual import check_residual
from models.llama.configuration import ZooLlamaConfig


class ZooMoeppConfig(MoeConfigMixin, ZooLlamaConfig):
    model_type = "zoo_moepp"

    num_local_experts: int = 8
    num_zero_experts: int = 1
    num_copy_experts: int = 1
    num_constant_experts: int = 2
    num_experts_per_tok: int = 2
    gating_residual: bool = True
    tau: float = 0.75
    router_aux_loss_coef: float = 0.01
    drop_tokens: bool = False
    capacity_gamma: float = 1.1
    experts_impl: str = "grouped_mm"
    moe_dispatch: str = "dropless"
    dispatch_capacity_factor: float | None = None
    residual: str = "standard"
    ladder_layers: int | list[int] | None = None

    def validate(self) -> None:
        # Runs at construction and again after from_pretrained's keyword overrides (see ZooLlamaConfig).
        super().validate()
        self.ladder_layers = check_residual(self.residual, self.ladder_layers, self.num_hidden_layers)
        for name in ("num_zero_experts", "num_copy_experts", "num_constant_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0.")
        # Top-k runs over every expert; grouped_mm and expert parallelism see the FFN experts only.
        self.check_moe_fields(router_experts=self.num_total_experts, capacity_factor=False)
        tau = self.tau
        if not is_number(tau) or not 0 < tau <= 1:
            raise ValueError(
                f"tau={tau!r} must be in (0, 1]: the weight of the zero-computation experts in the balance loss "
                "(the paper's default 0.75; 1 balances them like FFN experts)."
            )
        gamma = self.capacity_gamma
        if not is_number(gamma) or gamma <= 0:
            raise ValueError(f"capacity_gamma={gamma!r} must be a number > 0 (the paper's 1.1).")

    @property
    def num_zc_experts(self) -> int:
        """N_ZC: the zero, copy and constant experts."""
        return self.num_zero_experts + self.num_copy_experts + self.num_constant_experts

    @property
    def num_total_experts(self) -> int:
        """N = N_FFN + N_ZC, the router's width."""
        return self.num_local_experts + self.num_zc_experts

    def num_parameters_formula(self) -> int:
        """Parameter count from the shapes alone (the shared harness checks the model against it)."""
        d, f, n, layers = self.hidden_size, self.intermediate_size, self.num_total_experts, self.num_hidden_layers
        dense_mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        moe = (
            d * n  # router W^j
            + self.num_local_experts * 3 * d * f  # FFN experts (no biases)
            + self.num_constant_experts * 3 * d  # W_c (2 x d) and v (d) of each constant expert
        )
        gating_residual = (layers - 1) * n * n if self.gating_residual else 0  # W_g^j, j >= 2
        return super().num_parameters_formula() + layers * (moe - dense_mlp) + gating_residual
