"""Gradient synchronisation over the mesh dimensions whose ranks see different tokens, for every architecture.

Each rank's loss is the mean over its own tokens, and the loss a parallel run minimises is the mean of
those over the ranks that see different tokens: data parallel (dp), expert parallel (ep: every rank feeds
its own tokens) and sequence parallel (sp: a rank holds one chunk of each sequence). Tensor-parallel ranks
see the same tokens and compute the same loss; nothing is reduced over tp here (the TP layout's own
collectives already give a replicated parameter, such as a norm, its full gradient on every tp rank).

The gradient of that mean is (1/D) x the sum over the D = dp x ep x sp token shards of each one's
gradient. A parameter's gradient on one rank holds:
- over a token dimension the parameter is replicated on: only this rank's part of that sum, so it is
  summed over the dimension's group;
- over a token dimension the parameter is sharded on (experts over ep): already every rank's part, which
  the forward's collectives (the all-to-all that brings every ep rank's tokens to the expert) sum into the
  owner's gradient on the way back, so it is not reduced over that dimension.
Either way it is scaled by 1/D. So: gradient <- (sum over the token dimensions it is not sharded on) / D,
the sharded dimensions coming from the ShardSpecs `parallel.parallelize` recorded (`sync_plan`). A
replicated parameter is thereby averaged over dp x ep x sp, an expert over dp x sp (and divided by ep).

Where it serves: the replicated trainer only (`parallel.fsdp=false`), kept to compare FSDP2 against (the
default engine, parallel/fsdp.py: sharded state, reduce-scatters during the backward). Gradients with the
same dimensions to sum are flattened into buckets of about `bucket_mb` MB, scaled and all-reduced (SUM)
over each dimension's group in turn, once per optimizer step after the backward of its last micro-batch
(`train.strategy.ZooParallelStrategy` calls it), so nothing overlaps the backward.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from parallel.layout import MESH_DIM_ALIASES, shard_specs

__all__ = ["TOKEN_DIMS", "sync_gradients", "sync_plan"]

# Mesh dimensions whose ranks see different tokens (see above), in mesh order.
TOKEN_DIMS = ("dp", "ep", "sp")


def mesh_degrees(mesh) -> dict[str, int]:
    """Our dimension name -> size, for every dimension of `mesh`."""
    names = mesh.mesh_dim_names or ()
    return {MESH_DIM_ALIASES.get(n, n): mesh.size(i) for i, n in enumerate(names)}


def sync_plan(model: nn.Module, degrees: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the token dimensions its gradient is summed over, at `degrees` ({"dp": 2, ...}).
    Every gradient is also divided by the product of the token dimensions' sizes (see the module's doc)."""
    specs = shard_specs(model)
    token_dims = [d for d in TOKEN_DIMS if degrees.get(d, 1) > 1]
    plan = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            sharded = {s.mesh_dim for s in specs.get(name, ())}
            plan[name] = tuple(d for d in token_dims if d not in sharded)
    return plan


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of `grads` of one dtype, each about `bucket_bytes` (one larger gradient alone)."""
    buckets, current, size = [], [], 0
    for grad in grads:
        if current and (size + grad.numel() * grad.element_size() > bucket_bytes or grad.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(grad)
        size += grad.numel() * grad.element_size()
    return [*buckets, current] if current else buckets


@torch.no_grad()
def sync_gradients(model: nn.Module, mesh, bucket_mb: float = 25.0) -> None:
    """Average the gradients of `model` (sharded by `parallel.parallelize` over `mesh`) over the token
    dimensions, as `sync_plan` says (collective over those dimensions' groups; nothing to do if all are 1).

    A parameter without a gradient on this rank contributes zeros (and gets the synchronised gradient):
    every rank of a group must reduce the same buckets."""
    degrees = mesh_degrees(mesh)
    shards = math.prod(degrees.get(d, 1) for d in TOKEN_DIMS)
    if shards == 1:
        return
    names = {MESH_DIM_ALIASES.get(n, n): n for n in mesh.mesh_dim_names}
    params = dict(model.named_parameters())
    by_dims: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for name, dims in sync_plan(model, degrees).items():
        param = params[name]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        by_dims.setdefault(dims, []).append(param.grad)
    # The same order on every rank, so that the collectives of every group match up.
    for dims in sorted(by_dims):
        grads = by_dims[dims]
        if not dims:  # sharded over every token dimension: only the 1/D
            for grad in grads:
                grad.div_(shards)
            continue
        buckets = _buckets(grads, int(bucket_mb * 2**20))
        # Scaled before the sum, as DDP does, so that a low-precision sum cannot overflow.
        flats = [torch.cat([g.reshape(-1) for g in bucket]).div_(shards) for bucket in buckets]
        for dim in dims:
            group = mesh.get_group(names[dim])
            for handle in [dist.all_reduce(flat, group=group, async_op=True) for flat in flats]:
                handle.wait()
        for bucket, flat in zip(buckets, flats, strict=True):
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                grad.copy_(part.view_as(grad))
