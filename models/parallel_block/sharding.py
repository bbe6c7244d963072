"""Shard layout of the parallel block: Megatron col/row like Llama, but the layer sums the attention and
MLP partial outputs first, so ONE all-reduce of B x T x d per layer. Same degrees fit as for Llama."""

from models.llama.sharding import check_layout

PLAN = {
    "tp": {
        "model.layers.*.self_attn": "attention",
        "model.layers.*.mlp": "swiglu",
        "model.layers.*": "group",
    },
}

__all__ = ["PLAN", "check_layout"]
