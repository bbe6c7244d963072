"""What shared code needs to know about MoE++ beyond its classes (see models/registry.py)."""

from models.common.moe_sharding import ep_collectives
from models.moepp.configuration import ZooMoeppConfig
from models.registry import Collectives

# The paper's smallest configuration (0.6B: 8 FFN experts + 1 zero, 1 copy, 2 constant), top-2: against
# `moe`'s 8 experts top-2, the same FFN experts.
BENCH_EXPERTS = dict(num_local_experts=8, num_zero_experts=1, num_copy_experts=1, num_constant_experts=2)


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooMoeppConfig:
    """A Llama shape whose every MLP becomes an MoE++ layer: 8 FFN experts as wide as the shape's MLP plus
    1 zero, 1 copy and 2 constant experts, top-2, tau 0.75."""
    return ZooMoeppConfig(**{**BENCH_EXPERTS, "num_experts_per_tok": 2, **shape, **overrides})


def k_eff(config) -> float:
    """FFN experts per token, the rows each token sends through the all-to-all, at the load the heterogeneous
    balance loss aims for (each FFN expert taking tau times a zero-computation expert's share, MoE++'s heterogeneous balance loss):
    k tau N_FFN / (tau N_FFN + N_ZC). 2 * 0.75 * 16 / (0.75 * 16 + 4) = 1.5 at 16 + 4 experts."""
    tau, ffn = config.tau, config.num_local_experts
    return config.num_experts_per_tok * tau * ffn / (tau * ffn + config.num_zc_experts)


def expert_mix(config) -> str:
    """The experts in words, as reports quote them: top-k of the FFN experts + the zero / copy / constant
    experts, their share of all experts, and `k_eff` at the balanced load."""
    share = config.num_zc_experts / config.num_total_experts
    return (
        f"top-{config.num_experts_per_tok} of {config.num_local_experts} FFN experts {config.intermediate_size} "
        f"wide + {config.num_zero_experts} zero, {config.num_copy_experts} copy and {config.num_constant_experts} "
        f"constant experts (zero-computation experts {share:.0%} of all), k_eff {k_eff(config):.2f} at tau "
        f"{config.tau:g}"
    )


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """One forward in eval mode (sharding.py), dropless:

    - tp: an all-reduce of B x T x d after each attention (the MoE++ layer is whole on every tp rank);
    - ep: per layer two all-to-alls (dispatch, combine) carrying only the FFN experts' rows, `k_eff` per
      token at the balanced load (the count depends on the routing: the values per token declared are that
      expectation, not an integer), and one exchange of the N_FFN per-expert counts (`ep_collectives`,
      which also states the padded dispatch's: N_FFN C rows per all-to-all, whatever the routing).
    In training mode each layer also all-reduces 2N + 2 values over ep for the balance loss.
    """
    tp, ep = degrees.get("tp", 1), degrees.get("ep", 1)
    layers, d = config.num_hidden_layers, config.hidden_size
    out = {}
    if tp > 1:
        out["all_reduce"] = Collectives(layers, layers * d)
    if ep > 1:
        out.update(ep_collectives(config, layers, k_eff(config)))
    return out
