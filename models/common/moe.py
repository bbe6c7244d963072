"""Mixture-of-experts layer shared by `moe`, `scmoe` and `moepp`: the block that composes router, experts and
dispatch, and the choice of its dispatch.

One implementation for the three architectures (moe, scmoe, moepp); torchtitan's MoE was read for the facts. Its
parts, one module each (every name below is importable from here too):

- models/common/moe_routing.py: `TopKRouter`, the `Routing` it returns, `routing_dtype`, the balance losses
  (`load_balance_loss`, `balance_statistics`, `hf_load_balance_loss`; conventions `AUX_LOSS_STYLES`) and
  DeepSeek-V3's aux-loss-free `update_balance_biases`.
- models/common/moe_experts.py: `GroupedExperts`, E SwiGLU experts as stacked weights (grouped_mm or a loop).
- models/common/moe_dispatch.py: the dispatch / combine all-to-alls over the ep group, `MOE_DISPATCHES`:
  dropless `dispatch` (-> `MoEDispatch`: `.compute()`, `.combine()`; `capacity`) and padded
  `dispatch_padded` (-> `PaddedDispatch`; every size known on the host; `padded_capacity`).

Here:

- Selecting the dispatch: `MOE_DISPATCHES` = ("dropless", "padded"); an MoE block (`SparseMoE`, MoE++'s
  layer) keeps `moe_dispatch` and `dispatch_capacity_factor` (from the config fields of the same names,
  checked by `check_moe_dispatch`; models/common/moe_config.py), and `set_moe_dispatch(model, mode,
  capacity_factor=None)` (also the models' `model.set_moe_dispatch(...)`) switches every block of a model
  and its config at run time: dropless to train, padded to decode. Each block counts the assignments its
  padded dispatches dropped in a non-persistent buffer `dropped_assignments` (a 0-d int64 tensor, added to
  in forward on the device); `dropped_assignments(model, reset=False) -> int` sums this rank's over the
  model's blocks (one host read, after the step) and `reset=True` zeroes them. In padded mode a block with
  a `capacity_factor` (the dropless path's cap) sends at most min(that cap, C) rows per expert, the same
  first-in-assignment-order rule, and the drops are counted too. Under torch.compile, an inference forward
  (no grad: HF's `model.forward = torch.compile(model.forward, fullgraph=True)` recipe for generate()) of a
  dropless block runs the padded dispatch with C = the rank's tokens, which drops nothing and equals dropless
  (`dispatch_now`); over an expert-parallel group that is refused in one sentence naming
  `model.set_moe_dispatch("padded")` (`TRACED_EP_DROPLESS`; generate() says it before any work).
- `SparseMoE(hidden_size, intermediate_size, num_experts, top_k, ...)`: router + experts with
  `forward(x [B, T, d]) -> (y, aux)`: route, dispatch, compute and combine at once (the vanilla MoE
  schedule); `aux` = {"load_balance": aux_loss_coef * balance loss} in training mode, {} otherwise.
  Its steps, for an architecture that places the waits itself (ScMoE): `dispatch(x [T, d]) -> (pending,
  routing)` (routed with the block's capacity, the all-to-all issued), then `pending.compute()`,
  `pending.combine()`, and `balance_loss(routing)` (unweighted; None outside training).
  `ep_group` is None on one device and set by the expert-parallel layout. `moe_dispatch="padded"` (with
  `dispatch_capacity_factor`) routes through `dispatch_padded` instead, in `dispatch` and `forward` alike.

Expert parallelism (parallel/ep.py, "experts" role): rank r of P keeps experts [r E/P, (r+1) E/P) of a
`GroupedExperts` (`num_experts` stays the global E, `num_local_experts` becomes E/P) and its MoE block gets
`ep_group`. Every ep rank feeds its own tokens. The gradient of an expert on its owner is the sum over
every ep rank's loss (the all-to-all's backward brings it there); `parallel.grad_sync` divides it by P
and averages replicated parameters over ep, which together give the one-process gradient of the mean loss.

Weights: `init_moe_weights(module, std, residual_scale)` initialises what `ZooPreTrainedModel._init_weights`
does not know (the stacked expert weights, the router's buffers); an MoE architecture calls it from its
`_init_weights`.
"""

import torch
from torch import nn
from transformers import initialization as init

from models.common.moe_dispatch import (
    MOE_DISPATCHES,
    MoEDispatch,
    PaddedDispatch,
    _group_size,
    balanced_counts,
    capacity,
    check_moe_dispatch,
    dispatch,
    dispatch_padded,
    padded_capacity,
)
from models.common.moe_experts import EXPERT_IMPLS, WIDTH_MULTIPLE, GroupedExperts, check_expert_widths
from models.common.moe_routing import (
    AUX_LOSS_STYLES,
    SCORE_FUNCS,
    Routing,
    TopKRouter,
    balance_statistics,
    check_top_k,
    count_per_index,
    hf_load_balance_loss,
    load_balance_loss,
    routing_dtype,
    take,
    update_balance_biases,
)

# Every public MoE name, importable from here: the parts' (imported above) and this module's own.
__all__ = [
    "AUX_LOSS_STYLES",
    "EXPERT_IMPLS",
    "MOE_DISPATCHES",
    "SCORE_FUNCS",
    "TRACED_EP_DROPLESS",
    "WIDTH_MULTIPLE",
    "GroupedExperts",
    "MoEDispatch",
    "MoeDispatchMixin",
    "PaddedDispatch",
    "Routing",
    "SparseMoE",
    "TopKRouter",
    "balance_statistics",
    "balanced_counts",
    "capacity",
    "check_expert_widths",
    "check_moe_dispatch",
    "check_top_k",
    "count_per_index",
    "dispatch",
    "dispatch_now",
    "dispatch_padded",
    "dispatching_blocks",
    "dropped_assignments",
    "hf_load_balance_loss",
    "init_moe_weights",
    "load_balance_loss",
    "padded_capacity",
    "routing_dtype",
    "set_moe_dispatch",
    "take",
    "update_balance_biases",
]


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (Mixtral's sparse MoE block); the vanilla schedule: everything at once."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        renormalize: bool = True,
        balance_bias: bool = False,
        aux_loss_coef: float = 0.01,
        capacity_factor: float | None = None,
        impl: str = "grouped_mm",
        moe_dispatch: str = "dropless",
        dispatch_capacity_factor: float | None = None,
        aux_loss_style: str = "zoo",
    ):
        super().__init__()
        if aux_loss_style not in AUX_LOSS_STYLES:
            raise ValueError(f"router_aux_loss_style={aux_loss_style!r} must be one of {AUX_LOSS_STYLES}.")
        self.aux_loss_style = aux_loss_style
        self.router = TopKRouter(hidden_size, num_experts, top_k, score_func, renormalize, balance_bias)
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, impl)
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef = aux_loss_coef
        self.capacity_factor = capacity_factor
        check_moe_dispatch(moe_dispatch, dispatch_capacity_factor)
        self.moe_dispatch, self.dispatch_capacity_factor = moe_dispatch, dispatch_capacity_factor
        # Assignments the padded dispatch dropped (over its capacity), on the device: `dropped_assignments`.
        self.register_buffer("dropped_assignments", torch.zeros((), dtype=torch.long), persistent=False)
        self.ep_group = None  # set by parallel.parallelize; None = every expert on this device

    @classmethod
    def from_config(cls, config, **extra) -> "SparseMoE":
        """The MoE block of an MoE config (models/common/moe_config.py): E = `num_local_experts` experts
        `intermediate_size` wide, top `num_experts_per_tok`, and the config's balance-loss weight, capacity,
        experts implementation and dispatch; `extra`: the router options an architecture sets itself."""
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            aux_loss_coef=config.router_aux_loss_coef,
            capacity_factor=config.capacity_factor,
            impl=config.experts_impl,
            moe_dispatch=config.moe_dispatch,
            dispatch_capacity_factor=config.dispatch_capacity_factor,
            **extra,
        )

    def dispatch(self, x: torch.Tensor) -> tuple[MoEDispatch | PaddedDispatch, Routing]:
        """Route x [T, d] and ISSUE its dispatch all-to-all (over `ep_group`), with this block's capacity and
        dispatch (`moe_dispatch`: dropless, or padded, whose drops are added to `dropped_assignments`).

        Returns (pending, routing): `pending.compute()` waits the dispatch, runs this rank's experts and
        issues the combine; `pending.combine()` waits the combine and gives sum_i g_i E_i(x), [T, d]. The
        steps of `forward`, for an architecture that places the waits itself (ScMoE)."""
        routing = self.router(x)
        cap = None
        if self.capacity_factor is not None:
            cap = capacity(x.shape[0], self.num_experts, self.top_k, self.capacity_factor)
        mode, factor = dispatch_now(self)
        if mode == "padded":
            c = padded_capacity(x.shape[0], self.num_experts, self.top_k, factor)
            pending = dispatch_padded(x, routing, self.experts, self.ep_group, c if cap is None else min(c, cap))
            self.dropped_assignments += pending.dropped
            return pending, routing
        return dispatch(x, routing, self.experts, self.ep_group, cap), routing

    def balance_loss(self, routing: Routing) -> torch.Tensor | None:
        """The load-balance loss of `routing` (over the ep group's tokens), not yet weighted by
        `aux_loss_coef`; None outside training or with the loss off."""
        if not (self.training and self.aux_loss_coef > 0):
            return None
        return load_balance_loss(routing.probs, routing.expert_idx, self.num_experts, group=self.ep_group)

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`token_mask` [B, T] (1: a token, 0: padding) is read by the "hf" balance loss only: its aux is
        {"balance_statistics": ...} (unweighted), which the model pools over its layers."""
        shape = x.shape
        pending, routing = self.dispatch(x.reshape(-1, shape[-1]))  # all-to-all issued
        pending.compute()  # waits the dispatch; local experts; combine issued
        y = pending.combine()  # waits the combine: nothing runs between its issue and its wait
        return y.view(shape), self.aux(routing, token_mask)

    def issue(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple["CombineInFlight", dict]:
        """`forward` up to its last collective: route, dispatch (waited), this rank's experts, the combine ISSUED.
        Returns (pending, aux): `pending.wait()` waits the combine and gives the block's output, shaped as x. For
        a schedule that waits the combine later (the ladder residual schedule)."""
        shape = x.shape
        pending, routing = self.dispatch(x.reshape(-1, shape[-1]))  # all-to-all issued
        pending.compute()  # waits the dispatch; local experts; combine issued
        return CombineInFlight(pending, shape), self.aux(routing, token_mask)

    def aux(self, routing: Routing, token_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The block's auxiliary loss of `routing`: {"load_balance": weighted loss} ("zoo"), {"balance_statistics":
        ...} ("hf", pooled over the layers by the model), or {} outside training or with the loss off."""
        if self.aux_loss_style == "hf":
            if not (self.training and self.aux_loss_coef > 0):
                return {}
            stats = balance_statistics(routing.probs, routing.expert_idx, self.num_experts, token_mask, self.ep_group)
            return {"balance_statistics": stats}
        balance = self.balance_loss(routing)
        return {} if balance is None else {"load_balance": self.aux_loss_coef * balance}


class CombineInFlight:
    """An MoE block's output whose combine all-to-all is in flight; `wait()` waits it: sum_i g_i E_i(x), as x."""

    def __init__(self, pending, shape: torch.Size):
        self.pending, self.shape = pending, shape

    def wait(self) -> torch.Tensor:
        return self.pending.combine().view(self.shape)


def init_moe_weights(module: nn.Module, std: float, residual_scale: float = 1.0) -> None:
    """Initialise what the zoo's generic `_init_weights` does not know: stacked experts (N(0, std); the
    down projection feeds the residual stream, so times `residual_scale` as for dense MLPs) and the router's
    buffers (non-persistent ones must be rebuilt after loading on the meta device)."""
    if isinstance(getattr(module, "dropped_assignments", None), torch.Tensor):  # an MoE block's drop counter
        init.zeros_(module.dropped_assignments)
    if isinstance(module, GroupedExperts):
        init.normal_(module.gate_proj, mean=0.0, std=std)
        init.normal_(module.up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std * residual_scale)
    elif isinstance(module, TopKRouter) and module.balance_bias:
        init.zeros_(module.expert_bias)
        init.zeros_(module.tokens_per_expert)


# --- choosing the dispatch -----------------------------------------------------------------------------


def dispatching_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks of `model` that choose their dispatch (`moe_dispatch`) and count its drops."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "moe_dispatch") and isinstance(getattr(m, "dropped_assignments", None), torch.Tensor)
    ]


def dispatch_now(block: nn.Module) -> tuple[str, float | None]:
    """(mode, padded capacity factor) of the dispatch `block` runs in this forward: its own (`moe_dispatch`,
    `dispatch_capacity_factor`), except when torch.compile traces an inference forward (no grad: generate(),
    HF's `model.forward = torch.compile(model.forward, fullgraph=True)` recipe, an evaluation). The dropless
    dispatch reads its counts on the host, which a traced graph cannot hold, so there the block takes the
    padded dispatch with C = the rank's tokens: a token picks an expert at most once, so nothing is dropped and
    the output equals dropless (a block's dropless `capacity_factor` cap still applies, by the same rule, its
    drops counted in `dropped_assignments` as in padded mode). On an expert-parallel group that needs every rank
    to feed the same token count, which only the caller knows: it is refused in one sentence. Eager forwards and
    traced training steps (with grad; in compiled layers the dropless dispatch is `torch.compiler.disable`d,
    train/activation_checkpointing.py) keep the block's own dispatch."""
    mode, factor = block.moe_dispatch, block.dispatch_capacity_factor
    if mode == "padded" or torch.is_grad_enabled() or not torch.compiler.is_compiling():
        return mode, factor
    if _group_size(block.ep_group) > 1:
        raise RuntimeError(TRACED_EP_DROPLESS)
    return "padded", None


# The one case `dispatch_now` cannot choose for the caller (also said by `generate()` before any work).
TRACED_EP_DROPLESS = (
    "The dropless MoE dispatch reads its token counts on the host, which a compiled graph cannot hold, and over an "
    "expert-parallel group the padded one needs every rank to feed the same number of tokens: call "
    'model.set_moe_dispatch("padded") before compiling (each rank then sends C = its token count rows to every '
    "expert, nothing dropped)."
)


def check_split_capacity(block: nn.Module, schedule: str) -> None:
    """Refuse a split of the forward (the token_split / seq_split overlap schedules) on an MoE block with a capacity:
    its capacity is computed from the tokens one forward routes, so two halves would drop other assignments than
    the whole forward."""
    mode, factor = dispatch_now(block)
    if block.capacity_factor is not None or (mode == "padded" and factor is not None):
        raise ValueError(
            f"overlap={schedule} splits the forward in two halves, and this MoE block's capacity (capacity_factor="
            f"{block.capacity_factor}, moe_dispatch={mode!r} with dispatch_capacity_factor={factor}) is computed from "
            "the tokens of one forward, so each half would drop other assignments than the whole forward does; run it "
            "dropless (capacity_factor=None) or padded without a capacity factor (C = the tokens: nothing dropped)."
        )


def set_moe_dispatch(model: nn.Module, mode: str, capacity_factor: float | None = None) -> nn.Module:
    """Switch every MoE block of `model` to the dispatch `mode` ("dropless" | "padded"), the padded one with
    `capacity_factor` (None: C = T, never drops), and record both in `model.config` (`moe_dispatch`,
    `dispatch_capacity_factor`) where it has them. Returns `model`. A compiled model recompiles."""
    check_moe_dispatch(mode, capacity_factor)
    blocks = dispatching_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block whose dispatch could be set (moe, scmoe, moepp).")
    for block in blocks:
        block.moe_dispatch, block.dispatch_capacity_factor = mode, capacity_factor
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "moe_dispatch"):
        config.moe_dispatch, config.dispatch_capacity_factor = mode, capacity_factor
    return model


def dropped_assignments(model: nn.Module, reset: bool = False) -> int:
    """Assignments this rank's padded dispatches dropped (over their capacity), summed over `model`'s MoE
    blocks since they were built or last reset: one device-to-host read, to make after a step (sum it over
    the ep group for the whole batch's). `reset=True` zeroes the counters."""
    blocks = dispatching_blocks(model)
    total = int(torch.stack([b.dropped_assignments for b in blocks]).sum()) if blocks else 0
    if reset:
        for block in blocks:
            block.dropped_assignments.zero_()
    return total


class MoeDispatchMixin:
    """`model.set_moe_dispatch(mode, capacity_factor=None)` and `model.dropped_assignments(reset=False)` for
    an MoE architecture's models (the functions of the same names)."""

    def set_moe_dispatch(self, mode: str, capacity_factor: float | None = None):
        return set_moe_dispatch(self, mode, capacity_factor)

    def dropped_assignments(self, reset: bool = False) -> int:
        return dropped_assignments(self, reset)

    def check_compiled_generate(self) -> None:
        """`generate()` with a compiled forward (models/common/causal_lm.py asks before any work): refused in
        one sentence where a block could not choose a traceable dispatch itself (`dispatch_now`: dropless over an
        expert-parallel group)."""
        for block in dispatching_blocks(self):
            if block.moe_dispatch != "padded" and _group_size(block.ep_group) > 1:
                raise ValueError(TRACED_EP_DROPLESS)
