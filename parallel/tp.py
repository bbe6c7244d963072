"""Tensor-parallel roles (Megatron style), registered for the "tp" plans of `sharding.py` files.

- "attention": q/k/v column-parallel by heads (a rank keeps heads [r*h/P, (r+1)*h/P) and the KV heads
  they read), o_proj row-parallel; the KV cache then holds local heads only.
- "swiglu": gate/up column-parallel, down row-parallel.
- "colwise" / "rowwise": one linear.
Column-parallel linears that read one input get Megatron's f on it (identity forward, all-reduce of the
gradient backward) so replicated parameters get full gradients; they are computed together
(`ColumnParallelRegion`), so that f's all-reduce runs while the backward computes their weights' gradients.
The model's own `check_layout` refuses degrees that do not fit before any role runs; the checks here only guard
a role's preconditions.
"""

import torch
from torch import nn

from parallel import comm
from parallel.layout import MeshDim, check_divisible, register_role, split_param


def shard_colwise(name: str, linear: nn.Linear, dim: MeshDim) -> None:
    split_param(linear, "weight", 0, dim, name)
    split_param(linear, "bias", 0, dim, name)
    linear.out_features //= dim.size


def shard_rowwise(name: str, linear: nn.Linear, dim: MeshDim) -> None:
    if linear.bias is not None:
        # A row-parallel bias must be added once, after the sum over ranks; keeping it on one rank only
        # would give ranks different parameter lists (and optimizer states) and break checkpoints.
        raise ValueError(
            "Row-parallel layers with a bias (attention_bias=True / mlp_bias=True on o_proj / down_proj) "
            "are not supported under TP > 1; use a config without output-projection biases."
        )
    split_param(linear, "weight", 1, dim, name)
    linear.in_features //= dim.size


class ColumnParallelRegion:
    """The column-parallel linears of one module that read its replicated input (q/k/v, gate/up, a linear mixer's
    q/k/v/g).

    The first of them called on the module's input computes all of them in one autograd node
    (`comm.column_parallel_linears`: Megatron's f fused with the linears), whose backward all-reduces the
    input's gradient while the weights' gradients are computed; the others return their share. So every path
    from the module's input to its output must run through these linears (true of each role's module here; the
    sharded == unsharded gradient tests check every architecture): anything else read off the input would get
    no all-reduce. A linear called on another tensor is a plain linear.

    The module's input is kept by an instance `forward` (not a hook): activation checkpointing wraps that
    attribute, so a recomputation of the module's forward keeps it too."""

    def __init__(self, module: nn.Module, linears: list[nn.Linear], group):
        self.module, self.linears, self.group = module, linears, group
        self.input = None
        self.pending: dict[int, torch.Tensor] = {}
        module.forward = self.module_forward
        for linear in linears:
            linear.forward = self.member_forward(linear)

    def module_forward(self, *args, **kwargs):
        # The class's forward, looked up at each call (never a bound method kept: see train.activation_checkpointing).
        self.input, self.pending = args[0], {}
        try:
            return type(self.module).forward(self.module, *args, **kwargs)
        finally:  # outputs not read (a linear the forward skipped) must not outlive the call
            self.input, self.pending = None, {}

    def member_forward(self, linear: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.input is None or x is not self.input:
                return nn.functional.linear(x, linear.weight, linear.bias)
            if id(linear) not in self.pending:
                outs = comm.column_parallel_linears(x, self.linears, self.group)
                self.pending = {id(m): y for m, y in zip(self.linears, outs, strict=True)}
            return self.pending.pop(id(linear))

        return forward

    def add(self, linear: nn.Linear) -> None:
        """One more column-parallel linear that reads the module's input (a linear mixer's output gate)."""
        self.linears.append(linear)
        linear.forward = self.member_forward(linear)


def _column_parallel_forward(linear: nn.Linear, group):
    """One column-parallel linear on its own ("colwise"): Megatron's f fused with it."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return comm.column_parallel_linears(x, [linear], group)[0]

    return forward


@register_role("attention")
def attention(name: str, module: nn.Module, dim: MeshDim) -> None:
    check_divisible(
        {f"{name}.num_heads": module.num_heads, f"{name}.num_key_value_heads": module.num_key_value_heads},
        dim.size,
        dim.name,
    )
    for proj in ("q_proj", "k_proj", "v_proj"):
        shard_colwise(f"{name}.{proj}", getattr(module, proj), dim)
    shard_rowwise(f"{name}.o_proj", module.o_proj, dim)
    module.num_heads //= dim.size
    module.num_key_value_heads //= dim.size
    module.tp_region = ColumnParallelRegion(module, [module.q_proj, module.k_proj, module.v_proj], dim.group)


@register_role("swiglu")
def swiglu(name: str, module: nn.Module, dim: MeshDim) -> None:
    shard_colwise(f"{name}.gate_proj", module.gate_proj, dim)
    shard_colwise(f"{name}.up_proj", module.up_proj, dim)
    shard_rowwise(f"{name}.down_proj", module.down_proj, dim)
    module.tp_region = ColumnParallelRegion(module, [module.gate_proj, module.up_proj], dim.group)


@register_role("colwise")
def colwise(name: str, module: nn.Linear, dim: MeshDim) -> None:
    shard_colwise(name, module, dim)
    module.forward = _column_parallel_forward(module, dim.group)


@register_role("rowwise")
def rowwise(name: str, module: nn.Linear, dim: MeshDim) -> None:
    shard_rowwise(name, module, dim)
