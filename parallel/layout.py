"""Shard layouts: apply a model's declared plan (its `sharding.py`) over every mesh dimension it names.

A plan states one layout per mesh dimension, each mapping module-name patterns to roles:

    PLAN = {"tp": {"model.layers.*.self_attn": "attention", "model.layers.*": "group"}}

`*` stands for one dotted name segment (a layer index). A role is a function `role(name, module, dim)`
found by name in `ROLES`; `parallel.tp` registers the tensor-parallel ones, an architecture registers
its own with `@register_role("...")` in its sharding.py. The generic "group" role hands a module the
process group of the plan's dimension as `<dim>_group` (`tp_group`, `ep_group`, `sp_group`).

Weights stay plain tensors (as gpt-fast does), so the model's forward runs unchanged on local shards.
Every sharded parameter has a `ShardSpec` per mesh dimension it is sharded over, recorded on the module
that owns it (`module._zoo_shards[param_name]`), not on the parameter: modules survive `to_empty()` off
the meta device, `load_state_dict` and optimizer building, while `to_empty` replaces Parameter objects.
`parallel.state` reads these records to gather and re-slice checkpoints and to reduce gradient norms.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from parallel.mesh import DIM_ORDER, mesh_group

# Mesh dimension names of other launchers -> ours. Lightning's ModelParallelStrategy names its mesh
# ("data_parallel", "tensor_parallel").
MESH_DIM_ALIASES = {"data_parallel": "dp", "tensor_parallel": "tp"}


@dataclass(frozen=True)
class MeshDim:
    """One mesh dimension as a role sees it: its name in the plan ("tp", "ep", "sp"), this rank's
    coordinate on it, its size, and its process group."""

    name: str
    rank: int
    size: int
    group: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out over one mesh dimension.

    `tensor_dim` is cut into `size` equal chunks, rank `rank` holding chunk `rank`. `tensor_dim=None`:
    the parameter is held whole by this rank alone, as part of entry `rank` of a ModuleDict keyed
    "0".."size-1" (see `keep_own_entry`); the unsharded model holds every rank's entry.
    """

    mesh_dim: str
    tensor_dim: int | None
    rank: int
    size: int
    group: object = field(default=None, compare=False, repr=False)


ROLES: dict[str, Callable[[str, nn.Module, MeshDim], None]] = {}


def register_role(name: str):
    """Decorator: make `fn(name, module, dim)` the role `name` of shard plans."""

    def add(fn):
        known = ROLES.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"Shard role {name!r} is already registered by {known.__module__}.{known.__qualname__}."
            )
        ROLES[name] = fn
        return fn

    return add


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(what: dict[str, int], degree: int, dim: str = "tp") -> None:
    """One clear error if the degree of mesh dimension `dim` does not divide every size in `what`."""
    for name, n in what.items():
        if n % degree != 0:
            fits = sorted(set.intersection(*(set(_divisors(v)) for v in what.values())))
            raise ValueError(
                f"{dim.upper()} degree {degree} does not divide {name}={n}; "
                f"{dim.upper()} degrees that fit this model: {fits}."
            )


# --- what roles use ------------------------------------------------------------------------------


PARALLEL_NAMES = {"dp": "data", "ep": "expert", "sp": "sequence", "tp": "tensor"}


def check_planned(config, plan: dict, degrees: dict[str, int]) -> None:
    """One clear error for a degree above 1 over a mesh dimension `plan` has no layout for.

    dp replicates every model, so it always fits; ep, sp or tp without a layout would only be data
    parallelism by another name (or wrong). Every architecture's `check_layout` starts with this.
    """
    sharded = [d for d in DIM_ORDER if d in plan]
    for dim in DIM_ORDER:
        degree = degrees.get(dim, 1)
        if dim != "dp" and degree != 1 and dim not in plan:
            raise ValueError(
                f"{config.model_type} has no {PARALLEL_NAMES[dim]}-parallel layout, so {dim}={degree} does not fit; "
                f"{dim.upper()} degrees that fit this model: [1] (it shards over {', '.join(sharded) or 'nothing'}; "
                "dp gives data parallelism to any model)."
            )


def record(module: nn.Module, param_name: str, spec: ShardSpec) -> None:
    """Remember that `module.<param_name>` is sharded as `spec` (after any earlier dimension's spec)."""
    if not hasattr(module, "_zoo_shards"):
        module._zoo_shards = {}
    module._zoo_shards[param_name] = (*module._zoo_shards.get(param_name, ()), spec)


def split_param(module: nn.Module, param_name: str, tensor_dim: int, dim: MeshDim, name: str = "") -> None:
    """Replace `module.<param_name>` (if not None) by this rank's chunk along `tensor_dim`, and record it."""
    param = getattr(module, param_name)
    if param is None:
        return
    n = param.shape[tensor_dim]
    if n % dim.size != 0:
        raise ValueError(
            f"{name}.{param_name} has size {n} along dimension {tensor_dim}, which {dim.size} {dim.name} ranks "
            f"cannot split evenly; the model's check_layout should have refused {dim.name}={dim.size}."
        )
    shard = nn.Parameter(
        param.detach().chunk(dim.size, dim=tensor_dim)[dim.rank].clone(), requires_grad=param.requires_grad
    )
    setattr(module, param_name, shard)
    record(module, param_name, ShardSpec(dim.name, tensor_dim, dim.rank, dim.size, dim.group))


def keep_own_entry(name: str, entries: nn.ModuleDict, dim: MeshDim) -> None:
    """Of a ModuleDict with one entry per rank (keyed "0".."size-1"), rank r keeps entry r whole and drops
    the others. Names stay global (`<name>.<r>....`), so gradients and checkpoints line up with the
    unsharded model's; `parallel.state` gathers every rank's entry back under its own key."""
    if not isinstance(entries, nn.ModuleDict) or set(entries.keys()) != {str(i) for i in range(dim.size)}:
        raise ValueError(
            f"{name} holds {len(entries)} entries but the {dim.name} degree is {dim.size}; this layout needs one "
            f"entry per rank, a ModuleDict keyed 0..{dim.size - 1}."
        )
    for key in [key for key in entries if key != str(dim.rank)]:
        del entries[key]
    spec = ShardSpec(dim.name, None, dim.rank, dim.size, dim.group)
    entries._zoo_owner = spec
    for module in entries.modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param is not None:
                record(module, param_name, spec)


@register_role("group")
def hand_group(name: str, module: nn.Module, dim: MeshDim) -> None:
    """The module communicates itself: its forward calls `parallel.comm` with `<dim>_group`."""
    attr = f"{dim.name}_group"
    if not hasattr(module, attr):
        raise ValueError(
            f"{name} ({type(module).__name__}) has no `{attr}` to receive the {dim.name} group; a module that "
            f"communicates sets `self.{attr} = None` (single device) in __init__ and reads it in forward."
        )
    setattr(module, attr, dim.group)


# --- what parallel.state reads ---------------------------------------------------------------------


def shard_specs(model: nn.Module) -> dict[str, tuple[ShardSpec, ...]]:
    """Parameter name (as in `model.named_parameters()`) -> its specs, for every sharded parameter."""
    specs = {}
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "_zoo_shards", {}).items():
            specs[f"{module_name}.{param_name}" if module_name else param_name] = spec
    return specs


def owned_entries(model: nn.Module) -> dict[str, ShardSpec]:
    """`<name>.` -> spec, for every ModuleDict of which this rank holds its own entry only."""
    return {f"{n}.": m._zoo_owner for n, m in model.named_modules() if hasattr(m, "_zoo_owner")}


# --- applying a plan -----------------------------------------------------------------------------


def _match(pattern: str, name: str) -> bool:
    """`*` stands for one dotted name segment (e.g. a layer index), as in HF `tp_plan`s."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def _check_plan(model: nn.Module, plan: dict) -> None:
    """Fail before any module is touched if the plan names an unknown dimension or role."""
    owner = type(model).__name__
    for dim, layout in plan.items():
        if dim not in DIM_ORDER:
            raise ValueError(
                f"The shard plan of {owner} names mesh dimension {dim!r}; known: {', '.join(DIM_ORDER)}."
            )
        for pattern, role in layout.items():
            if role not in ROLES:
                raise ValueError(
                    f"Unknown shard role {role!r} for {pattern!r} in the {dim} plan of {owner}; known roles: "
                    f"{', '.join(sorted(ROLES))} (an architecture registers its own with parallel.register_role)."
                )


def parallelize(model: nn.Module, mesh, dim: str | None = None) -> nn.Module:
    """Shard `model` in place following its `shard_plan` (its sharding.py).

    Every dimension that the plan names and that `mesh` has with size > 1 is applied, in mesh order
    (outermost first), after `model.check_layout(degrees)` has accepted the mesh's degrees. `dim` (a
    mesh dimension name, ours or an alias such as Lightning's "tensor_parallel") applies that one only.
    """
    plan = getattr(model, "shard_plan", None)
    if plan is None:
        raise ValueError(
            f"{type(model).__name__} declares no shard layout (no `shard_plan` from its sharding.py)."
        )
    _check_plan(model, plan)
    names = list(mesh.mesh_dim_names or ())
    degrees = {MESH_DIM_ALIASES.get(n, n): mesh.size(i) for i, n in enumerate(names)}
    check = getattr(model, "check_layout", None)
    if check is not None:
        check(degrees)
    for mesh_dim in [dim] if dim is not None else names:
        plan_dim = MESH_DIM_ALIASES.get(mesh_dim, mesh_dim)
        if plan_dim not in plan:
            if dim is None:
                continue  # e.g. dp: the model is replicated over it
            raise ValueError(
                f"{type(model).__name__} has no {plan_dim} layout (its plan has {sorted(plan)})."
            )
        # One clear error if `dim` is not in the mesh.
        group = mesh_group(mesh, mesh_dim, needed_by=f"the {plan_dim} layout of {type(model).__name__}")
        size = mesh.size(names.index(mesh_dim))
        if size == 1:
            continue
        _apply(model, plan[plan_dim], MeshDim(plan_dim, mesh.get_local_rank(mesh_dim), size, group))
        setattr(model, f"{plan_dim}_degree", size)  # e.g. `tp_degree`: the trainer applies a layout once
    return model


def _apply(model: nn.Module, layout: dict[str, str], dim: MeshDim) -> None:
    for pattern, role in layout.items():
        # Looked up per pattern: a role may drop modules (another rank's entry) that later patterns must not see.
        modules = dict(model.named_modules())
        matched = [n for n in modules if _match(pattern, n)]
        if not matched:
            raise ValueError(f"Shard layout pattern {pattern!r} of {type(model).__name__} matches no module.")
        for name in matched:
            ROLES[role](name, modules[name], dim)
