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
    """One forward under tensor parallelism (tp) or sequence parallelism (sp; sharding.py: not both).

    TP over P = degrees["tp"] ranks: an all-reduce of B x T x d after each layer's attention (linear or
    softmax) and one after its MLP, as Llama's (Megatron's f on the replicated inputs, and on the output
    norm's weight, communicates in the backward only).

    SP over P = degrees["sp"] ranks (parallel/sequence.py):
    - `sp_method: lasp2`: per linear layer one all-gather of this rank's d_k x d_v states, B x H of them,
      whose size does not depend on the tokens (declared with 0 values per token); per softmax layer
      (LASP-2H) two all-gathers, of K and of V (num_key_value_heads x head_dim values per token each).
    - `sp_method: lasp1`: per linear layer P - 1 ring hops (send_recv) of one such state; per softmax layer
      (ring attention) P - 1 hops of K and V together.
    """
    if degrees.get("tp", 1) > 1:
        calls = 2 * config.num_hidden_layers
        return {"all_reduce": Collectives(calls, calls * config.hidden_size)}
    p = degrees.get("sp", 1)
    if p == 1:
        return {}
    linear = config.num_linear_layers
    softmax = config.num_hidden_layers - linear
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim
    if config.sp_method == "lasp2":
        out = {"all_gather": Collectives(linear + 2 * softmax, softmax * kv_per_token)}
    else:
        hops = p - 1
        out = {"send_recv": Collectives(hops * (linear + softmax), hops * softmax * kv_per_token)}
    return {kind: c for kind, c in out.items() if c.calls}
