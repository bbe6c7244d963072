"""SwiGLU feed-forward block (Shazeer 2020): down(silu(gate(x)) * up(x)).

Under tensor parallelism gate/up are column-parallel and down is row-parallel, so `forward` returns
a partial sum on each rank; the architecture's forward decides where that sum is all-reduced.
"""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def from_config(cls, config) -> "SwiGLUMLP":
        """The MLP of a Llama-style config (hidden_size, intermediate_size, mlp_bias)."""
        return cls(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
