"""Sharded checkpoints through torch.distributed.checkpoint (DCP) that reshard to any degrees.

Each rank holds its parameters as the zoo's layout left them (plain TP / EP slices, recorded as ShardSpecs)
and, under FSDP2, as DTensors over the flattened token mesh. DCP saves a DTensor's local shard at its
global offset, but it cannot see a cut it was not told about: plain TP slices saved as they are would be
written by every tp rank under the same key and offset, and a reload would be silently wrong. So every
tensor is shown to DCP as a global view (`global_view`): a DTensor sharing the rank's storage, over a mesh
of the dimensions that cut it, in the order the cuts were made (the layout's tp / ep splits first, FSDP's
shard of what they left last: DTensor's left-to-right nesting of `Shard` placements is exactly that), with
the parameter's unsharded shape. DCP then writes each rank's own chunks only, and a checkpoint loads at
any other degrees: the loading rank's views ask for the regions it holds, whatever cut them.

The view meshes are coordinate maps only (`DeviceMesh(..., _init_backend=False)`): DCP asks them for this
rank's coordinates, never for a process group.

A tensor held whole by one rank (Kraken's per-rank entries, `keep_own_entry`) keeps its global name and is
written by its owner alone. Optimizer state is keyed by parameter name (not by the optimizer's numbering,
which differs between degrees) and shown with its parameter's view.

`stream_full_state(model)` gathers the unsharded model one block of parameters at a time (the embedding and
head, then each decoder layer): what the final Hugging Face export writes, never the whole model at once,
never the optimizer.
"""

import math
from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallel.layout import owned_entries, shard_specs
from parallel.mesh import DIM_ORDER
from parallel.state import _gather_owned, _gather_splits, _named_params, _owner_passes, _unsharded_numbering

__all__ = ["global_view", "model_views", "optimizer_views", "stream_full_state"]


@cache
def _view_mesh(device_type: str, rank: int, root: tuple, shape: tuple, groups: tuple[tuple[str, ...], ...]):
    """A coordinate-only mesh over `groups` (each a tuple of root dimensions, flattened row-major), in that
    order; the root dimensions not named are fixed at this rank's coordinate."""
    ranks = torch.tensor(root).reshape(shape)
    coordinate = [int(c[0]) for c in (ranks == rank).nonzero().T]
    used = [d for g in groups for d in g]
    index = tuple(slice(None) if d in used else coordinate[i] for i, d in enumerate(DIM_ORDER))
    sub = ranks[index]
    remaining = [d for d in DIM_ORDER if d in used]
    sub = sub.permute(*[remaining.index(d) for d in used])
    sub = sub.reshape(*[math.prod(shape[DIM_ORDER.index(d)] for d in g) for g in groups])
    names = tuple("_".join(g) for g in groups)
    return DeviceMesh(device_type, sub, mesh_dim_names=names, _init_backend=False)


def _mesh_key(mesh) -> tuple:
    names = mesh.mesh_dim_names
    if tuple(names) != DIM_ORDER:
        raise ValueError(f"Checkpoint views need the zoo's 4-D mesh {DIM_ORDER}, not one with dimensions {names}.")
    return (mesh.device_type, dist.get_rank(), tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape))


def global_view(tensor: torch.Tensor, specs, mesh) -> torch.Tensor:
    """`tensor` (a parameter or a state of the same shape, as this rank holds it) as DCP should see it: a
    DTensor of the unsharded shape over the dimensions that cut it, sharing storage; `tensor` itself if
    nothing cuts it (replicated, or held whole by its owner)."""
    groups, placements = [], []
    shape = list(tensor.shape)
    for spec in specs:
        if spec.tensor_dim is not None:
            groups.append((spec.mesh_dim,))
            placements.append(Shard(spec.tensor_dim))
            shape[spec.tensor_dim] *= spec.size
    local = tensor
    if isinstance(tensor, DTensor):  # FSDP's shard over the flattened token dimensions: the innermost cut
        (placement,) = tensor.placements
        (flat,) = tensor.device_mesh.mesh_dim_names
        groups.append(tuple(flat.split("_")))
        placements.append(placement)
        local = tensor._local_tensor
    if not groups:
        return tensor
    view_mesh = _view_mesh(*_mesh_key(mesh), tuple(groups))
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, view_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def model_views(model: nn.Module, mesh, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers, each as `global_view`, by name (with `prefix`). A tensor
    held under two names (tied weights: the embedding and the head) is listed once, under its first name, as
    `named_parameters` lists it: DCP would write it twice, and loading the one name fills both."""
    specs = shard_specs(model)
    views, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        views[prefix + name] = global_view(t.detach() if t.requires_grad else t, specs.get(name, ()), mesh)
    return views


def init_optimizer_state(optimizer) -> None:
    """Create the optimizer's state (Adam's moments, its step) before a load: a step with zero gradients
    at lr 0, what torch.distributed.checkpoint.state_dict does (weights unchanged, weight decay x lr = 0)."""
    if optimizer.state:
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def optimizer_views(model: nn.Module, optimizer, mesh) -> dict:
    """{parameter name: {state key: view}}: the optimizer's state shown like its parameter (a state of the
    parameter's shape with the parameter's view, a scalar such as Adam's step as it is)."""
    specs = shard_specs(model)
    out = {}
    for name, p in _named_params(model, optimizer):
        entry = optimizer.state.get(p)
        if not entry:
            continue
        out[name] = {
            k: global_view(v, specs.get(name, ()), mesh) if torch.is_tensor(v) and v.shape == p.shape and v.dim() else v
            for k, v in entry.items()
        }
    return out


def optimizer_param_groups(optimizer) -> list[dict]:
    """The optimizer's hyper-parameters per group, without the parameters (saved beside the state)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def load_param_groups(optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"The checkpoint's optimizer has {len(groups)} parameter groups, this one {len(optimizer.param_groups)}.")
    for saved, group in zip(groups, optimizer.param_groups, strict=True):
        group.update(saved)


# --- the unsharded model, one block at a time -------------------------------------------------------------


def _blocks(model: nn.Module, layers_prefix: str) -> list[list[str]]:
    """Parameter and buffer names of `model` in blocks: one per decoder layer under `layers_prefix`, and one
    of everything else first (the embedding, the final norm, the head)."""
    names = list(model.state_dict(keep_vars=True))
    layers: dict[str, list[str]] = {}
    rest = []
    for name in names:
        if name.startswith(layers_prefix):
            index = name[len(layers_prefix) :].partition(".")[0]
            layers.setdefault(index, []).append(name)
        else:
            rest.append(name)
    return [rest, *layers.values()]


@torch.no_grad()
def stream_full_state(model: nn.Module, layers_prefix: str = "model.layers."):
    """Yield the unsharded state dict of a sharded (and maybe FSDP-sharded) model in blocks (collective: every
    rank takes part and receives each block; each block freed before the next is gathered). Names and order
    are the unsharded model's."""
    specs = shard_specs(model)
    state = model.state_dict(keep_vars=True)
    passes = _owner_passes(model)
    owned = owned_entries(model)
    for block in _blocks(model, layers_prefix):
        part = {}
        for name in block:
            tensor = state[name].detach()
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            part[name] = _gather_splits(tensor, specs.get(name, ()))
        if owned:
            for prefixes in passes:
                part = _gather_owned(part, prefixes)
        yield part


# --- a one-file (unsharded) checkpoint into sharded views ------------------------------------------------


def _own_region(view: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(where this rank keeps its part of `view`, that part of the unsharded `full`)."""
    if not isinstance(view, DTensor):
        return view, full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(view.shape, view.device_mesh, view.placements)
    return view._local_tensor, full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


@torch.no_grad()
def load_full_state(model: nn.Module, mesh, state: dict[str, torch.Tensor]) -> None:
    """Copy an unsharded state dict (a one-file checkpoint) into a sharded model: each rank its own regions."""
    views = model_views(model, mesh)
    missing = sorted(set(views) - set(state))
    if missing:
        raise KeyError(f"The checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}.")
    for name, view in views.items():
        local, part = _own_region(view, state[name])
        local.copy_(part)


@torch.no_grad()
def load_full_optimizer(model: nn.Module, optimizer, mesh, state: dict) -> None:
    """Copy an unsharded optimizer state (`parallel.state.full_optimizer_state`'s numbering) into the
    optimizer of a sharded model, by parameter name."""
    init_optimizer_state(optimizer)
    _, index = _unsharded_numbering(model, optimizer)
    for name, entry in optimizer_views(model, optimizer, mesh).items():
        saved = state["state"].get(index[name])
        if saved is None:
            continue
        for key, view in entry.items():
            if torch.is_tensor(view):
                local, part = _own_region(view, saved[key])
                local.copy_(part)
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
