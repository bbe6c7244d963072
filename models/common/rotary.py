"""Rotary position embedding (Su et al. 2021), with the Llama-3 frequency scaling.

`rope_inv_freq` reads a transformers-style `rope_parameters` dict (`rope_type` "default" or
"llama3"), so zoo configs and Hugging Face Llama configs mean the same thing by the same keys.
"""

import math

import torch
from torch import nn


def rope_inv_freq(rope_parameters: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d) for i < d/2, rescaled for long context if asked."""
    rope_type = rope_parameters.get("rope_type", "default")
    base = float(rope_parameters.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type != "llama3":
        raise ValueError(f"rope_type={rope_type!r} is not supported; use 'default' or 'llama3'.")
    # Llama 3.1: leave high frequencies alone, divide low frequencies by `factor`, and interpolate
    # smoothly between the two bands (wavelengths measured against the original context length).
    factor = float(rope_parameters["factor"])
    low_freq_factor = float(rope_parameters["low_freq_factor"])
    high_freq_factor = float(rope_parameters["high_freq_factor"])
    old_context = float(rope_parameters["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


class RotaryEmbedding(nn.Module):
    """Returns (cos, sin) of shape [batch, seq, head_dim] for the given positions."""

    def __init__(self, rope_parameters: dict, head_dim: int):
        super().__init__()
        self.rope_parameters = dict(rope_parameters)
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(rope_parameters, head_dim), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in fp32 whatever the model dtype: positions times frequencies lose precision in bf16.
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k: [batch, heads, seq, head_dim]; cos, sin: [batch, seq, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
