"""Routing for the MoE layer (models/common/moe.py): which experts each token goes to, with which gates, and
the balance losses that keep the experts evenly loaded.

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
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from models.common.values import has_values
from parallel import comm

SCORE_FUNCS = ("softmax", "sigmoid")
AUX_LOSS_STYLES = ("zoo", "hf")  # the balance loss's conventions (module docstring)


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing and the expert combine compute in for a model of `dtype`: max(fp32, dtype). fp32 for
    bf16 / fp16 / fp32 models (near-ties between experts must not flip with rounding), fp64 for a float64
    one, so that its parity tests hold to float64's precision (a copy expert's row stays the fp64 input)."""
    return torch.promote_types(dtype, torch.float32)


def check_top_k(top_k: int, num_experts: int, what: str = "num_experts_per_tok") -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"The number of experts must be a positive integer, got {num_experts!r}.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{what}={top_k!r} experts per token does not fit {num_experts} experts; choose top-k in 1..{num_experts}."
        )


def count_per_index(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `index` (torch.bincount without its device-to-host sync on CUDA;
    integer sums, so exact in any order)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


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
