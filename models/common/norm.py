"""RMSNorm (Zhang & Sennrich 2019), computed in fp32 as Llama does."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) over the last dimension, in x's dtype (before the weight)."""
        dtype = x.dtype
        # At least fp32 statistics: in bf16 the mean of squares loses too many bits for deep models. (fp64
        # stays fp64, so that fp64 parity tests are not limited by this norm's rounding.)
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
