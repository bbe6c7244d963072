"""What shared code needs to know about the vanilla MoE beyond its classes (see models/registry.py)."""

from models.common.moe_sharding import ep_collectives
from models.moe.configuration import ZooMoeConfig
from models.registry import Collectives

# Mixtral's expert count and top-k, for bench shapes that name neither.
BENCH_EXPERTS, BENCH_TOP_K = 8, 2


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooMoeConfig:
    """A Llama shape whose MLPs become MoE blocks of `num_local_experts` experts (default 8), top
    `num_experts_per_tok` (default 2), each expert as wide as the shape's MLP: E times the Llama's MLP
    parameters, k times its MLP compute per token."""
    fields = {"num_local_experts": BENCH_EXPERTS, "num_experts_per_tok": BENCH_TOP_K, **shape, **overrides}
    return ZooMoeConfig(**fields)


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """One forward in eval mode (sharding.py), dropless:

    - tp: an all-reduce of B x T x d after each attention and after each dense MLP (MoE blocks need none);
    - ep: per MoE layer two all-to-alls (dispatch, combine) of k d values per token (its own share
      included): the dispatch sends the rank's T x k token rows, the combine returns the rows it received,
      T x k on average over the ranks (exactly, under the simulated link); and one exchange of the E
      per-expert counts (`ep_collectives`, which also states the padded dispatch's).
    In training mode each MoE layer also all-reduces 2E + 2 values over ep for the balance loss.
    """
    tp, ep = degrees.get("tp", 1), degrees.get("ep", 1)
    layers, moe, d = config.num_hidden_layers, config.num_moe_layers, config.hidden_size
    out = {}
    if tp > 1:
        calls = layers + (layers - moe)
        out["all_reduce"] = Collectives(calls, calls * d)
    if ep > 1:
        out.update(ep_collectives(config, moe, config.num_experts_per_tok))
    return out
