"""Tensor parallelism: apply a model's declared shard layout (its `sharding.py`) in place.

A layout maps module-name patterns to roles, Megatron style:
- "attention": q/k/v column-parallel by heads (a rank keeps heads [r*h/P, (r+1)*h/P) and the KV heads
  they read), o_proj row-parallel; the KV cache then holds local heads only.
- "swiglu": gate/up column-parallel, down row-parallel.
- "colwise" / "rowwise": one linear.
- "tp_group": the module communicates itself (its forward calls `parallel.comm` with `tp_group`).
- "streams": a ModuleDict of P parallel streams keyed "0".."P-1" (Kraken): rank r keeps stream r whole
  and drops the others; its parameters are marked `tp_stream` (they exist on one rank only).
Column-parallel regions get Megatron's f on their input (identity forward, all-reduce of the
gradient backward) so replicated parameters get full gradients. Weights are sliced as plain tensors
(as gpt-fast does), so the model's forward runs unchanged on local shards.
"""

import re

import torch
import torch.distributed as dist
from torch import nn

from parallel import comm
from parallel.mesh import mesh_group


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(what: dict[str, int], tp: int) -> None:
    """One clear error if the TP degree does not divide every sharded size in `what`."""
    for name, n in what.items():
        if n % tp != 0:
            fits = sorted(set.intersection(*(set(_divisors(v)) for v in what.values())))
            raise ValueError(f"TP degree {tp} does not divide {name}={n}; TP degrees that fit this model: {fits}.")


def _shard_param(param: nn.Parameter | None, dim: int, rank: int, tp: int) -> nn.Parameter | None:
    if param is None:
        return None
    shard = nn.Parameter(param.detach().chunk(tp, dim=dim)[rank].clone(), requires_grad=param.requires_grad)
    # Remembered so full (unsharded) state dicts can be gathered for checkpoints and re-sliced on load.
    shard.tp_shard_dim = dim
    return shard


def shard_colwise(linear: nn.Linear, rank: int, tp: int) -> None:
    linear.weight = _shard_param(linear.weight, 0, rank, tp)
    linear.bias = _shard_param(linear.bias, 0, rank, tp)
    linear.out_features //= tp


def shard_rowwise(linear: nn.Linear, rank: int, tp: int) -> None:
    if linear.bias is not None:
        # A row-parallel bias must be added once, after the sum over ranks; keeping it on one rank only
        # would give ranks different parameter lists (and optimizer states) and break checkpoints.
        raise ValueError(
            "Row-parallel layers with a bias (attention_bias=True / mlp_bias=True on o_proj / down_proj) "
            "are not supported under TP > 1; use a config without output-projection biases."
        )
    linear.weight = _shard_param(linear.weight, 1, rank, tp)
    linear.in_features //= tp


def keep_own_stream(name: str, streams: nn.ModuleDict, rank: int, tp: int) -> None:
    """Rank r keeps stream r of a ModuleDict of parallel streams (one per rank) and drops the others."""
    if not isinstance(streams, nn.ModuleDict) or set(streams.keys()) != {str(i) for i in range(tp)}:
        raise ValueError(
            f"{name} holds {len(streams)} streams but the TP degree is {tp}; the streams layout needs one stream "
            f"per rank, a ModuleDict keyed 0..{tp - 1}."
        )
    own = str(rank)
    for key in [key for key in streams if key != own]:
        del streams[key]
    # Names stay global (`...streams.<r>...`): full state dicts are gathered by renaming per rank.
    streams.tp_stream = rank
    for param in streams.parameters():
        param.tp_stream = rank
    # KV-cache layers: with all P streams local, stream i of layer l caches in layer l * P + i; holding
    # one stream per layer, a rank caches in layer l, so its cache has no gaps (`Cache.get_seq_length()`
    # reads layer 0).
    for module in streams.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx //= tp


def _replicated_input_hook(group):
    def hook(module, args, kwargs):
        return (comm.copy_to_tp_region(args[0], group), *args[1:]), kwargs

    return hook


def _apply_role(name: str, module: nn.Module, role: str, group, rank: int, tp: int) -> None:
    if role == "attention":
        check_divisible({"num_attention_heads": module.num_heads, "num_key_value_heads": module.num_key_value_heads}, tp)
        for proj in (module.q_proj, module.k_proj, module.v_proj):
            shard_colwise(proj, rank, tp)
        shard_rowwise(module.o_proj, rank, tp)
        module.num_heads //= tp
        module.num_key_value_heads //= tp
        module.register_forward_pre_hook(_replicated_input_hook(group), with_kwargs=True)
    elif role == "swiglu":
        check_divisible({"intermediate_size": module.gate_proj.out_features}, tp)
        shard_colwise(module.gate_proj, rank, tp)
        shard_colwise(module.up_proj, rank, tp)
        shard_rowwise(module.down_proj, rank, tp)
        module.register_forward_pre_hook(_replicated_input_hook(group), with_kwargs=True)
    elif role == "colwise":
        check_divisible({f"{name}.out_features": module.out_features}, tp)
        shard_colwise(module, rank, tp)
        module.register_forward_pre_hook(_replicated_input_hook(group), with_kwargs=True)
    elif role == "rowwise":
        check_divisible({f"{name}.in_features": module.in_features}, tp)
        shard_rowwise(module, rank, tp)
    elif role == "tp_group":
        module.tp_group = group
    elif role == "streams":
        keep_own_stream(name, module, rank, tp)
    else:
        raise ValueError(
            f"Unknown shard role {role!r} for {name}; expected attention, swiglu, colwise, rowwise, tp_group, streams."
        )


def _match(pattern: str, name: str) -> bool:
    """`*` stands for one dotted name segment (e.g. a layer index), as in HF `tp_plan`s."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def parallelize(model: nn.Module, mesh, dim: str = "tp") -> nn.Module:
    """Shard `model` in place over mesh dimension `dim` following `model.tp_plan` (its sharding.py)."""
    plan = getattr(model, "tp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel layout (no `tp_plan`).")
    group = mesh_group(mesh, dim, needed_by=f"tensor parallelism of {type(model).__name__}")
    tp, rank = mesh.size(mesh.mesh_dim_names.index(dim)), mesh.get_local_rank(dim)
    check = getattr(model, "check_tp", None)
    if check is not None:
        check(tp)
    if tp == 1:
        return model
    modules = dict(model.named_modules())
    for pattern, role in plan.items():
        matched = [n for n in modules if _match(pattern, n)]
        if not matched:
            raise ValueError(f"Shard layout pattern {pattern!r} of {type(model).__name__} matches no module.")
        for name in matched:
            _apply_role(name, modules[name], role, group, rank, tp)
    model.tp_degree = tp
    return model


# --- full (unsharded) state, for checkpoints and `save_pretrained` under TP ----------------------------


def _shard_dims(model: nn.Module) -> dict[str, int]:
    return {n: p.tp_shard_dim for n, p in model.named_parameters() if hasattr(p, "tp_shard_dim")}


# Parameters of a "streams" module exist on one rank each, under their global names (`<prefix><r>.<rest>`
# on rank r). The unsharded model has the same entries for every stream, in its order: stream 0's run of
# entries, then stream 1's, ...; a rank's run of entries stands for that whole block.


def _stream_prefixes(model: nn.Module) -> dict[str, int]:
    """`<streams module name>.` -> the stream this rank holds, for every module sharded with "streams"."""
    return {f"{n}.": m.tp_stream for n, m in model.named_modules() if isinstance(m, nn.ModuleDict) and hasattr(m, "tp_stream")}


def _split_stream(name: str, prefixes: dict[str, int]) -> tuple[str, int, str] | None:
    """(prefix, stream, rest) if `name` is `<prefix><stream>.<rest>` of a streams module, else None."""
    for prefix in prefixes:
        if name.startswith(prefix):
            stream, _, rest = name[len(prefix) :].partition(".")
            return prefix, int(stream), rest
    return None


def _unsharded_names(names: list[str], prefixes: dict[str, int], tp: int) -> list[str]:
    """The names an unsharded model has in place of a rank's `names`, in its order (see above)."""
    out, run, run_prefix = [], [], None
    for name in [*names, None]:
        split = _split_stream(name, prefixes) if name is not None else None
        prefix = split[0] if split else None
        if run and prefix != run_prefix:
            out.extend(f"{run_prefix}{s}.{rest}" for s in range(tp) for rest in run)
            run = []
        run_prefix = prefix
        if split:
            run.append(split[2])
        elif name is not None:
            out.append(name)
    return out


def gather_streams(local: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `local` (same shape on all), in rank order (collective)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return parts


def gather_tensor(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate the shards every rank holds along `dim` (collective: every rank must call it)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def full_state_dict(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a TP-sharded model, on every rank (collective)."""
    dims = _shard_dims(model)
    full = {n: gather_tensor(t, dims[n], group) if n in dims else t for n, t in model.state_dict().items()}
    prefixes = _stream_prefixes(model)
    return _gather_stream_entries(full, prefixes, group) if prefixes else full


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], rank: int, tp: int) -> None:
    """Load an unsharded state dict into a TP-sharded model: each rank keeps its own slice."""
    if prefixes := _stream_prefixes(model):
        state = {n: t for n, t in state.items() if not _other_rank_stream(n, prefixes)}
    dims = _shard_dims(model)
    local = {n: (t.chunk(tp, dim=dims[n])[rank] if n in dims else t) for n, t in state.items()}
    model.load_state_dict(local)


def _gather_stream_entries(state: dict[str, torch.Tensor], prefixes: dict[str, int], group) -> dict[str, torch.Tensor]:
    """`state` with this rank's stream entries replaced by every rank's, in the unsharded order (collective)."""
    gathered = {}
    for n, t in state.items():
        if split := _split_stream(n, prefixes):
            prefix, _, rest = split
            gathered.update({f"{prefix}{r}.{rest}": part for r, part in enumerate(gather_streams(t, group))})
        else:
            gathered[n] = t
    return {n: gathered[n] for n in _unsharded_names(list(state), prefixes, dist.get_world_size(group))}


def _other_rank_stream(name: str, prefixes: dict[str, int]) -> bool:
    split = _split_stream(name, prefixes)
    return split is not None and split[1] != prefixes[split[0]]


def _param_order(model: nn.Module, optimizer) -> list[tuple[str, nn.Parameter]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def full_optimizer_state(model: nn.Module, optimizer, group) -> dict:
    """`optimizer.state_dict()` with every per-parameter state tensor unsharded (collective)."""
    state = optimizer.state_dict()
    for index, (_, p) in enumerate(_param_order(model, optimizer)):
        dim = getattr(p, "tp_shard_dim", None)
        if dim is None or index not in state["state"]:
            continue
        state["state"][index] = {
            k: gather_tensor(v, dim, group) if torch.is_tensor(v) and v.shape == p.shape else v
            for k, v in state["state"][index].items()
        }
    if _stream_prefixes(model):
        state = _gather_stream_optimizer_state(model, optimizer, state, group)
    return state


@torch.no_grad()
def load_full_optimizer_state(model: nn.Module, optimizer, state: dict, rank: int, tp: int) -> None:
    """Inverse of `full_optimizer_state`: slice each unsharded state tensor to this rank's shard."""
    if _stream_prefixes(model):
        state = _own_stream_optimizer_state(model, optimizer, state, tp)
    state = {"state": dict(state["state"]), "param_groups": state["param_groups"]}
    for index, (_, p) in enumerate(_param_order(model, optimizer)):
        dim = getattr(p, "tp_shard_dim", None)
        if dim is None or index not in state["state"]:
            continue
        state["state"][index] = {
            k: v.chunk(tp, dim=dim)[rank].clone() if torch.is_tensor(v) and v.dim() == p.dim() and v.dim() > 0 else v
            for k, v in state["state"][index].items()
        }
    optimizer.load_state_dict(state)


# An optimizer state dict numbers parameters in param-group order; the unsharded model's optimizer has
# every stream's parameters where a rank's has its own stream's (param groups filter the same way).


def _unsharded_param_groups(model: nn.Module, optimizer, tp: int) -> tuple[list[list[str]], dict[str, int]]:
    """Per param group, the parameter names of the unsharded model's optimizer in its order, and each
    name's index in its state dict."""
    names, prefixes = {id(p): n for n, p in model.named_parameters()}, _stream_prefixes(model)
    groups = [_unsharded_names([names[id(p)] for p in g["params"]], prefixes, tp) for g in optimizer.param_groups]
    return groups, {n: i for i, n in enumerate(n for g in groups for n in g)}


def _gather_stream_optimizer_state(model: nn.Module, optimizer, state: dict, group) -> dict:
    """A rank's optimizer state renumbered as the unsharded model's, with every rank's stream states (collective)."""
    tp, prefixes = dist.get_world_size(group), _stream_prefixes(model)
    groups, index = _unsharded_param_groups(model, optimizer, tp)
    full = {}
    for local, (name, p) in enumerate(_param_order(model, optimizer)):
        if local not in state["state"]:
            continue
        entry = state["state"][local]
        if not hasattr(p, "tp_stream"):
            full[index[name]] = entry
            continue
        prefix, _, rest = _split_stream(name, prefixes)
        parts = {k: gather_streams(v, group) if torch.is_tensor(v) else [v] * tp for k, v in entry.items()}
        for r in range(tp):
            full[index[f"{prefix}{r}.{rest}"]] = {k: v[r] for k, v in parts.items()}
    param_groups = [
        {**g, "params": [index[n] for n in names]} for g, names in zip(state["param_groups"], groups, strict=True)
    ]
    return {"state": dict(sorted(full.items())), "param_groups": param_groups}


def _own_stream_optimizer_state(model: nn.Module, optimizer, state: dict, tp: int) -> dict:
    """Inverse of `_gather_stream_optimizer_state`: this rank's entries of an unsharded optimizer state,
    renumbered as its optimizer's (a rank's stream parameters carry their unsharded names)."""
    _, index = _unsharded_param_groups(model, optimizer, tp)
    own = {}
    for local, (name, _) in enumerate(_param_order(model, optimizer)):
        if index[name] in state["state"]:
            own[local] = state["state"][index[name]]
    param_groups, start = [], 0
    for saved, current in zip(state["param_groups"], optimizer.param_groups, strict=True):
        param_groups.append({**saved, "params": list(range(start, start + len(current["params"])))})
        start += len(current["params"])
    return {"state": own, "param_groups": param_groups}


@torch.no_grad()
def grad_norm(model: nn.Module, group) -> torch.Tensor:
    """Global L2 norm of the gradients of a TP-sharded model: sharded parameters (sliced, or a stream held
    by one rank) are summed over the group, replicated ones (identical on every rank) counted once, so
    every rank gets the TP-1 norm."""
    sharded, replicated = [], []
    for p in model.parameters():
        if p.grad is not None:
            is_sharded = hasattr(p, "tp_shard_dim") or hasattr(p, "tp_stream")
            (sharded if is_sharded else replicated).append(p.grad.float().pow(2).sum())
    zero = torch.zeros((), device=next(model.parameters()).device)
    sharded_sq = torch.stack(sharded).sum() if sharded else zero
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sharded_sq, group=group)
    return (sharded_sq + (torch.stack(replicated).sum() if replicated else zero)).sqrt()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, group) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a TP-sharded model (same coefficient on every rank)."""
    total = grad_norm(model, group)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total
