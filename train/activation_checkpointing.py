"""Activation checkpointing (none / full / selective) and per-layer `torch.compile`, both applied IN PLACE.

No wrapper module (`checkpoint_wrapper`, `torch.compile(module)` add `_checkpoint_wrapped_module.` / `_orig_mod.`
to parameter names, breaking ShardSpec names and checkpoints): layers keep class and names; instance attributes
change (`layer.forward = ...`, `layer.attention_block = ...`) and `nn.Module.compile()` is called. Order, as
torchtitan's: parallel.parallelize -> apply_activation_checkpointing -> compile_layers -> FSDP2 fully_shard.

UNITS: what `run_layers` calls, found in each `model.model.layers[i]` without naming an architecture. Holders:
the layer, or for a container layer defining none of these methods (Kraken's streams) its descendants that do.
A holder's units: `forward` (if its class defines one), its sub-block methods (`SUB_BLOCKS`, which a trunk
waiting elsewhere calls directly, never `forward`: Ladder's laddered layers, ScMoE) and its class's declared
`checkpoint_methods` ("method" or "child.method": ScMoE's `dispatch_shortcut`, its experts' `forward`). A unit
called inside another runs unwrapped (one region, no nested checkpoint); calls without gradients or with a KV
cache run as they are. Buffers a unit updates (router token counts, drop counters) are restored after its
recomputation: nothing is counted twice.

- "full": units recomputed whole (non-reentrant `checkpoint` without torch's early stop, which could end a
  recomputation before a collective on one rank and after it on another): their collectives are issued again.
  How many per training step, for each architecture's tiny config at its degree 2, is measured and stated in
  tests/test_activation_checkpointing.py (`FULL_REISSUED`); none where a trunk waits its collectives between
  units. A module with an `sp_group` keeps its own activations in a full region (`_KeepActivations`):
  parallel.sequence's LASP backward differentiates graphs of its own, each a graph task that would recompute the region again, a
  rank-dependent number of times (mismatched collectives, a hang).
- "selective": `create_selective_checkpoint_contexts`, saving matmul-like outputs (`SAVED_OPS`), recomputing
  the rest (norms, activations, rotary, routing). No zoo collective in a region: they are autograd Functions
  around in-place async c10d ops, which a recomputation would issue again or (cached) read unfinished. Sub-block
  methods are regions where no module below the holder has a process group (`<dim>_group`, the layouts'
  convention; a sub-block returns its un-reduced partial sum, TP's `copy_to_tp_region` is identity forward),
  `forward` too where the holder has none either; otherwise (or with no sub-block: the parallel block under
  TP) the largest parameter-owning group-free modules below it (projections, norms, MLP, an MoE block's router and experts; not MoE's `ep_group` block, linear
  attention's `sp_group` mixer, GQLA's `tp_group` attention). The policy raises on any collective but FSDP2's
  (its gathers in a region's forward, which it skips when recomputing).

COMPILE (`compile_layers(model, **torch_compile_options)`): `holder.compile()` for calls through `forward`, and
sub-block / declared methods as instance attributes calling one shared compiled function (one graph for all
layers of a structure). A checkpointed unit is traced whole (the checkpoint higher-order op). Eager: MoE blocks
(`models.common.moe.dispatching_blocks`) dispatching "dropless", the training default (counts read off the
device and exchanged by an untraceable collective; fp32 grouped_mm does not compile in torch 2.13): their
`forward` / `dispatch` are `torch.compiler.disable`d and what they hold (experts) is not compiled; and whole
(recomputation alike, so both save the same tensors), with their compiled sub-blocks inside, the checkpointed
units reaching such a block (an MoE layer's `forward`, `dispatch_shortcut`) or holding FSDP2 modules (whose
dynamo-disabled hooks would break the traced region). In "padded" dispatch the MoE blocks are traced too.
"""

import functools
import sys
import threading

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers.cache_utils import Cache

from models.common.moe import dispatching_blocks

MODES = ("none", "full", "selective")
SUB_BLOCKS = ("attention_block", "mlp_block", "shared_expert_block")
KEPT_GROUPS = ("sp_group",)  # modules with one keep their activations inside full regions

SAVED_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        *("mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm", "grouped_mm"),
        *("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu"),
        *("_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"),
    )
    if hasattr(torch.ops.aten, name)
}


class _Nesting(threading.local):
    def __init__(self):  # per thread
        self.depth = 0  # > 0: inside a checkpointed unit (its forward or its recomputation)


_nesting = _Nesting()


def _selective_policy(ctx, op, *args, **kwargs):
    if op.namespace in ("c10d", "_c10d_functional") and not _in_fsdp():
        raise RuntimeError(
            f"Selective activation checkpointing met the collective {op} inside a checkpointed region, whose "
            "recomputation would issue it again or cache an unfinished result. Its module needs a process-group "
            "attribute (`<dim>_group`), which keeps it out of selective regions; or use mode='full'."
        )
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _in_fsdp() -> bool:
    """Called from FSDP2's hooks: its unshard in a region's forward, which FSDP skips when the region is
    recomputed (it composes with hook-based checkpointing: the pre-backward hook unshards)."""
    frame = sys._getframe(2)
    while frame is not None and "torch/distributed/fsdp/" not in frame.f_code.co_filename.replace("\\", "/"):
        frame = frame.f_back
    return frame is not None


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _selective_policy)


class _Replacement:
    """An instance attribute standing in for `owner.<name>`. What it replaced: the instance attribute set before
    (another replacement), else the class's function, looked up at each call (a deepcopy of the module calls its
    own) and given the owner as first argument, never bound: after a graph break dynamo rebuilds a bound method
    as `owner.<name>`, i.e. this replacement again (an endless loop)."""

    def __init__(self, owner: nn.Module, name: str):
        self.owner, self.name = owner, name
        self.replaced = owner.__dict__.get(name)

    def original(self) -> tuple:
        """(function, leading arguments) of what was replaced."""
        if self.replaced is not None:
            return self.replaced, ()
        return getattr(type(self.owner), self.name), (self.owner,)

    def call_original(self, *args, **kwargs):
        fn, lead = self.original()
        return fn(*lead, *args, **kwargs)


class _Checkpointed(_Replacement):
    """A unit: its call runs under `checkpoint` (selective with a `context_fn`)."""

    def __init__(self, owner: nn.Module, name: str, context_fn=None):
        super().__init__(owner, name)
        self.context_fn = context_fn

    def __call__(self, *args, **kwargs):
        if _nesting.depth or not torch.is_grad_enabled() or _holds_cache(args, kwargs):
            return self.call_original(*args, **kwargs)
        if not torch.compiler.is_compiling():
            return self.checkpointed(*args, **kwargs)  # _run keeps the depth
        if any(isinstance(m, FSDPModule) for m in self.owner.modules()):
            # FSDP2's hooks on the modules inside (dynamo-disabled) would break the traced region: eagerly, whole.
            return _eagerly(self.checkpointed, *args, **kwargs)
        # Traced: the body may not change the depth, so it is raised around it for the units nested in it. No
        # try/finally: dynamo cannot break a graph inside one, and would give up on this code for every unit.
        _nesting.depth += 1
        out = self.checkpointed(*args, **kwargs)
        _nesting.depth -= 1
        return out

    def checkpointed(self, *args, **kwargs):
        options = {"early_stop": False} if self.context_fn is None else {"context_fn": self.context_fn}
        fn, lead = self.original()
        body = functools.partial(_run, fn, lead, self.owner, [0])
        return checkpoint(body, *args, use_reentrant=False, **options, **kwargs)


@torch.compiler.disable
def _eagerly(fn, *args, **kwargs):
    """`fn` with dynamo off, except in functions compiled explicitly (called alike when a checkpoint recomputes,
    which torch runs with dynamo off: a body dynamo compiled in the forward only would save other tensors)."""
    return fn(*args, **kwargs)


def _run(fn, lead: tuple, owner: nn.Module, calls: list, *args, **kwargs):
    """A unit's body: its forward (first call) or its recomputation in the backward (later calls)."""
    if torch.compiler.is_compiling():
        return fn(*lead, *args, **kwargs)
    recompute, calls[0] = calls[0] > 0, calls[0] + 1
    # Outside selective checkpointing's dispatch mode, which must see the forward's ops and no others.
    with _disable_current_modes(), torch.no_grad():
        buffers = [(b, b._version, b.clone()) for b in owner.buffers()] if recompute else []
    _nesting.depth += 1
    try:
        return fn(*lead, *args, **kwargs)
    finally:
        _nesting.depth -= 1
        with _disable_current_modes(), torch.no_grad():
            for buffer, version, value in buffers:
                if buffer._version != version:  # updated by the recomputation: back to what the forward left
                    buffer.copy_(value)


class _KeepActivations(_Replacement):
    """A sequence-parallel mixer's `forward` inside a full region: what it saves for the backward is kept, not
    left to the region's recomputation (module docstring); the region still recomputes it."""

    def __init__(self, owner: nn.Module):
        super().__init__(owner, "forward")

    def __call__(self, *args, **kwargs):
        if not _nesting.depth or torch.compiler.is_compiling():
            return self.call_original(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            return self.call_original(*args, **kwargs)


def _keep(tensor):
    return tensor


def _holds_cache(args, kwargs) -> bool:
    return any(isinstance(a, Cache) for a in (*args, *kwargs.values()))


# --- which callables are units -----------------------------------------------------------------------


def _defines_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _methods(module: nn.Module) -> list[str]:
    """The unit names a module's class gives: forward, its sub-blocks, its declared `checkpoint_methods`."""
    cls = type(module)
    names = ["forward"] if _defines_forward(module) else []
    names += [name for name in SUB_BLOCKS if callable(getattr(cls, name, None))]
    return names + [name for name in getattr(cls, "checkpoint_methods", ()) if name not in names]


def _holders(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    if _methods(module):
        return [(prefix, module)]
    return [h for name, child in module.named_children() for h in _holders(child, f"{prefix}.{name}")]


def _resolve(holder: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(owner module, method name) of a unit name: "attention_block", or "mlp.experts.forward"."""
    path, _, method = name.rpartition(".")
    return (holder.get_submodule(path) if path else holder), method


def _group_free(module: nn.Module) -> bool:
    return not any(k.endswith("_group") and v is not None for m in module.modules() for k, v in vars(m).items())


def _selective_regions(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module, str]]:
    """The largest parameter-owning modules below `module` that hold no group, each as its forward."""
    found = []
    for name, child in module.named_children():
        if next(child.parameters(), None) is None:
            continue
        if _group_free(child) and _defines_forward(child):
            found.append((f"{prefix}.{name}", child, "forward"))
        else:
            found += _selective_regions(child, f"{prefix}.{name}")
    return found


def _units(model: nn.Module, mode: str) -> list[tuple[str, nn.Module, str]]:
    """(dotted name, owner module, method name) of every callable `mode` wraps."""
    units = []
    for i, layer in enumerate(model.model.layers):
        for prefix, holder in _holders(layer, f"model.layers.{i}"):
            names = _methods(holder)
            if mode == "selective" and not _group_free(holder):
                names = [name for name in names if name != "forward"]  # it issues the holder's collectives
                if not names or not all(_group_free(child) for child in holder.children()):
                    units += _selective_regions(holder, prefix)
                    continue
            units += [(f"{prefix}.{name}", *_resolve(holder, name)) for name in names]
    return units


def checkpoint_units(model: nn.Module, mode: str) -> list[str]:
    """Dotted names of the callables `apply_activation_checkpointing(model, mode)` wraps
    ("model.layers.0.attention_block", "model.layers.1.mlp.router.forward", ...)."""
    _check_mode(mode)
    return [] if mode == "none" else [name for name, _, _ in _units(model, mode)]


def _check_mode(mode) -> None:
    if mode not in MODES:
        raise ValueError(
            f"activation checkpointing mode={mode!r} is not one of {MODES}: 'none' (keep every activation), "
            "'full' (recompute each decoder layer's units whole) or 'selective' (keep matmul outputs, recompute "
            "the rest)."
        )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint `model`'s decoder layers IN PLACE (module docstring): after `parallel.parallelize`, before
    `compile_layers` and FSDP's `fully_shard`. Parameter, state-dict and ShardSpec names do not change."""
    _check_mode(mode)
    if mode == "none":
        return
    if getattr(model, "_zoo_activation_checkpointing", None):
        raise ValueError(
            f"Activation checkpointing is already applied to this model "
            f"(mode={model._zoo_activation_checkpointing!r}); apply it once, to a freshly built model."
        )
    if getattr(model, "_zoo_compiled_layers", False):
        raise ValueError("Apply activation checkpointing before compile_layers, whose compiled code holds the units.")
    for _, owner, method in _units(model, mode):
        setattr(owner, method, _Checkpointed(owner, method, _SELECTIVE if mode == "selective" else None))
    if mode == "full":
        for module in model.model.layers.modules():
            if _defines_forward(module) and any(getattr(module, g, None) is not None for g in KEPT_GROUPS):
                module.forward = _KeepActivations(module)
    model._zoo_activation_checkpointing = mode


# --- compile -----------------------------------------------------------------------------------------


class _EagerWhenDropless(_Replacement):
    """A callable reaching an MoE block (the block's entry points; a checkpointed unit holding one): eager, the
    whole call (a graph break before it), while `block` dispatches "dropless"; traced in "padded" (read at each
    call: `set_moe_dispatch` keeps working)."""

    def __init__(self, owner: nn.Module, name: str, block: nn.Module):
        super().__init__(owner, name)
        self.block = block

    def __call__(self, *args, **kwargs):
        if self.block.moe_dispatch == "padded":
            return self.call_original(*args, **kwargs)
        return _eagerly(self.call_original, *args, **kwargs)


class _CompiledMethod(_Replacement):
    """`owner.<name>` through `compiled`, one compiled function for all layers taking the method and module as
    arguments: a closure per layer would recompile per layer, and past dynamo's recompile limit run eagerly."""

    def __init__(self, owner: nn.Module, name: str, compiled):
        super().__init__(owner, name)
        self.compiled = compiled

    def __call__(self, *args, **kwargs):
        fn, lead = self.original()
        return self.compiled(fn, lead, *args, **kwargs)


def _invoke(fn, lead: tuple, *args, **kwargs):
    return fn(*lead, *args, **kwargs)


def compile_layers(model: nn.Module, **options) -> None:
    """Compile `model`'s decoder layers IN PLACE for training (module docstring); `options` go to
    `torch.compile` (backend, mode, ...). After `apply_activation_checkpointing`, before FSDP's `fully_shard`."""
    if getattr(model, "_zoo_compiled_layers", False):
        raise ValueError("compile_layers was already applied to this model; apply it once.")
    eager_blocks = dispatching_blocks(model.model.layers)
    inside_eager = {id(m) for block in eager_blocks for m in block.modules()}
    for block in eager_blocks:
        for name in ("forward", "dispatch"):
            if callable(getattr(type(block), name, None)):
                setattr(block, name, _EagerWhenDropless(block, name, block))
    compiled = torch.compile(_invoke, **options)
    for i, layer in enumerate(model.model.layers):
        for _, holder in _holders(layer, f"model.layers.{i}"):
            if _defines_forward(holder):
                holder.compile(**options)
            held = [block for block in eager_blocks if any(block is m for m in holder.modules())]
            for name in _methods(holder):
                owner, method = _resolve(holder, name)
                if id(owner) in inside_eager:
                    continue
                if held and name not in SUB_BLOCKS and isinstance(owner.__dict__.get(method), _Checkpointed):
                    # forward / a declared method of a holder with an MoE block reaches it (a sub-block is, by
                    # the contract of sub-blocks, the part around it): its checkpoint would not trace.
                    setattr(owner, method, _EagerWhenDropless(owner, method, held[0]))
                elif method == "forward" and owner is not holder:
                    owner.compile(**options)
                elif method != "forward":
                    setattr(owner, method, _CompiledMethod(owner, method, compiled))
    model._zoo_compiled_layers = True
