"""Tensor-parallel layout of the dense Llama (Megatron): the one place it is stated.

Per layer: q/k/v column-parallel by heads and o_proj row-parallel; gate/up column-parallel and
down_proj row-parallel; the decoder layer all-reduces each sub-block's partial output before adding
it to the residual stream (two all-reduces of B x T x d per layer). Embedding, norms and lm_head are
replicated. The KV cache is sharded by heads for free (each rank caches its own KV heads).
"""

TP_PLAN = {
    "model.layers.*.self_attn": "attention",
    "model.layers.*.mlp": "swiglu",
    "model.layers.*": "tp_group",
}
