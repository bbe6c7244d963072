"""What the MoE family's configs (`moe`, `scmoe`, `moepp`) share, written once: the checks of the fields
every one of them has, the count of MoE layers and the active-parameter count.

`MoeConfigMixin` goes first among an MoE config's bases (`class ZooMoeConfig(MoeConfigMixin,
ZooLlamaConfig)`). It declares no field: each config declares its own (their defaults differ, and
config.json keeps its key order), and its `validate` calls `check_moe_fields` beside its own checks.
The fields read: `num_local_experts` (the routed SwiGLU experts, E), `num_experts_per_tok` (k),
`router_aux_loss_coef`, `experts_impl`, `capacity_factor` where the config has one (it says so), and the
dispatch every MoE config declares: `moe_dispatch` ("dropless", the default, exact, for training; or
"padded": C rows per expert, every all-to-all size known on the host, for decode under CUDA graphs /
torch.compile; models/common/moe.py) and `dispatch_capacity_factor` (None: C = the rank's token count,
never drops; a number f: C = ceil(f * tokens * k / E), drops counted). `model.set_moe_dispatch(...)`
switches both at run time.
"""

from models.common.moe_dispatch import check_moe_dispatch
from models.common.moe_experts import EXPERT_IMPLS, check_expert_widths
from models.common.moe_routing import check_top_k


def is_number(value) -> bool:
    """An int or a float, not a bool (a config field that is a count or a weight)."""
    return not isinstance(value, bool) and isinstance(value, int | float)


class MoeConfigMixin:
    def check_moe_fields(self, router_experts: int | None = None, capacity_factor: bool = True) -> None:
        """One clear error for a shared MoE field that does not fit. `router_experts`: how many experts the
        router chooses among, if not the `num_local_experts` SwiGLU experts (MoE++'s zero-computation
        experts are chosen too). `capacity_factor`: whether the config has that field (MoE++ drops by its
        own capacities, `capacity_gamma`)."""
        check_top_k(1, self.num_local_experts)  # a positive number of SwiGLU experts
        check_top_k(self.num_experts_per_tok, self.num_local_experts if router_experts is None else router_experts)
        coef = self.router_aux_loss_coef
        if not is_number(coef) or coef < 0:
            raise ValueError(f"router_aux_loss_coef={coef!r} must be a number >= 0 (0 turns the balance loss off).")
        cf = self.capacity_factor if capacity_factor else None
        if cf is not None and (not is_number(cf) or cf <= 0):
            raise ValueError(f"capacity_factor={cf!r} must be a number > 0, or None for dropless routing.")
        if self.experts_impl not in EXPERT_IMPLS:
            raise ValueError(f"experts_impl={self.experts_impl!r} must be one of {EXPERT_IMPLS}.")
        check_expert_widths(self.hidden_size, self.intermediate_size, self.experts_impl)
        check_moe_dispatch(self.moe_dispatch, self.dispatch_capacity_factor)

    @property
    def padded_rows_per_token(self) -> float | None:
        """Rows each all-to-all of the padded dispatch carries per token of the rank (E C / T), None when
        dropless: E with C = T; with a capacity factor f, min(E, f k) (exact when f T k / E is an integer)."""
        if self.moe_dispatch != "padded":
            return None
        e, factor = self.num_local_experts, self.dispatch_capacity_factor
        return e if factor is None else min(e, factor * self.num_experts_per_tok)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is an MoE layer (its `mlp` routed experts); every layer unless the
        config says otherwise."""
        return True

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def num_active_parameters_formula(self) -> int:
        """Parameters one token's forward uses (MoE papers' "active" count): all of them but, in each MoE
        layer, the SwiGLU experts beyond the k it is routed to (a shared expert always runs; embeddings count
        as in the total). For MoE++ an upper bound: a token that picks a zero-computation expert uses one
        FFN expert or none, so the mean over tokens is lower (the point of MoE++)."""
        d, f, e, k = self.hidden_size, self.intermediate_size, self.num_local_experts, self.num_experts_per_tok
        unused = e - min(k, e)
        return self.num_parameters_formula() - self.num_moe_layers * unused * 3 * d * f
