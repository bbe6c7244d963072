"""Unsharded state of a sharded model: checkpoints, optimizer state, gradient norm and clipping.

Generic over the layout `parallel.parallelize` recorded (`parallel.layout.shard_specs`): a parameter
cut along a tensor dimension over a mesh dimension is gathered by concatenation and re-sliced by
chunking; an entry of a ModuleDict held whole by one rank (`keep_own_entry`) is gathered from every
rank under its own key. A full state therefore loads at any degrees, and the gathered state of a model
is exactly the state dict (and optimizer state) of the same model unsharded.

Every function here is collective over the groups in the specs except the `load_*` ones, which only
slice. The `group`, `rank` and `tp` arguments of the older TP-only signatures are accepted and unused:
each parameter's group and coordinates are recorded in its spec.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.layout import ShardSpec, owned_entries, shard_specs
from parallel.mesh import DIM_ORDER

__all__ = [
    "clip_grad_norm_",
    "full_optimizer_state",
    "full_state_dict",
    "grad_norm",
    "load_full_optimizer_state",
    "load_full_state_dict",
]


def _all_gather(value, group, size: int) -> list:
    """Every rank's `value` in rank order: a tensor (same shape on every rank), a dict of them, or a
    non-tensor (the same on every rank)."""
    if isinstance(value, dict):
        parts = {k: _all_gather(v, group, size) for k, v in value.items()}
        return [{k: v[r] for k, v in parts.items()} for r in range(size)]
    if not torch.is_tensor(value):
        return [value] * size
    parts = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(parts, value.contiguous(), group=group)
    return parts


def _gather_splits(tensor: torch.Tensor, specs: tuple[ShardSpec, ...]) -> torch.Tensor:
    for spec in reversed(specs):  # undo the splits in the reverse order they were made
        if spec.tensor_dim is not None:
            tensor = torch.cat(_all_gather(tensor, spec.group, spec.size), dim=spec.tensor_dim)
    return tensor


def _slice(tensor: torch.Tensor, specs: tuple[ShardSpec, ...]) -> torch.Tensor:
    for spec in specs:
        if spec.tensor_dim is not None:
            tensor = tensor.chunk(spec.size, dim=spec.tensor_dim)[spec.rank]
    return tensor


# Entries held whole by one rank (`<prefix><r>.<rest>` on rank r) keep their global names. The unsharded
# model has the same entries for every rank, in its order: rank 0's run of entries, then rank 1's, ...; a
# rank's run of entries stands for that whole block. One pass per mesh dimension, innermost first, so
# entries owned over two dimensions are gathered over one, then the other.


def _owner_passes(model: nn.Module) -> list[dict[str, ShardSpec]]:
    owners = owned_entries(model)
    passes = [{p: s for p, s in owners.items() if s.mesh_dim == dim} for dim in reversed(DIM_ORDER)]
    return [prefixes for prefixes in passes if prefixes]


def _split_owned(name: str, prefixes: dict[str, ShardSpec]) -> tuple[str, int, str] | None:
    """(prefix, rank key, rest) if `name` is `<prefix><key>.<rest>` of an owned ModuleDict, else None."""
    for prefix in prefixes:
        if name.startswith(prefix):
            key, _, rest = name[len(prefix) :].partition(".")
            return prefix, int(key), rest
    return None


def _held_elsewhere(name: str, owners: dict[str, ShardSpec]) -> bool:
    """Whether `name` belongs to an entry another rank holds (over any mesh dimension)."""
    return any(
        name.startswith(p) and name[len(p) :].partition(".")[0] != str(s.rank) for p, s in owners.items()
    )


def _unsharded_names(names: list[str], prefixes: dict[str, ShardSpec]) -> list[str]:
    """The names an unsharded model has in place of a rank's `names`, in its order (see above)."""
    out, run, run_prefix = [], [], None
    for name in [*names, None]:
        split = _split_owned(name, prefixes) if name is not None else None
        prefix = split[0] if split else None
        if run and prefix != run_prefix:
            out.extend(f"{run_prefix}{r}.{rest}" for r in range(prefixes[run_prefix].size) for rest in run)
            run = []
        run_prefix = prefix
        if split:
            run.append(split[2])
        elif name is not None:
            out.append(name)
    return out


def _gather_owned(items: dict, prefixes: dict[str, ShardSpec]) -> dict:
    """`items` (name -> value) with this rank's owned entries replaced by every rank's, in the unsharded
    order (collective)."""
    gathered = {}
    for name, value in items.items():
        if split := _split_owned(name, prefixes):
            prefix, _, rest = split
            spec = prefixes[prefix]
            gathered.update(
                {f"{prefix}{r}.{rest}": v for r, v in enumerate(_all_gather(value, spec.group, spec.size))}
            )
        else:
            gathered[name] = value
    return {name: gathered[name] for name in _unsharded_names(list(items), prefixes)}


# --- model state -----------------------------------------------------------------------------------


@torch.no_grad()
def full_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a sharded model, on every rank (collective)."""
    specs = shard_specs(model)
    state = {n: _gather_splits(t, specs.get(n, ())) for n, t in model.state_dict().items()}
    for prefixes in _owner_passes(model):
        state = _gather_owned(state, prefixes)
    return state


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], rank=None, tp=None) -> None:
    """Load an unsharded state dict into a sharded model (at any degrees): each rank keeps its own part."""
    owners, specs = owned_entries(model), shard_specs(model)
    model.load_state_dict(
        {n: _slice(t, specs.get(n, ())) for n, t in state.items() if not _held_elsewhere(n, owners)}
    )


# --- optimizer state ---------------------------------------------------------------------------------
# An optimizer state dict numbers parameters in param-group order. The unsharded model's optimizer has
# every rank's owned entries where a rank's has its own (param groups filter every entry alike), and its
# state tensors shaped like the parameter are sharded like it.


def _named_params(model: nn.Module, optimizer) -> list[tuple[str, nn.Parameter]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def _unsharded_numbering(model: nn.Module, optimizer) -> tuple[list[list[str]], dict[str, int]]:
    """Per param group, the parameter names of the unsharded model's optimizer in its order, and each
    name's index in its state dict."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    for prefixes in _owner_passes(model):
        groups = [_unsharded_names(g, prefixes) for g in groups]
    return groups, {n: i for i, n in enumerate(n for g in groups for n in g)}


@torch.no_grad()
def full_optimizer_state(model: nn.Module, optimizer, group=None) -> dict:
    """`optimizer.state_dict()` as the unsharded model's optimizer would give it (collective)."""
    state, specs = optimizer.state_dict(), shard_specs(model)
    entries = {}
    for index, (name, p) in enumerate(_named_params(model, optimizer)):
        if index in state["state"]:
            entries[name] = {
                k: _gather_splits(v, specs.get(name, ())) if torch.is_tensor(v) and v.shape == p.shape else v
                for k, v in state["state"][index].items()
            }
    for prefixes in _owner_passes(model):
        entries = _gather_owned(entries, prefixes)
    groups, index = _unsharded_numbering(model, optimizer)
    return {
        "state": {index[n]: entries[n] for n in sorted(entries, key=index.__getitem__)},
        "param_groups": [
            {**g, "params": [index[n] for n in names]}
            for g, names in zip(state["param_groups"], groups, strict=True)
        ],
    }


@torch.no_grad()
def load_full_optimizer_state(model: nn.Module, optimizer, state: dict, rank=None, tp=None) -> None:
    """Inverse of `full_optimizer_state`: this rank's part of an unsharded optimizer state, renumbered as
    its optimizer's."""
    specs = shard_specs(model)
    _, index = _unsharded_numbering(model, optimizer)
    own = {}
    for local, (name, p) in enumerate(_named_params(model, optimizer)):
        entry = state["state"].get(index[name])
        if entry is not None:
            own[local] = {
                k: _slice(v, specs.get(name, ())).clone()
                if torch.is_tensor(v) and v.dim() == p.dim() and v.dim() > 0
                else v
                for k, v in entry.items()
            }
    param_groups, start = [], 0
    for saved, current in zip(state["param_groups"], optimizer.param_groups, strict=True):
        param_groups.append({**saved, "params": list(range(start, start + len(current["params"])))})
        start += len(current["params"])
    optimizer.load_state_dict({"state": own, "param_groups": param_groups})


# --- gradients ---------------------------------------------------------------------------------------


@torch.no_grad()
def grad_norm(model: nn.Module, group=None) -> torch.Tensor:
    """Global L2 norm of the gradients of a sharded model, the same on every rank as unsharded: the squares
    of parameters sharded over some mesh dimensions are summed over those dimensions' groups, and over the
    FSDP mesh for a gradient FSDP holds in shards (a DTensor); replicated parameters (identical gradients on
    every rank) are counted once. (torch's `get_total_norm` reduces a DTensor over its FSDP mesh only, so tp
    ranks would clip differently.)"""
    specs = shard_specs(model)
    buckets: dict[tuple[str, ...], list[torch.Tensor]] = {}
    groups = {}
    for name, p in model.named_parameters():
        param_specs = specs.get(name, ())
        groups.update({s.mesh_dim: s.group for s in param_specs})
        dims = {s.mesh_dim for s in param_specs}
        if isinstance(p, DTensor):  # FSDP's shard: its mesh is one flattened dimension, named alike on every rank
            (fsdp_dim,) = p.device_mesh.mesh_dim_names
            groups[fsdp_dim] = p.device_mesh.get_group()
            dims.add(fsdp_dim)
        # Every rank has the same buckets (the layout is the same), so the all-reduces below match up.
        bucket = buckets.setdefault(tuple(sorted(dims)), [])
        if p.grad is not None:
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            bucket.append(grad.float().pow(2).sum())
    total = torch.zeros((), device=_local(next(model.parameters())).device)
    for dims in sorted(buckets):
        squares = torch.stack(buckets[dims]).sum() if buckets[dims] else torch.zeros_like(total)
        for dim in dims:
            dist.all_reduce(squares, group=groups[dim])
        total = total + squares
    return total.sqrt()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a sharded model (same coefficient on every rank)."""
    total = grad_norm(model)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            _local(p.grad).mul_(coef)
    return total
