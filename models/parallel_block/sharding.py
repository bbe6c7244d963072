"""Shard layout of the parallel block: exactly Llama's plan (Megatron col/row, KV cache by heads), but the
layer sums the attention and MLP partial outputs first, so ONE all-reduce of B x T x d per layer (that is in
`ParallelDecoderLayer.forward`, not here). Same degrees fit as for Llama."""

from models.llama.sharding import PLAN, check_layout

__all__ = ["PLAN", "check_layout"]
