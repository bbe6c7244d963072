"""Shard layout of Kraken: tensor parallelism at degree k, rank i holding stream i whole.

- `model.layers.*.streams` ("streams", registered here): rank i keeps stream i of every layer, no matrix
  split; its KV cache then holds stream i's layers only.
- `model.conjunction` ("rowwise"): rank i keeps the columns of W_conj that read stream i; the model
  all-reduces the partial products and adds the (replicated) bias once, after the sum.
- `model` ("group"): the model's `run_layers` issues the collectives itself.

Embedding, final norm and lm_head are replicated. Collectives per forward: L-1 all-reduces of the sum
of streams (B x T x d'), each overlapped with attention, and one for the conjunction. Any TP degree other
than k (or 1) is refused by `check_layout`: a multiple of k would need Megatron splits inside each
stream, whose all-reduces are exposed again.
"""

from torch import nn

from parallel.layout import MeshDim, check_planned, keep_own_entry, register_role

PLAN = {
    "tp": {
        "model.layers.*.streams": "streams",
        "model.conjunction": "rowwise",
        "model": "group",
    },
}


def check_layout(config, degrees: dict[str, int]) -> None:
    """Kraken's layout has one stream per rank: the TP degree must be k (or 1, unsharded)."""
    check_planned(config, PLAN, degrees)
    k, tp = config.kraken_degree, degrees.get("tp", 1)
    if tp not in (1, k):
        raise ValueError(
            f"Kraken with kraken_degree={k} runs at TP degree {k} (rank i holds stream i), not at TP degree "
            f"{tp}; TP degrees that fit this model: {sorted({1, k})} (or build it with kraken_degree={tp})."
        )


@register_role("streams")
def streams(name: str, module: nn.ModuleDict, dim: MeshDim) -> None:
    """The ModuleDict of a layer's k streams: rank i keeps stream i (the others live on their ranks)."""
    keep_own_entry(name, module, dim)
    # KV-cache layers: with all k streams local, stream i of layer l caches in layer l * k + i; holding one
    # stream per layer, a rank caches in layer l, so its cache has no gaps (`Cache.get_seq_length()` reads
    # layer 0).
    for sub in module.modules():
        if isinstance(getattr(sub, "layer_idx", None), int):
            sub.layer_idx //= dim.size
