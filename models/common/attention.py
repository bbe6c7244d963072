"""Causal self-attention on PyTorch SDPA with grouped KV heads and a transformers `Cache`.

`forward` returns the output projection of this rank's heads. Without a process group that is the
whole attention output; under tensor parallelism (q/k/v column-parallel by heads, o_proj
row-parallel) it is a partial sum, and the architecture's forward decides when it is all-reduced.
The KV cache therefore holds only this rank's KV heads: sharding the cache by heads is free.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from models.common.rotary import apply_rotary_pos_emb


def make_causal_mask(
    attention_mask: torch.Tensor | None,
    q_len: int,
    past_len: int,
    device: torch.device,
    batch_size: int | None = None,
    q_offset: int = 0,
) -> torch.Tensor | None:
    """Boolean mask [batch or 1, 1, q_len, past_len + q_offset + q_len] (True = may attend), or None.

    The keys are, in order: `past_len` cached tokens, `q_offset` tokens that precede the queries but
    are not cached (under sequence parallelism: the tokens of the ranks before this one), then the
    queries' own tokens; query i sits at position past_len + q_offset + i and sees every key up to
    itself. Keys after the last query would all be masked, so they are not in the mask.

    None means plain causal attention that SDPA can do with `is_causal` (or no mask at all for a
    single decode step). `attention_mask` is the usual 2-D padding mask over those keys,
    [batch_size, past_len + q_offset + q_len]; any other shape is an error (an all-ones mask of the
    wrong shape would otherwise be ignored, and a partly-zero one sliced or broadcast onto the wrong
    tokens).
    """
    before = past_len + q_offset  # keys before the first query
    kv_len = before + q_len
    if attention_mask is not None:
        want = (attention_mask.shape[0] if batch_size is None else batch_size, kv_len)
        if tuple(attention_mask.shape) != want:
            keys, counts = "cached + new tokens", f"{past_len} + {q_len}"
            if q_offset:
                keys = "cached + preceding (seq_offset) + new tokens"
                counts = f"{past_len} + {q_offset} + {q_len}"
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but this input needs {want}: "
                f"[batch, {keys}] = [{want[0]}, {counts}], 1 for tokens to attend to and 0 for padding."
            )
    has_padding = attention_mask is not None and not bool(attention_mask.all())
    # SDPA's is_causal aligns the diagonal top-left, which is right only when no key precedes the queries.
    if not has_padding and (before == 0 or q_len == 1):
        return None
    q_pos = torch.arange(before, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]
    if has_padding:
        mask = mask & attention_mask[:, None, None, -kv_len:].bool()
        # A padding query would see no key at all and SDPA would return NaN; let it see itself
        # (its output is never used, and NaN must not leak into the batch through reductions).
        mask = mask | (k_pos == q_pos)[None, None]
    return mask


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """An attention output [B, H, T, D] as [B, T, H x D], the output projection's input."""
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


class Attention(nn.Module):
    """Multi-head attention with `num_key_value_heads` <= `num_heads` (GQA / MQA)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        layer_idx: int,
        bias: bool = False,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim
        # Local head counts: `parallel.parallelize` divides them by the TP degree.
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    @classmethod
    def from_config(cls, config, layer_idx: int, **extra) -> "Attention":
        """The attention of a Llama-style config (hidden_size, heads, KV heads, head_dim, attention_bias);
        `extra`: a subclass's own keyword arguments."""
        return cls(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            layer_idx,
            bias=config.attention_bias,
            **extra,
        )

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, position_embeddings)
        return self.o_proj(merge_heads(self.mix(q, k, v, attention_mask, cache)))

    def project(
        self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D] and k, v [B, H_kv, T, D] of `x` [B, T, hidden], q and k roped."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), position_embeddings)

    def heads(self, q, k, v, position_embeddings):
        """The projections [B, T, heads x D] as q [B, H, T, D] and k, v [B, H_kv, T, D], q and k roped (`project`'s
        second half, for a caller that computes the projections itself: parallel/collective_matmul.py)."""
        bsz, q_len, _ = q.shape
        q = q.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        k = k.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        v = v.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        if position_embeddings is not None:  # None: a model without rotary (NoPE; the mask alone is causal)
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def mix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """The attention [B, H, T, D] of the queries to the cached keys and values and these (appended to the
        cache). A subclass replaces this part alone (e.g. sequence parallelism, models/linear)."""
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            is_causal=attention_mask is None and q.shape[2] > 1,
            enable_gqa=self.num_heads != self.num_key_value_heads,
        )
