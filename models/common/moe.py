"""Mixture-of-experts layer shared by `moe`, `scmoe` and `moepp`: router, grouped experts, dispatch / combine.

One implementation for the three architectures (specs/moe.md); torchtitan's MoE was read for the facts.

- `TopKRouter(hidden_size, num_experts, top_k, score_func="softmax"|"sigmoid", renormalize=True,
  balance_bias=False)`: `self.gate` is the router linear (d -> E, no bias). In `routing_dtype` (fp32, fp64
  in a float64 model): logits = gate(x)
  (+ `extra_logits`, MoE++'s gating residual), scores = softmax or sigmoid, top-k, gates = the chosen
  scores, renormalised to sum to 1 (Mixtral). `balance_bias=True` is DeepSeek-V3's auxiliary-loss-free
  balancing: experts are chosen on scores + `expert_bias` (a buffer, saved with the weights), gates come
  from the scores alone; in training mode the router counts its tokens per expert, and
  `update_balance_biases(model, coeff=1e-3, groups=(ep and dp groups))`, called after each optimizer step,
  sums those counts over the groups and moves every bias by coeff * sign(mean load - load), re-centred.
- `Routing`: what the router returns. `token_idx`, `expert_idx`, `gates` [A] (A = T * k assignments,
  token-major: assignment t*k + j is token t's j-th choice), `probs` [T, E] (softmax scores; sigmoid scores
  normalised per token), `logits` [T, E]. `routing.select(keep)` keeps a subset of the assignments (MoE++
  drops those of its zero-computation experts before dispatch); `probs` / `logits` stay whole.
- `load_balance_loss(probs, expert_idx, num_experts, weights=None, group=None)`: E * sum_i eta_i f_i P_i
  (Switch / Mixtral), f_i = fraction of the assignments that chose expert i, P_i = mean router probability
  of expert i, eta = `weights` (default 1). 1 when perfectly balanced. With `group` (ep) the counts and
  probability sums are summed over the ranks first, so every ep rank gets the loss of the concatenated
  batch (see `_sum_over_ranks` for its gradient).
- Balance-loss conventions (`AUX_LOSS_STYLES`; beside the formulas below). "zoo" (the default of every MoE
  architecture): per MoE layer E * sum_i f_i P_i with f_i the fraction of the T k ASSIGNMENTS (so f sums to
  1 and a balanced router gives 1), every token counted (padding included), the mean over MoE layers,
  times router_aux_loss_coef (0.01, as Switch / MoE++). "hf" (`router_aux_loss_style="hf"` in the moe
  config): transformers' `load_balancing_loss_func` (Mixtral, Qwen-MoE, ...): f_i counted PER TOKEN (f sums
  to k: balanced gives k, so per layer it is k times the zoo's), the layers POOLED (counts and probability
  sums added over the layers, each divided by the total token count, then one product: not the mean of the
  per-layer products), padding left out (attention_mask), times router_aux_loss_coef (Mixtral's default
  0.001; transformers adds it only with output_router_logits=True). `balance_statistics` gives a layer's
  (counts, probability sums, tokens) and `hf_load_balance_loss` pools them. Both count the experts the
  router actually chose (with a balance bias those differ from the top-k of the probabilities, which is what
  transformers' function recomputes; without one they are the same).
- `GroupedExperts(num_experts, hidden_size, intermediate_size, impl="grouped_mm")`: E SwiGLU experts as
  stacked weights laid out as nn.Linear weights, expert e's `gate_proj[e]` / `up_proj[e]` [f, d] and
  `down_proj[e]` [d, f] (so a dense MLP's weights copy in unchanged: upcycling). `forward(x_sorted [N, d],
  counts [E_local])` runs expert e on its run of rows with `torch.nn.functional.grouped_mm` over int32
  offsets (fp32 / bf16 / fp16, eager); a loop over experts where grouped_mm cannot run (fp64, fp32 under
  torch.compile) or with `impl="loop"`. grouped_mm needs every row to be a multiple of 16 bytes, so
  hidden_size and intermediate_size must be multiples of 8 (8 bf16 values; `check_expert_widths`).
  `forward_padded(x [E_local, N, d])`: the same experts on N rows each, a batched matmul (the padded
  dispatch's fixed shape; any dtype, compiles).
- `dispatch(x [T, d], assignments, experts, ep_group=None, capacity=None) -> MoEDispatch`, then
  `.compute()`, then `.combine() -> [T, d]`: the three steps of an MoE layer split so that an architecture
  places each wait where it wants (ScMoE overlaps them with its dense block):
  * `dispatch`: a stable argsort of the expert ids gathers the tokens expert by expert; the token counts
    per expert are exchanged over ep (`comm.exchange_splits`, blocking: they size the receive buffer, one
    device-to-host sync); the tokens go out with the uneven `comm.all_to_all`: ISSUED, not waited.
  * `compute()`: waits the dispatch all-to-all, reorders the received (source rank, local expert) runs to
    expert-major order, runs the local experts, and issues the combine all-to-all (not waited).
  * `combine()`: waits the combine all-to-all, weights each returned row by its gate in `routing_dtype`
    and sums a token's rows in a fixed order (no atomics: deterministic on every device); returns x's dtype.
  `assignments` is a `Routing` or any object with `token_idx`, `expert_idx`, `gates` (a subset of a
  routing: MoE++'s FFN experts only; expert ids index `experts`).
  Dropless by default. With `capacity=C` each rank sends at most C assignments to each expert (the first
  C in assignment order, i.e. earlier tokens first; the rest are dropped: the token keeps its other
  experts' output and its residual). C comes from `capacity(num_tokens, num_experts, top_k,
  capacity_factor)` = top_k * ceil(capacity_factor * num_tokens / num_experts) (specs/moe.md) with the
  rank's own token count: every rank feeding the same batch shape gets the same C. Counts are exchanged
  before every all-to-all, so no choice of C can hang one; C bounds each expert's rows (at most P * C).
- `dispatch_padded(x [T, d], assignments, experts, ep_group=None, capacity=None, valid=None) -> PaddedDispatch`
  (then `.compute()`, `.combine()`, as above): the "padded" dispatch, whose every size is known on the host,
  so that no device-to-host copy stops a CUDA graph or `torch.compile(fullgraph=True)` from holding an MoE
  step (low-latency EP kernels such as DeepEP's do the same). Each rank sends exactly C rows to each of the
  E experts: a fixed [E * C, d] buffer, expert e's rows at [e C, (e + 1) C) in assignment order (earlier
  tokens first), padding rows zero, split evenly over the ep ranks (E/P * C rows each: the equal-split
  `comm.all_to_all`, a functional collective under torch.compile). `compute()` runs the local experts as a
  batched matmul on [E/P, P * C, d] (`GroupedExperts.forward_padded`: no counts; a padding row gives 0)
  and sends the rows back the same way; `combine()` gathers each assignment's row back by its fixed index
  (the row it was sent in), weights it by its gate (0 for a dropped one) and sums each token's rows in a
  fixed order as above. `capacity` defaults to T, the rank's token count: a token picks an expert at most
  once, so C = T never drops and padded == dropless (the experts compute E T rows where dropless computes
  k T: the price of fixed sizes, small at decode). `padded_capacity(T, E, top_k, factor)` gives the
  smaller C = ceil(factor * T * top_k / E) (at least 1, at most T). An expert with more than C assignments
  from one rank keeps its first C; the rest are dropped (the token keeps its residual and its other
  experts), and `PaddedDispatch.dropped` counts them on the device (no host read). `valid` [A] (bool)
  marks the assignments to send; the others (MoE++'s zero-computation experts, assignments over MoE++'s
  own capacities) stay in the fixed layout as invalid: no boolean selection, so no data-dependent size,
  and their expert ids are not read. Needs every token to have the same number of assignments (k = A / T,
  token-major as `TopKRouter` gives them, in any order) and every ep rank to feed the same T (C, hence
  the all-to-all's size, is computed on each rank from its own T). On the meta device (the speed
  simulator) it runs as it is, with no value read: the simulator sees the padded buffers' real sizes.
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

import math
from dataclasses import dataclass, replace
from itertools import accumulate

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from models.common.values import has_values
from parallel import comm

SCORE_FUNCS = ("softmax", "sigmoid")
EXPERT_IMPLS = ("grouped_mm", "loop")
MOE_DISPATCHES = ("dropless", "padded")
AUX_LOSS_STYLES = ("zoo", "hf")  # the balance loss's conventions (module docstring)
# grouped_mm reads rows whose byte length is a multiple of 16: 8 values at 2 bytes (bf16 / fp16), which
# also covers fp32's 4. A model's widths must fit every dtype it may be cast to.
WIDTH_MULTIPLE = 8


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing and the expert combine compute in for a model of `dtype`: max(fp32, dtype). fp32 for
    bf16 / fp16 / fp32 models (near-ties between experts must not flip with rounding), fp64 for a float64
    one, so that its parity tests hold to float64's precision (a copy expert's row stays the fp64 input)."""
    return torch.promote_types(dtype, torch.float32)


# --- checks ------------------------------------------------------------------------------------------


def check_top_k(top_k: int, num_experts: int, what: str = "num_experts_per_tok") -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"The number of experts must be a positive integer, got {num_experts!r}.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{what}={top_k!r} experts per token does not fit {num_experts} experts; choose top-k in 1..{num_experts}."
        )


def _nearby_multiples(n: int, m: int) -> str:
    below, above = (n // m) * m, (n // m + 1) * m
    return f"{below} or {above}" if below > 0 else f"{above}"


def check_expert_widths(hidden_size: int, intermediate_size: int, impl: str = "grouped_mm") -> None:
    """One clear error if grouped_mm cannot take experts of these widths (or `impl` is unknown)."""
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"Unknown experts implementation {impl!r}; choose one of {EXPERT_IMPLS}.")
    if impl != "grouped_mm":
        return
    bad = {
        k: v
        for k, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size))
        if v % WIDTH_MULTIPLE
    }
    if bad:
        fits = "; ".join(f"{k} {_nearby_multiples(v, WIDTH_MULTIPLE)}" for k, v in bad.items())
        raise ValueError(
            f"Expert widths {', '.join(f'{k}={v}' for k, v in bad.items())} do not fit grouped_mm, which needs every "
            f"row to be a multiple of 16 bytes (8 bf16 / fp16 values), so widths must be multiples of {WIDTH_MULTIPLE}: "
            f"use {fits} (or experts_impl='loop', a slower per-expert loop)."
        )


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments each rank may send to one expert: top_k * ceil(capacity_factor * num_tokens / num_experts)
    (specs/moe.md). From the rank's token count, which is the same on every rank fed the same batch shape."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be > 0 (None: dropless).")
    return top_k * math.ceil(capacity_factor * num_tokens / num_experts)


def check_moe_dispatch(mode: str, capacity_factor: float | None = None) -> None:
    """One clear error for an MoE dispatch (`moe_dispatch`) or a padded capacity factor that does not fit."""
    if not isinstance(mode, str) or mode not in MOE_DISPATCHES:
        raise ValueError(
            f"moe_dispatch={mode!r} is not an MoE dispatch; choose one of {MOE_DISPATCHES}: 'dropless' (exact, "
            "the all-to-all sized by counts read off the device; the default, for training) or 'padded' (a fixed "
            "capacity per expert, every size known on the host: for decode under CUDA graphs / torch.compile)."
        )
    factor = capacity_factor
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0
    ):
        raise ValueError(
            f"dispatch_capacity_factor={factor!r} must be a finite number > 0 (the padded dispatch's capacity per "
            "expert is then ceil(factor * tokens * top_k / experts)), or None for a capacity of every token (the "
            "padded dispatch never drops)."
        )


def padded_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None = None) -> int:
    """The padded dispatch's rows per (rank, expert): T (`capacity_factor` None: a token picks an expert at
    most once, so nothing is dropped), else ceil(capacity_factor * T * top_k / E), at least 1 and at most T.
    From the rank's own token count: every rank fed the same batch shape gets the same C."""
    check_moe_dispatch("padded", capacity_factor)
    if capacity_factor is None:
        return max(1, num_tokens)
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def balanced_counts(assignments: int, num_experts: int, capacity: int | None = None) -> list[int]:
    """`assignments` spread as evenly as they go over `num_experts` (the first ones get one more), each cut
    to `capacity`: the routing the speed simulator assumes, where the router has no values to choose by."""
    base, extra = divmod(assignments, num_experts)
    counts = [base + (e < extra) for e in range(num_experts)]
    return counts if capacity is None else [min(c, capacity) for c in counts]


def count_per_index(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `index` (torch.bincount without its device-to-host sync on CUDA;
    integer sums, so exact in any order)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


# --- router ------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """The router's decision for T tokens: A assignments (token, expert, gate) and the per-token scores."""

    token_idx: torch.Tensor  # [A] long
    expert_idx: torch.Tensor  # [A] long
    gates: torch.Tensor  # [A] in routing_dtype (fp32; fp64 in a float64 model), as probs and logits
    probs: torch.Tensor  # [T, E], what the balance loss averages
    logits: torch.Tensor  # [T, E], before scoring (MoE++'s gating residual feeds them on)

    def select(self, keep: torch.Tensor, expected: int | None = None) -> "Routing":
        """The assignments where `keep` [A] (bool) is True, in their order; probs and logits unchanged.
        `expected`: how many there are taken to be on the meta device (`take`)."""
        return replace(
            self,
            token_idx=take(self.token_idx, keep, expected),
            expert_idx=take(self.expert_idx, keep, expected),
            gates=take(self.gates, keep, expected),
        )


def take(t: torch.Tensor, keep: torch.Tensor, expected: int | None = None) -> torch.Tensor:
    """`t[keep]`. On the meta device, which has no values to select by, the first `expected` rows: the speed
    simulator's stand-in (eval.simulator.replay) for a selection whose size depends on the routing."""
    if has_values(t):
        return t[keep]
    if expected is None:
        raise ValueError(
            "A selection by a boolean mask has no size on the meta device; pass the expected number of rows "
            "(the load the balance loss aims for) to run this layer in the speed simulator."
        )
    return t[:expected]


class TopKRouter(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        renormalize: bool = True,
        balance_bias: bool = False,
    ):
        super().__init__()
        check_top_k(top_k, num_experts)
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"Unknown router score function {score_func!r}; choose one of {SCORE_FUNCS}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize, self.balance_bias = score_func, renormalize, balance_bias
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if balance_bias:
            # Saved with the weights (it decides the routing); the counts are per optimizer step only.
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor, extra_logits: torch.Tensor | None = None) -> Routing:
        # At least fp32 whatever the model's dtype: near-ties between experts must not flip with rounding.
        dtype = routing_dtype(x.dtype)
        logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        if extra_logits is not None:
            logits = logits + extra_logits.to(dtype)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if self.balance_bias else scores
        expert_idx = choose.topk(self.top_k, dim=-1).indices  # [T, k]
        gates = scores.gather(-1, expert_idx)
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.balance_bias and self.training:
            self.tokens_per_expert += count_per_index(expert_idx.flatten(), self.num_experts)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        num_tokens = x.shape[0]
        token_idx = torch.arange(num_tokens, device=x.device).repeat_interleave(self.top_k)
        return Routing(token_idx, expert_idx.flatten(), gates.flatten(), probs, logits)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor | None = None, coeff: float = 1e-3) -> None:
        """DeepSeek-V3's update: bias_i += coeff * sign(mean load - load_i), then re-centred to mean 0.

        `tokens_per_expert` defaults to the counts gathered since the last update (which are then reset)."""
        if not self.balance_bias:
            raise ValueError("update_bias needs a router built with balance_bias=True.")
        load = (self.tokens_per_expert if tokens_per_expert is None else tokens_per_expert).float()
        if load.sum() > 0:
            self.expert_bias += coeff * torch.sign(load.mean() - load)
            self.expert_bias -= self.expert_bias.mean()
        self.tokens_per_expert.zero_()


@torch.no_grad()
def update_balance_biases(model: nn.Module, coeff: float = 1e-3, groups=()) -> None:
    """Move the balance bias of every aux-loss-free router of `model` (call after each optimizer step).

    `groups`: the process groups whose ranks route different tokens through replicas of these routers (ep,
    dp); their counts are summed first so that every replica moves its bias alike. Not tp: tp ranks route
    the same tokens."""
    for module in model.modules():
        if isinstance(module, TopKRouter) and module.balance_bias:
            load = module.tokens_per_expert.clone()
            for group in groups:
                load = comm.all_reduce(load, group).wait()
            module.update_bias(load, coeff)


def _sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of `x` over the ranks of `group`, whose gradient is the sum of every rank's gradient.

    Each ep rank adds the same global loss, and parallel.grad_sync averages replicated parameters over ep:
    rank r's part of the gradient must therefore be P times what its own loss gives it, which is the sum
    over ranks of the (equal) upstream gradients (Megatron's f before the all-reduce)."""
    return comm.all_reduce(comm.copy_to_tp_region(x, group), group).wait()


def load_balance_loss(
    probs: torch.Tensor,
    expert_idx: torch.Tensor,
    num_experts: int,
    weights: torch.Tensor | None = None,
    group=None,
) -> torch.Tensor:
    """E * sum_i eta_i f_i P_i (module docstring); over the ranks of `group` when given."""
    counts = count_per_index(expert_idx, num_experts).to(probs.dtype)
    sizes = torch.tensor([expert_idx.numel(), probs.shape[0]], dtype=probs.dtype, device=probs.device)
    # One all-reduce: counts and sizes carry no gradient, the probability sums do.
    totals = _sum_over_ranks(torch.cat([counts, sizes, probs.sum(0)]), group)
    counts, (assignments, tokens), prob_sums = (
        totals[:num_experts],
        totals[num_experts : num_experts + 2],
        totals[num_experts + 2 :],
    )
    f = counts / assignments.clamp(min=1)
    p = prob_sums / tokens
    eta = torch.ones_like(f) if weights is None else weights.to(f)
    return num_experts * (eta * f * p).sum()


def balance_statistics(
    probs: torch.Tensor, expert_idx: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """One MoE layer's share of transformers' pooled balance loss: [counts (E), probability sums (E), tokens]
    over the tokens where `token_mask` [T] is true (all by default), summed over the ranks of `group`.
    `expert_idx` [T * k] token-major, as the router gives it."""
    num_tokens = probs.shape[0]
    keep = torch.ones(num_tokens, dtype=probs.dtype, device=probs.device)
    if token_mask is not None:
        keep = token_mask.reshape(num_tokens).to(probs.dtype)
    per_assignment = keep.repeat_interleave(expert_idx.numel() // max(num_tokens, 1))
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device).index_add_(0, expert_idx, per_assignment)
    # counts and tokens carry no gradient, the probability sums do (as load_balance_loss).
    stats = torch.cat([counts, (probs * keep[:, None]).sum(0), keep.sum()[None]])
    return _sum_over_ranks(stats, group)


def hf_load_balance_loss(layer_statistics: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` from each MoE layer's `balance_statistics`: E * sum_i
    (sum_l counts_li / N) (sum_l probs_li / N), N = sum_l tokens_l (module docstring, "hf")."""
    total = torch.stack(layer_statistics).sum(0)
    counts, prob_sums, tokens = total[:num_experts], total[num_experts : 2 * num_experts], total[-1].clamp(min=1)
    return num_experts * ((counts / tokens) * (prob_sums / tokens)).sum()


# --- experts -----------------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """E SwiGLU experts, down(silu(gate(x)) * up(x)), weights stacked along dim 0 (module docstring)."""

    # Run by these methods besides forward (the padded dispatch): FSDP gathers the weights for them too.
    fsdp_forward_methods = ("forward_padded",)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, impl: str = "grouped_mm"):
        super().__init__()
        check_expert_widths(hidden_size, intermediate_size, impl)
        self.num_experts = num_experts  # over all ep ranks
        self.num_local_experts = num_experts  # this rank's: the ep layout divides it
        self.impl = impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """`x` [N, d]: rows sorted by local expert, `counts[e]` rows for expert e (ints or a tensor)."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        if len(counts) != self.gate_proj.shape[0] or sum(counts) != x.shape[0]:
            raise ValueError(
                f"GroupedExperts got counts {counts} for {x.shape[0]} rows and {self.gate_proj.shape[0]} local "
                "experts; it needs one count per local expert, summing to the rows."
            )
        if self._use_loop(x):
            return self._forward_loop(x, counts)
        offsets = torch.tensor(list(accumulate(counts)), dtype=torch.int32, device=x.device)
        gate_w, up_w, down_w = self._weights(x.dtype)
        # grouped_mm computes x @ w[e] per run; nn.Linear-shaped weights [f, d] are read transposed.
        gate = F.grouped_mm(x, gate_w.transpose(-2, -1), offs=offsets)
        up = F.grouped_mm(x, up_w.transpose(-2, -1), offs=offsets)
        out = F.grouped_mm(F.silu(gate) * up, down_w.transpose(-2, -1), offs=offsets)
        return _ContiguousGrad.apply(out)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [E_local, N, d]: N rows for each local expert (the padded dispatch's fixed layout; a zero row
        gives a zero row). One batched matmul chain, [E_local, N, d] out."""
        if x.dim() != 3 or x.shape[0] != self.gate_proj.shape[0]:
            raise ValueError(
                f"GroupedExperts.forward_padded got rows shaped {tuple(x.shape)} for {self.gate_proj.shape[0]} local "
                "experts; it needs [local experts, rows per expert, hidden]."
            )
        gate_w, up_w, down_w = self._weights(x.dtype)
        h = F.silu(torch.bmm(x, gate_w.transpose(-2, -1))) * torch.bmm(x, up_w.transpose(-2, -1))
        return torch.bmm(h, down_w.transpose(-2, -1))

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three weights in the activations' dtype. Where FSDP2's mixed precision casts the model to bf16 but
        leaves the experts out (dp x sp = 1: parallel.fsdp), they stay fp32 while their input is bf16; the cast
        here is autocast's (a bf16 copy for the matmul, the gradient reaching the fp32 weight)."""
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        return tuple(w if w.dtype == dtype or not dtype.is_floating_point else w.to(dtype) for w in weights)

    def _use_loop(self, x: torch.Tensor) -> bool:
        if self.impl == "loop" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return True
        # torch 2.13 cannot compile grouped_mm in fp32.
        return x.dtype == torch.float32 and torch.compiler.is_compiling()

    def _forward_loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The reference: one matmul chain per expert (fallback, and what grouped_mm is tested against)."""
        outs = []
        gate_w, up_w, down_w = self._weights(x.dtype)
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ gate_w[e].T) * (rows @ up_w[e].T)
            outs.append(h @ down_w[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, self.down_proj.shape[1])


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm's backward refuses an expanded
    one (the gradient of `out.sum()`, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


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


# --- dispatch / combine ------------------------------------------------------------------------------


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


@dataclass(eq=False)
class MoEDispatch:
    """An MoE layer's tokens in flight: made by `dispatch`, then `compute()`, then `combine()`."""

    experts: GroupedExperts
    ep_group: object
    ep_size: int
    num_tokens: int  # T, of this rank
    dtype: torch.dtype  # x's, for the combined output
    in_flight: comm.Handle  # the dispatch all-to-all, then the combine all-to-all
    send_splits: list[int]  # rows this rank sends to each ep rank
    recv_splits: list[int]  # rows it receives from each
    expert_counts: list[int]  # rows each local expert receives, over all sources
    gates: torch.Tensor  # [A_kept] routing_dtype(x's), the sent rows' gates, in the order they were sent
    token_idx: torch.Tensor  # [A_kept] the token of each sent row
    slot_idx: torch.Tensor  # [A_kept] its place among that token's assignments
    slots: int  # the most assignments any token has
    expert_major: torch.Tensor | None = None  # received rows -> (local expert, source rank) runs (ep > 1)
    back_to_sources: torch.Tensor | None = None  # its inverse
    stage: str = "dispatched"

    def compute(self) -> None:
        """Wait the dispatch all-to-all, run the local experts, issue the combine all-to-all."""
        if self.stage != "dispatched":
            raise RuntimeError(f"MoEDispatch.compute() runs once, after dispatch; this one is {self.stage}.")
        received = self.in_flight.wait()  # [R, d], runs by (source rank, local expert)
        if self.ep_size > 1:
            # Expert-major order for the grouped matmul: (local expert, source rank) runs.
            received = received[self.expert_major]
        out = self.experts(received, self.expert_counts)
        if self.ep_size > 1:
            out = out[self.back_to_sources]
        # Returned the way the tokens came: splits swapped.
        self.in_flight = comm.all_to_all(out, self.ep_group, self.recv_splits, self.send_splits)
        self.stage = "computed"

    def combine(self) -> torch.Tensor:
        """Wait the combine all-to-all; each token's output = sum of gate * expert output, [T, d] in x's dtype."""
        if self.stage != "computed":
            raise RuntimeError(f"MoEDispatch.combine() runs once, after compute(); this one is {self.stage}.")
        returned = self.in_flight.wait()  # [A_kept, d] in the expert-sorted order of this rank's assignments
        weighted = returned.to(self.gates.dtype) * self.gates[:, None]
        # Each (token, slot) receives exactly one row, so this is a copy, not an accumulation; the sum over
        # slots then runs in a fixed order on every device.
        by_slot = weighted.new_zeros(self.num_tokens, self.slots, weighted.shape[-1])
        by_slot = by_slot.index_put((self.token_idx, self.slot_idx), weighted)
        self.stage = "combined"
        return by_slot.sum(1).to(self.dtype)


def dispatch(
    x: torch.Tensor, assignments, experts: GroupedExperts, ep_group=None, capacity: int | None = None
) -> MoEDispatch:
    """Send each assignment's token to the rank holding its expert (module docstring); the all-to-all is
    issued, not waited."""
    num_tokens, device = x.shape[0], x.device
    token_idx, expert_idx, gates = assignments.token_idx, assignments.expert_idx, assignments.gates
    num_experts, ep_size = experts.num_experts, _group_size(ep_group)
    local = _local_experts(experts, ep_size)
    # Expert-sorted order; stable, so each expert's assignments keep their order (earlier tokens first).
    order = torch.argsort(expert_idx, stable=True)
    counts = count_per_index(expert_idx, num_experts)
    if capacity is not None and has_values(x):
        first = counts.cumsum(0) - counts
        position = torch.arange(order.numel(), device=device) - first[expert_idx[order]]
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    # Slot of each assignment among its token's assignments, so that combine sums them without atomics.
    per_token = count_per_index(token_idx, num_tokens)
    by_token = torch.argsort(token_idx, stable=True)
    token_first = per_token.cumsum(0) - per_token
    slot = torch.empty_like(token_idx)
    slot[by_token] = torch.arange(token_idx.numel(), device=device) - token_first[token_idx[by_token]]
    if not has_values(x):
        # The speed simulator (eval.simulator.replay) runs without values: the routing is taken to be the load the
        # balance loss aims for, the assignments spread evenly over the experts (capacity then applied).
        counts, slots = balanced_counts(token_idx.numel(), num_experts, capacity), max(1, -(-token_idx.numel() // num_tokens))
        order = order[: sum(counts)]
    else:
        # The one device-to-host copy of the layer: the split sizes must be known on the host.
        host = torch.cat([counts, per_token.max().view(1)]).tolist()
        counts, slots = host[:num_experts], host[num_experts]
    count_rows = [counts[r * local : (r + 1) * local] for r in range(ep_size)]  # per destination rank
    send_splits = [sum(row) for row in count_rows]
    if ep_size > 1:
        # What every rank sends to each of my experts (blocking: it sizes the receive buffer).
        recv_rows = comm.exchange_splits(count_rows, ep_group)
    else:
        recv_rows = count_rows
    recv_splits = [sum(row) for row in recv_rows]
    routed = x[token_idx[order]]
    pending = comm.all_to_all(routed, ep_group, send_splits, recv_splits)  # issued, waited in compute()
    expert_major = back_to_sources = None
    if ep_size > 1:
        expert_major, back_to_sources = _expert_major_order(recv_rows, device)
    return MoEDispatch(
        experts=experts,
        ep_group=ep_group,
        ep_size=ep_size,
        num_tokens=num_tokens,
        dtype=x.dtype,
        in_flight=pending,
        send_splits=send_splits,
        recv_splits=recv_splits,
        expert_counts=[sum(row[e] for row in recv_rows) for e in range(local)],
        gates=gates[order].to(routing_dtype(x.dtype)),
        token_idx=token_idx[order],
        slot_idx=slot[order],
        slots=slots,
        expert_major=expert_major,
        back_to_sources=back_to_sources,
    )


def _local_experts(experts: GroupedExperts, ep_size: int) -> int:
    """E / P, the experts each ep rank holds, after checking that `experts` holds that many."""
    num_experts = experts.num_experts
    local = num_experts // ep_size
    if num_experts % ep_size or experts.gate_proj.shape[0] != local:
        raise ValueError(
            f"The experts hold {experts.gate_proj.shape[0]} of {num_experts} experts, but an ep group of {ep_size} "
            f"ranks needs {num_experts / ep_size:g} per rank; shard them with parallel.parallelize."
        )
    return local


@dataclass(eq=False)
class PaddedDispatch:
    """An MoE layer's tokens in flight in the padded layout (module docstring): made by `dispatch_padded`,
    then `compute()`, then `combine()`, as `MoEDispatch`. Every size is a Python int known before forward."""

    experts: GroupedExperts
    ep_group: object
    ep_size: int
    capacity: int  # C: rows per (rank, expert)
    num_tokens: int  # T, of this rank
    slots: int  # assignments per token (k)
    dtype: torch.dtype  # x's, for the combined output
    in_flight: comm.Handle  # the dispatch all-to-all of [E * C, d], then the combine all-to-all
    row: torch.Tensor  # [A] the buffer row each assignment went in (E * C: not sent)
    gates: torch.Tensor  # [A] routing_dtype(x's), 0 where not sent
    token_idx: torch.Tensor  # [A]
    slot_idx: torch.Tensor  # [A] its place among that token's assignments
    dropped: torch.Tensor  # 0-d int64: valid assignments over the capacity, not sent
    stage: str = "dispatched"

    def compute(self) -> None:
        """Wait the dispatch all-to-all, run the local experts on [E/P, P * C, d], issue the combine."""
        if self.stage != "dispatched":
            raise RuntimeError(f"PaddedDispatch.compute() runs once, after dispatch; this one is {self.stage}.")
        received = self.in_flight.wait()  # [P * E/P * C, d]: (source rank, local expert, row) blocks
        p, c, d = self.ep_size, self.capacity, received.shape[-1]
        local = self.experts.gate_proj.shape[0]
        by_expert = received.view(p, local, c, d).transpose(0, 1).reshape(local, p * c, d)
        out = self.experts.forward_padded(by_expert)
        back = out.view(local, p, c, d).transpose(0, 1).reshape(p * local * c, d)
        self.in_flight = comm.all_to_all(back, self.ep_group)  # equal splits, as the rows came
        self.stage = "computed"

    def combine(self) -> torch.Tensor:
        """Wait the combine all-to-all; each token's output = sum of gate * expert output, [T, d] in x's dtype."""
        if self.stage != "computed":
            raise RuntimeError(f"PaddedDispatch.combine() runs once, after compute(); this one is {self.stage}.")
        returned = self.in_flight.wait()  # [E * C, d], in the layout this rank sent
        # One zero row more for the assignments not sent, so that every assignment gathers a row.
        returned = torch.cat([returned, returned.new_zeros(1, returned.shape[-1])])
        weighted = returned[self.row].to(self.gates.dtype) * self.gates[:, None]
        # As MoEDispatch.combine: one row per (token, slot), summed over slots in a fixed order.
        by_slot = weighted.new_zeros(self.num_tokens, self.slots, weighted.shape[-1])
        by_slot = by_slot.index_put((self.token_idx, self.slot_idx), weighted)
        self.stage = "combined"
        return by_slot.sum(1).to(self.dtype)


def dispatch_padded(
    x: torch.Tensor,
    assignments,
    experts: GroupedExperts,
    ep_group=None,
    capacity: int | None = None,
    valid: torch.Tensor | None = None,
) -> PaddedDispatch:
    """The padded dispatch (module docstring): C = `capacity` (default T) rows to every expert, every size
    known on the host, nothing read off the device; the all-to-all is issued, not waited. `valid` [A] bool:
    the assignments to send (default all); the others are ignored, expert ids included."""
    num_tokens, d = x.shape
    token_idx, expert_idx, gates = assignments.token_idx, assignments.expert_idx, assignments.gates
    num_experts, ep_size = experts.num_experts, _group_size(ep_group)
    _local_experts(experts, ep_size)
    count = token_idx.shape[0]
    if count % max(num_tokens, 1):
        raise ValueError(
            f"The padded dispatch needs the same number of assignments for every token, but {count} assignments do "
            f"not split evenly over {num_tokens} tokens; route with a top-k router (k per token), or use 'dropless'."
        )
    slots = count // max(num_tokens, 1)
    c = max(1, num_tokens) if capacity is None else capacity
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"The padded dispatch's capacity must be an int >= 1 (rows per expert), got {capacity!r}.")
    device = x.device
    # Invalid assignments take expert E: sorted after every real expert, never within its capacity.
    expert = expert_idx if valid is None else torch.where(valid, expert_idx, num_experts)
    counts = count_per_index(expert, num_experts + 1)
    order = torch.argsort(expert, stable=True)  # stable: each expert's assignments in assignment order
    first = counts.cumsum(0) - counts
    position = torch.empty_like(expert)
    position[order] = torch.arange(count, device=device) - first[expert[order]]
    real = expert < num_experts
    sent = real & (position < c)
    dropped = (real & ~sent).sum()
    unsent = num_experts * c  # the row after the buffer: where the assignments not sent point
    row = torch.where(sent, expert * c + position, unsent)
    # Which token fills each buffer row (T: a zero row). Only the row after the buffer is written twice.
    source = torch.full((unsent + 1,), num_tokens, dtype=torch.long, device=device)
    source = source.index_put((row,), token_idx)[:unsent]
    buffer = torch.cat([x, x.new_zeros(1, d)])[source]  # [E * C, d], expert-major; padding rows zero
    pending = comm.all_to_all(buffer, ep_group)  # equal splits, E/P * C rows per rank: issued, waited in compute()
    # Slot of each assignment among its token's, as in `dispatch` (a fixed-shape sort, no host read).
    per_token = count_per_index(token_idx, num_tokens)
    by_token = torch.argsort(token_idx, stable=True)
    token_first = per_token.cumsum(0) - per_token
    slot = torch.empty_like(token_idx)
    slot[by_token] = torch.arange(count, device=device) - token_first[token_idx[by_token]]
    return PaddedDispatch(
        experts=experts,
        ep_group=ep_group,
        ep_size=ep_size,
        capacity=c,
        num_tokens=num_tokens,
        slots=slots,
        dtype=x.dtype,
        in_flight=pending,
        row=row,
        gates=torch.where(sent, gates.to(routing_dtype(x.dtype)), 0.0),
        token_idx=token_idx,
        slot_idx=slot,
        dropped=dropped,
    )


def _expert_major_order(recv_rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation taking received rows, runs (source rank s, local expert e) in that order, to runs (e, s),
    and its inverse."""
    counts = torch.tensor(recv_rows, dtype=torch.long, device=device)  # [P, E_local]
    total = int(sum(map(sum, recv_rows)))
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)
    run_counts, run_starts = counts.T.flatten(), starts.T.flatten()  # runs in (e, s) order
    within = torch.arange(total, device=device) - (run_counts.cumsum(0) - run_counts).repeat_interleave(
        run_counts, output_size=total
    )
    order = run_starts.repeat_interleave(run_counts, output_size=total) + within
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(total, device=device)
    return order, inverse


# --- the whole layer ---------------------------------------------------------------------------------


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
        y = pending.combine()  # waits the combine
        if self.aux_loss_style == "hf":
            aux = {}
            if self.training and self.aux_loss_coef > 0:
                stats = balance_statistics(routing.probs, routing.expert_idx, self.num_experts, token_mask, self.ep_group)
                aux = {"balance_statistics": stats}
            return y.view(shape), aux
        balance = self.balance_loss(routing)
        aux = {} if balance is None else {"load_balance": self.aux_loss_coef * balance}
        return y.view(shape), aux


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
