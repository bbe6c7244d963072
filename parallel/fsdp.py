"""FSDP2 over the token dimensions, composed with every architecture's tp / ep / sp layout.

Training shards parameters, gradients and optimizer state over the ranks that see different tokens, as
torchtitan composes FSDP2 with its tensor parallelism: `parallel.parallelize(model, mesh)` first (the
architecture's own layout: plain tensors, collectives waited in forward()), then `apply_fsdp(model, mesh)`:

- replicated parameters (everything but the experts) are sharded over the dp x ep x sp ranks, flattened
  into one 1-D mesh (`fsdp_mesh(mesh)`); FSDP's reduce-scatter averages their gradients over those ranks,
  which is the gradient of the mean loss (parallel/grad_sync.py's docstring says why);
- expert weights (sharded over ep by the layout) are sharded over dp x sp only: the all-to-all already
  sums every ep rank's tokens into the owner's gradient, so they must not be averaged over ep. FSDP
  divides them by dp x sp; the missing 1/ep is `scale_expert_gradients` (FSDP's own divide factor needs
  `ReduceOp.PREMUL_SUM`, which gloo lacks);
- one FSDP unit per decoder layer: the layer itself where the architecture calls it as a module (its
  `runs_layers_whole`: the gather and the free wrap the layer's forward, outside a compiled forward, as
  torchtitan's); otherwise the layer's parameter-owning modules as one unit: Ladder and ScMoE call their
  layers' sub-blocks (`attention_block`, `mlp_block`, ...) directly, and Kraken the blocks of its layers'
  streams, never the layer's forward, so hooks on the layer itself would never run (a loud failure: "mixed
  torch.Tensor and DTensor"); hooks on the modules that hold the weights run whichever way the architecture
  reaches them (`unit_modules`; a compiled layer then breaks its graph at them). The root unit holds the
  embedding, the final norm, the head and any parameter a layer owns directly.

Traps this module avoids (each silently wrong, checked on torch 2.13 / gloo): a mesh that includes tp
(`fully_shard(mesh=mesh["dp", "tp"])` is accepted and acts as HSDP over tp), experts inside the dp x ep
group (each rank would gather the other ranks' experts). TP-sharded parameters stay plain TP slices to
FSDP; `parallel.checkpoint` makes both cuts visible to torch.distributed.checkpoint.

`parallel/grad_sync.py` (the replicated trainer's bucketed all-reduce after the backward) serves only
`parallel.fsdp=false`, kept to compare against.
"""

import math
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from parallel.grad_sync import TOKEN_DIMS, mesh_degrees
from parallel.layout import shard_specs

__all__ = ["TOKEN_DIMS", "apply_fsdp", "fsdp_mesh", "is_expert", "scale_expert_gradients"]

def shards_over(degrees: dict[str, int], dims: tuple[str, ...] = TOKEN_DIMS) -> bool:
    """Whether FSDP over `dims` has more than one rank at these degrees (where `fsdp_mesh` gives a mesh)."""
    return math.prod(degrees.get(d, 1) for d in dims) > 1


def fsdp_mesh(mesh, dims: tuple[str, ...] = TOKEN_DIMS):
    """The 1-D mesh FSDP shards over: `dims` of `mesh` flattened (row-major), or None if they are all 1.
    Never includes tp: FSDP over tp ranks (which share their tokens) would average their partial outputs."""
    if "tp" in dims:
        raise ValueError("FSDP shards over token dimensions (dp, ep, sp) only; tp ranks share their tokens.")
    degrees = mesh_degrees(mesh)
    if not shards_over(degrees, dims):
        return None
    used = tuple(d for d in dims if degrees.get(d, 1) > 1)
    if len(used) == 1:
        return mesh[used[0]]
    return mesh[used]._flatten("_".join(used))


def is_expert(specs) -> bool:
    """A parameter sharded over a token dimension by the layout: an expert, split over ep."""
    return any(s.mesh_dim in TOKEN_DIMS for s in specs)


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


def unit_modules(layer: nn.Module, ignored: set[nn.Parameter]) -> list[nn.Module]:
    """The modules of a decoder layer's FSDP unit: every module that owns parameters itself (the linears,
    norms, routers) and is not an FSDP unit already (the experts). Whichever the architecture calls first
    gathers the unit, the last one's end frees it: the layer's own forward may never run (Ladder, ScMoE call
    its sub-blocks; Kraken calls the blocks inside its layer's ModuleDict of streams)."""
    return [
        m
        for m in layer.modules()
        if not isinstance(m, FSDPModule) and any(p not in ignored for p in m.parameters(recurse=False))
    ]


def apply_fsdp(
    model: nn.Module,
    mesh,
    decoder: nn.Module,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> bool:
    """Shard `model` (already `parallelize`d over `mesh`) with FSDP2 over its token dimensions: the experts'
    modules over dp x sp, one unit per decoder layer of `decoder.layers`, the rest at the root. Where the
    decoder calls each layer as a module (its `runs_layers_whole`) the unit is the layer, otherwise the
    layer's parameter-owning modules (`unit_modules`). Returns False (nothing done) when dp x ep x sp is 1."""
    replicated_mesh = fsdp_mesh(mesh)
    if replicated_mesh is None:
        return False
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    specs = shard_specs(model)
    expert_params = {name: p for name, p in model.named_parameters() if is_expert(specs.get(name, ()))}
    expert_mesh = fsdp_mesh(mesh, tuple(d for d in TOKEN_DIMS if d != "ep"))
    # Experts: their own units over dp x sp, or, where dp x sp is 1, left out of FSDP (plain, whole on their ep
    # rank) and ignored by the units above them.
    ignored: set[nn.Parameter] = set()
    if expert_mesh is not None:
        for owner in dict.fromkeys(_owner(model, name) for name in expert_params):
            fully_shard(owner, mesh=expert_mesh, **kwargs)
            # Methods a module is run by besides forward (the padded dispatch's `forward_padded`) gather it too.
            for method in getattr(owner, "fsdp_forward_methods", ()):
                register_fsdp_forward_method(owner, method)
    else:
        ignored = set(expert_params.values())
    whole_layers = getattr(decoder, "runs_layers_whole", True)
    for layer in decoder.layers:
        if whole_layers:  # the hooks around the layer's forward: a compiled forward keeps them outside
            fully_shard(layer, mesh=replicated_mesh, ignored_params=ignored or None, **kwargs)
            continue
        owners = unit_modules(layer, ignored)
        if owners:
            fully_shard(owners, mesh=replicated_mesh, ignored_params=ignored or None, **kwargs)
    # The root's parameters stay gathered from forward to backward (FSDP's default for the root).
    fully_shard(model, mesh=replicated_mesh, ignored_params=ignored or None, **kwargs)
    model._zoo_fsdp = True
    return True


# The experts return their output through an identity autograd Function (a view) that is only ever indexed
# and sent on out of place (models/common/moe.py), so FSDP's warning about in-place ops on views is moot.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGroupedExperts\) returned a view tensor")


def is_fsdp(model: nn.Module) -> bool:
    return getattr(model, "_zoo_fsdp", False)


@torch.no_grad()
def scale_expert_gradients(model: nn.Module, ep: int) -> None:
    """Divide the experts' gradients by the ep degree (FSDP averaged them over dp x sp only; module doc)."""
    if ep == 1:
        return
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        if p.grad is not None and is_expert(specs.get(name, ())):
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            grad.div_(ep)
