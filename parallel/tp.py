"""Tensor-parallel roles (Megatron style), registered for the "tp" plans of `sharding.py` files.

- "attention": q/k/v column-parallel by heads (a rank keeps heads [r*h/P, (r+1)*h/P) and the KV heads
  they read), o_proj row-parallel; the KV cache then holds local heads only.
- "swiglu": gate/up column-parallel, down row-parallel.
- "colwise" / "rowwise": one linear.
Column-parallel regions get Megatron's f on their input (identity forward, all-reduce of the gradient
backward) so replicated parameters get full gradients. The model's own `check_layout` refuses degrees
that do not fit before any role runs; the checks here only guard a role's preconditions.
"""

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


def _replicated_input_hook(group):
    def hook(module, args, kwargs):
        return (comm.copy_to_tp_region(args[0], group), *args[1:]), kwargs

    return hook


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
    module.register_forward_pre_hook(_replicated_input_hook(dim.group), with_kwargs=True)


@register_role("swiglu")
def swiglu(name: str, module: nn.Module, dim: MeshDim) -> None:
    shard_colwise(f"{name}.gate_proj", module.gate_proj, dim)
    shard_colwise(f"{name}.up_proj", module.up_proj, dim)
    shard_rowwise(f"{name}.down_proj", module.down_proj, dim)
    module.register_forward_pre_hook(_replicated_input_hook(dim.group), with_kwargs=True)


@register_role("colwise")
def colwise(name: str, module: nn.Linear, dim: MeshDim) -> None:
    shard_colwise(name, module, dim)
    module.register_forward_pre_hook(_replicated_input_hook(dim.group), with_kwargs=True)


@register_role("rowwise")
def rowwise(name: str, module: nn.Linear, dim: MeshDim) -> None:
    shard_rowwise(name, module, dim)
