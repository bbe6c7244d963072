"""Tensor-parallel layout of the parallel block: Megatron col/row like Llama, but the layer sums the
attention and MLP partial outputs first, so ONE all-reduce of B x T x d per layer."""

TP_PLAN = {
    "model.layers.*.self_attn": "attention",
    "model.layers.*.mlp": "swiglu",
    "model.layers.*": "tp_group",
}
