"""Tensor-parallel layout of Kraken: the TP degree is k and rank i holds stream i whole.

- `model.layers.*.streams` ("streams"): rank i keeps stream i of every layer, no matrix split; its KV
  cache then holds stream i's layers only.
- `model.conjunction` ("rowwise"): rank i keeps the columns of W_conj that read stream i; the model
  all-reduces the partial products and adds the (replicated) bias once, after the sum.
- `model` ("tp_group"): the model's `run_layers` issues the collectives itself.

Embedding, final norm and lm_head are replicated. Collectives per forward: L-1 all-reduces of the sum
of streams (B x T x d'), each overlapped with attention, and one for the conjunction. Any TP degree other
than k (or 1) is refused by `ZooKrakenPreTrainedModel.check_tp`: a multiple of k would need Megatron
splits inside each stream, whose all-reduces are exposed again.
"""

TP_PLAN = {
    "model.layers.*.streams": "streams",
    "model.conjunction": "rowwise",
    "model": "tp_group",
}
