"""What shared code needs to know about ScMoE beyond its classes (see models/registry.py)."""

from models.common.moe_sharding import ep_collectives
from models.registry import Collectives
from models.scmoe.configuration import ZooScMoeConfig

# `moe`'s bench expert count; top-1 routed + the shared expert match its top-2 compute per token.
BENCH_EXPERTS, BENCH_TOP_K = 8, 1


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooScMoeConfig:
    """A Llama shape in Position-2 pairs: every other MLP becomes an MoE block of `num_local_experts`
    (default 8) routed experts, top-1 on the shortcut, plus a shared expert, each as wide as the shape's
    MLP. Against `moe` with `moe_layer_freq=2` (the same layers MoE, top-2): the same compute per token,
    plus one MLP's parameters per MoE block (the shared expert)."""
    fields = {"num_local_experts": BENCH_EXPERTS, "num_experts_per_tok": BENCH_TOP_K, **shape, **overrides}
    return ZooScMoeConfig(**fields)


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """One forward in eval mode (sharding.py), dropless:

    - tp: an all-reduce of B x T x d after each attention, each dense MLP and each shared expert (2 per layer);
    - ep: per MoE block two all-to-alls (dispatch, combine), each sending this rank's T x k shortcut rows (its
      own share included), and one exchange of the E per-expert counts (`ep_collectives`, which also states
      the padded dispatch's).
    In training mode each MoE block also all-reduces 2E + 2 values over ep for the balance loss.
    """
    tp, ep = degrees.get("tp", 1), degrees.get("ep", 1)
    layers, moe, d = config.num_hidden_layers, config.num_moe_layers, config.hidden_size
    out = {}
    if tp > 1:
        out["all_reduce"] = Collectives(2 * layers, 2 * layers * d)
    if ep > 1:
        out.update(ep_collectives(config, moe, config.num_experts_per_tok))
    return out
