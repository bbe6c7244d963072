"""What shared code needs to know about Linear-Llama beyond its classes (see models/registry.py)."""

from models.linear.configuration import ZooLinearConfig
from models.registry import Collectives

# The LASP-2 paper's hybrid: one softmax layer in four.
HYBRID_PATTERN = "LLLN"


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooLinearConfig:
    """A Llama shape with linear attention in every layer (pattern and decay from `overrides`)."""
    return ZooLinearConfig(**{**shape, **overrides})


def hybrid_bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooLinearConfig:
    """A Llama shape as the "LLLN" hybrid unless `overrides` name another layer_pattern."""
    return ZooLinearConfig(**{"layer_pattern": HYBRID_PATTERN, **shape, **overrides})


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """One forward under sequence parallelism over P = degrees["sp"] ranks (no tensor-parallel layout):

    - linear layers, `sp_method: lasp2`: one all-gather of this rank's d_k x d_v states, B x H of them:
      its size does not depend on the tokens, so it is declared with 0 values per token;
      `lasp1`: P - 1 ring hops (send_recv) of one such state.
    - softmax layers, `sp_softmax_method: allgather` (LASP-2H): one all-gather of this rank's K and V
      (2 x num_key_value_heads x head_dim values per token); `ring`: P - 1 ring hops of K and V.
    These follow parallel/sequence.py's schedule (K and V sent together).
    """
    p = degrees.get("sp", 1)
    if p == 1:
        return {}
    linear = config.num_linear_layers
    softmax = config.num_hidden_layers - linear
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim
    calls = {"all_gather": 0, "send_recv": 0}
    values = {"all_gather": 0, "send_recv": 0}
    if config.sp_method == "lasp2":
        calls["all_gather"] += linear
    else:
        calls["send_recv"] += linear * (p - 1)
    if config.sp_softmax_method == "allgather":
        calls["all_gather"] += softmax
        values["all_gather"] += softmax * kv_per_token
    else:
        calls["send_recv"] += softmax * (p - 1)
        values["send_recv"] += softmax * (p - 1) * kv_per_token
    return {kind: Collectives(calls[kind], values[kind]) for kind in calls if calls[kind]}
