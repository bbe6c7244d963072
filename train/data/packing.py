"""The next-token targets of a packed window of token ids (documents back to back, eos after each)."""

from __future__ import annotations

import torch


def next_token_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B, T] -> [B, T]: position t's target is label t+1, the last position's `ignore_index`. Sequence
    parallelism shifts before it splits a sequence over the sp ranks, so that the last position of a chunk
    predicts the first token of the next chunk (a loss that shifts inside each chunk would drop those)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
