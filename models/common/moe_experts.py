"""The routed experts of the MoE layer (models/common/moe.py): E SwiGLU experts as stacked weights.

`GroupedExperts(num_experts, hidden_size, intermediate_size, impl="grouped_mm")`: E SwiGLU experts as
stacked weights laid out as nn.Linear weights, expert e's `gate_proj[e]` / `up_proj[e]` [f, d] and
`down_proj[e]` [d, f] (so a dense MLP's weights copy in unchanged: upcycling). `forward(x_sorted [N, d],
counts [E_local])` runs expert e on its run of rows with `torch.nn.functional.grouped_mm` over int32
offsets (fp32 / bf16 / fp16, eager); a loop over experts where grouped_mm cannot run (fp64, fp32 under
torch.compile) or with `impl="loop"`. grouped_mm needs every row to be a multiple of 16 bytes, so
hidden_size and intermediate_size must be multiples of 8 (8 bf16 values; `check_expert_widths`).
`forward_padded(x [E_local, N, d])`: the same experts on N rows each, a batched matmul (the padded
dispatch's fixed shape; any dtype, compiles).

Under expert parallelism (parallel/ep.py) rank r of P keeps experts [r E/P, (r+1) E/P): `num_experts` stays
the global E, `num_local_experts` becomes E/P.
"""

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_IMPLS = ("grouped_mm", "loop")
# grouped_mm reads rows whose byte length is a multiple of 16: 8 values at 2 bytes (bf16 / fp16), which
# also covers fp32's 4. A model's widths must fit every dtype it may be cast to.
WIDTH_MULTIPLE = 8


def _nearby_multiples(n: int, m: int) -> str:
    below, above = (n // m) * m, (n // m + 1) * m
    return f"{below} or {above}" if below > 0 else f"{above}"


def check_expert_widths(hidden_size: int, intermediate_size: int, impl: str = "grouped_mm") -> None:
    """One clear error if grouped_mm cannot take experts of these widths (or `impl` is unknown)."""
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"Unknown experts implementation {impl!r}; choose one of {EXPERT_IMPLS}.")
    if impl != "grouped_mm":
        return
    bad = {
        k: v
        for k, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size))
        if v % WIDTH_MULTIPLE
    }
    if bad:
        fits = "; ".join(f"{k} {_nearby_multiples(v, WIDTH_MULTIPLE)}" for k, v in bad.items())
        raise ValueError(
            f"Expert widths {', '.join(f'{k}={v}' for k, v in bad.items())} do not fit grouped_mm, which needs every "
            f"row to be a multiple of 16 bytes (8 bf16 / fp16 values), so widths must be multiples of {WIDTH_MULTIPLE}: "
            f"use {fits} (or experts_impl='loop', a slower per-expert loop)."
        )


class GroupedExperts(nn.Module):
    """E SwiGLU experts, down(silu(gate(x)) * up(x)), weights stacked along dim 0 (module docstring)."""

    # Run by these methods besides forward (the padded dispatch): FSDP gathers the weights for them too.
    fsdp_forward_methods = ("forward_padded",)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, impl: str = "grouped_mm"):
        super().__init__()
        check_expert_widths(hidden_size, intermediate_size, impl)
        self.num_experts = num_experts  # over all ep ranks
        self.num_local_experts = num_experts  # this rank's: the ep layout divides it
        self.impl = impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """`x` [N, d]: rows sorted by local expert, `counts[e]` rows for expert e (ints or a tensor)."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        if len(counts) != self.gate_proj.shape[0] or sum(counts) != x.shape[0]:
            raise ValueError(
                f"GroupedExperts got counts {counts} for {x.shape[0]} rows and {self.gate_proj.shape[0]} local "
                "experts; it needs one count per local expert, summing to the rows."
            )
        if self._use_loop(x):
            return self._forward_loop(x, counts)
        offsets = torch.tensor(list(accumulate(counts)), dtype=torch.int32, device=x.device)
        gate_w, up_w, down_w = self._weights(x.dtype)
        # grouped_mm computes x @ w[e] per run; nn.Linear-shaped weights [f, d] are read transposed.
        gate = F.grouped_mm(x, gate_w.transpose(-2, -1), offs=offsets)
        up = F.grouped_mm(x, up_w.transpose(-2, -1), offs=offsets)
        out = F.grouped_mm(F.silu(gate) * up, down_w.transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(out)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [E_local, N, d]: N rows for each local expert (the padded dispatch's fixed layout; a zero row
        gives a zero row). One batched matmul chain, [E_local, N, d] out."""
        if x.dim() != 3 or x.shape[0] != self.gate_proj.shape[0]:
            raise ValueError(
                f"GroupedExperts.forward_padded got rows shaped {tuple(x.shape)} for {self.gate_proj.shape[0]} local "
                "experts; it needs [local experts, rows per expert, hidden]."
            )
        gate_w, up_w, down_w = self._weights(x.dtype)
        h = F.silu(torch.bmm(x, gate_w.transpose(-2, -1))) * torch.bmm(x, up_w.transpose(-2, -1))
        return torch.bmm(h, down_w.transpose(-2, -1))

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three weights in the activations' dtype. Where FSDP2's mixed precision casts the model to bf16 but
        leaves the experts out (dp x sp = 1: parallel.fsdp), they stay fp32 while their input is bf16; the cast
        here is autocast's (a bf16 copy for the matmul, the gradient reaching the fp32 weight)."""
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        return tuple(w if w.dtype == dtype or not dtype.is_floating_point else w.to(dtype) for w in weights)

    def _use_loop(self, x: torch.Tensor) -> bool:
        if self.impl == "loop" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return True
        # torch 2.13 cannot compile grouped_mm in fp32.
        return x.dtype == torch.float32 and torch.compiler.is_compiling()

    def _forward_loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The reference: one matmul chain per expert (fallback, and what grouped_mm is tested against)."""
        outs = []
        gate_w, up_w, down_w = self._weights(x.dtype)
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ gate_w[e].T) * (rows @ up_w[e].T)
            outs.append(h @ down_w[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, self.down_proj.shape[1])


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm's backward refuses an expanded
    one (the gradient of `out.sum()`, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()
