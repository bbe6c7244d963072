"""Shard layout of Ladder Residual: exactly Llama's (Megatron col/row, KV cache by heads).

Same weights, same two all-reduces of B x T x d per layer; only where they are waited differs, and
that is in `ZooLadderModel.run_layers`, not here.
"""

from models.llama.sharding import PLAN, check_layout

__all__ = ["PLAN", "check_layout"]
