"""MoE++ (Jin et al., ICLR 2025): FFN experts plus zero-computation experts, with gating residuals.

Every layer is pre-norm attention then an MoE++ layer (written for one token x^j of layer j):

    G(x^1) = W^1 x^1;   G(x^j) = W^j x^j + W_g^j G(x^{j-1})        router logits, gating residual
    p      = softmax(G(x^j));  top-2 of p, renormalised over the chosen experts that are not zero experts
    y      = sum_{i chosen} g_i E_i(x^j)
             E_i = SwiGLU_i (FFN experts), 0 (zero), x (copy), a1 x + a2 v_i with [a1, a2] = softmax(W_c,i x)
    L_b    = load_balance_loss with weight 1 for FFN experts and tau for zero-computation ones

The zero expert's weight is given to the other chosen experts, as in the authors' code (gates of the top-k
renormalised over the non-zero ones): a token that picks the zero expert and one FFN expert gets that
expert's output in full, i.e. it spends one expert's compute instead of two.

Expert parallelism: the FFN experts are split over the ep ranks and reached through the shared all-to-all
(models/common/moe.py); the zero-computation experts are replicated on every rank, so their assignments
are filtered out before the dispatch and never cross the link (the all-to-all carries k_eff instead of k
rows per token). They are computed here while the dispatch is in flight.

With `moe_dispatch="padded"` (models/common/moe.py `dispatch_padded`: every size known on the host) nothing
is filtered by a data-dependent selection: every assignment stays in the fixed layout, only the FFN experts'
marked valid (the others are never sent), and the copy and constant experts are computed for every
assignment and masked (`zero_computation_dense`): C rows per FFN expert, C = T unless
`dispatch_capacity_factor` gives ceil(f * T * k / N_FFN).
"""

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.moe import (
    GroupedExperts,
    MoeDispatchMixin,
    Routing,
    TopKRouter,
    check_moe_dispatch,
    dispatch,
    dispatch_now,
    dispatch_padded,
    init_moe_weights,
    load_balance_loss,
    padded_capacity,
    routing_dtype,
    take,
)
from models.common.residual import ResidualSchedule
from models.common.values import has_values
from models.moepp.configuration import ZooMoeppConfig
from models.moepp.sharding import PLAN
from parallel import comm

# --- the formulas, each a function so that tests can check it alone ----------------------------------


def expert_capacities(num_tokens: int, config: ZooMoeppConfig) -> tuple[int, int]:
    """(C_FFN, C_ZC): the most assignments one FFN / one zero-computation expert takes from `num_tokens`.

    C_FFN = gamma tau T / (tau N_FFN + N_ZC), C_ZC = gamma T / (tau N_FFN + N_ZC), rounded up. T counts
    assignments (top_k per token): the capacities then add up to gamma T, room for every assignment with
    a margin gamma when the load is balanced as the loss asks (each FFN expert taking tau times a
    zero-computation expert's share). Under expert parallelism T is the rank's own tokens, the same on
    every rank when the batch is split evenly.
    """
    t = config.num_experts_per_tok * num_tokens
    tau, gamma = config.tau, config.capacity_gamma
    denominator = tau * config.num_local_experts + config.num_zc_experts
    return math.ceil(gamma * tau * t / denominator), math.ceil(gamma * t / denominator)


def within_capacity(expert_idx: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Which assignments an expert of capacity `capacity[e]` keeps: its first ones in assignment order
    (earlier tokens first, as the shared dispatch drops). expert_idx: [A]; capacity: [N]. A bool mask [A]."""
    onehot = F.one_hot(expert_idx, capacity.shape[0])
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # how many of this expert's assignments come before
    return position < capacity[expert_idx]


def renormalise_without_zero_experts(routing: Routing, is_zero: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The gates of `routing`'s assignments renormalised over each token's chosen experts that are not zero
    experts (`is_zero` [A]; a zero expert's gate becomes 0); a token whose every choice is a zero expert
    keeps all-zero gates. Routing is token-major (k assignments per token), so the sums need no scatter."""
    gates = routing.gates.masked_fill(is_zero, 0.0).view(num_tokens, -1)
    total = gates.sum(-1, keepdim=True)
    return torch.where(total > 0, gates / total.clamp_min(torch.finfo(gates.dtype).tiny), 0.0).flatten()


class ConstantExperts(nn.Module):
    """E_i(x) = a1 x + a2 v_i with [a1, a2] = softmax(W_c,i x): a learned constant v_i mixed into the
    token by a per-token weight. `weight` stacks the W_c,i ([n, 2, d]), `constant` the v_i ([n, d])."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, 2, hidden_size))
        self.constant = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """x: [A, d] tokens, expert: [A] which constant expert (0..n-1) each goes to."""
        scores = x @ self.weight.flatten(0, 1).T  # [A, 2n]: every constant expert's W_c x, cheap at small n
        scores = scores.view(x.shape[0], self.constant.shape[0], 2)[torch.arange(x.shape[0], device=x.device), expert]
        # The mixing weights in routing_dtype (fp32, fp64 in a float64 model), as the router's scores.
        a = torch.softmax(scores.to(routing_dtype(scores.dtype)), dim=-1).to(x.dtype)
        # F.embedding, not self.constant[expert]: the backward of that index sums thousands of rows into n
        # rows with a multithreaded CPU kernel whose order varies from run to run; embedding's does not.
        return a[:, :1] * x + a[:, 1:] * F.embedding(expert, self.constant)


# --- the layer -----------------------------------------------------------------------------------------


class MoePlusPlus(nn.Module):
    """One MoE++ layer: router with gating residual, FFN experts (grouped, expert-parallel) and the
    zero-computation experts (local)."""

    def __init__(self, config: ZooMoeppConfig, layer_idx: int):
        super().__init__()
        d, n = config.hidden_size, config.num_total_experts
        self.num_ffn = config.num_local_experts
        self.first_copy = self.num_ffn + config.num_zero_experts
        self.first_constant = self.first_copy + config.num_copy_experts
        self.config = config
        self.router = TopKRouter(d, n, config.num_experts_per_tok)  # W^j
        # W_g^j: the first layer has no previous router to read.
        self.gate_residual = nn.Linear(n, n, bias=False) if config.gating_residual and layer_idx > 0 else None
        self.experts = GroupedExperts(config.num_local_experts, d, config.intermediate_size, config.experts_impl)
        self.constant_experts = ConstantExperts(config.num_constant_experts, d)
        check_moe_dispatch(config.moe_dispatch, config.dispatch_capacity_factor)
        # The dispatch of the FFN experts' rows (models/common/moe.py; `set_moe_dispatch` switches it) and
        # the assignments its padded form dropped, counted on the device.
        self.moe_dispatch, self.dispatch_capacity_factor = config.moe_dispatch, config.dispatch_capacity_factor
        self.register_buffer("dropped_assignments", torch.zeros((), dtype=torch.long), persistent=False)
        self.ep_group = None  # set by the "ep" plan (sharding.py); None = every expert local

    def forward(self, x: torch.Tensor, previous_logits: torch.Tensor | None):
        """x: [T, d] (normed). Returns (output [T, d], this layer's router logits [T, N], balance loss or
        None outside training)."""
        pending, zc_out, routing = self.dispatch_and_compute(x, previous_logits)  # the combine issued ...
        out = pending.combine().to(zc_out.dtype) + zc_out  # ... and waited at once
        return out.to(x.dtype), routing.logits, self.balance_loss(routing)

    def issue(self, x: torch.Tensor, previous_logits: torch.Tensor | None, shape: torch.Size | None = None):
        """`forward` with the combine all-to-all still in flight, for a schedule that waits it later (the ladder
        residual schedule): (pending, logits, balance loss or None); `pending.wait()` gives the output, shaped
        `shape` (default x's)."""
        pending, zc_out, routing = self.dispatch_and_compute(x, previous_logits)
        in_flight = MoeppInFlight(pending, zc_out, x.dtype, x.shape if shape is None else shape)
        return in_flight, routing.logits, self.balance_loss(routing)

    def dispatch_and_compute(self, x: torch.Tensor, previous_logits: torch.Tensor | None):
        """Route (with the gating residual), dispatch the FFN experts' rows, compute the zero-computation experts
        while the dispatch is in flight, run this rank's FFN experts and ISSUE the combine. Returns (pending
        dispatch, the zero-computation output [T, d] in routing_dtype, the routing)."""
        num_tokens = x.shape[0]
        residual = None
        if self.gate_residual is not None and previous_logits is not None:
            # The router runs in routing_dtype (fp32, fp64 in a float64 model), so does its residual.
            dtype = routing_dtype(x.dtype)
            residual = F.linear(previous_logits.to(dtype), self.gate_residual.weight.to(dtype))
        routing = self.router(x, extra_logits=residual)
        expert_idx = routing.expert_idx
        is_zero = (expert_idx >= self.num_ffn) & (expert_idx < self.first_copy)
        routing = replace(routing, gates=renormalise_without_zero_experts(routing, is_zero, num_tokens))
        keep = ~is_zero  # a zero expert adds nothing: no row is computed or sent for it
        if self.config.drop_tokens:
            c_ffn, c_zc = expert_capacities(num_tokens, self.config)
            capacity = torch.full((self.router.num_experts,), c_zc, dtype=torch.long, device=x.device)
            capacity[: self.num_ffn] = c_ffn
            keep &= within_capacity(expert_idx, capacity)
        ffn = keep & (expert_idx < self.num_ffn)
        mode, factor = dispatch_now(self)  # padded when traced for inference (models/common/moe.py)
        if mode == "padded":
            # Every assignment stays in the fixed layout, only the FFN experts' valid: no boolean selection.
            k = self.config.num_experts_per_tok
            c = padded_capacity(num_tokens, self.num_ffn, k, factor)
            pending = dispatch_padded(x, routing, self.experts, self.ep_group, c, valid=ffn)
            self.dropped_assignments += pending.dropped
            zc_out = self.zero_computation_dense(x, routing, keep & ~ffn)
        else:
            expected = self.expected_assignments(num_tokens) if not has_values(x) else {}
            # Only the FFN experts' assignments enter the all-to-all (issued here, not waited).
            pending = dispatch(x, routing.select(ffn, expected.get("ffn")), self.experts, ep_group=self.ep_group)
            # The copy and constant experts run on this rank while the dispatch is in flight.
            zc_out = self.zero_computation(x, routing, keep & ~ffn, expected)
        pending.compute()  # waits the dispatch, runs this rank's experts, issues the combine
        return pending, zc_out, routing

    def balance_loss(self, routing: Routing) -> torch.Tensor | None:
        """The heterogeneous balance loss of `routing` (eta = 1 for FFN experts, tau for zero-computation ones),
        None outside training or with the loss off."""
        if not (self.training and self.config.router_aux_loss_coef > 0):
            return None
        ffn_expert = torch.arange(self.router.num_experts, device=routing.probs.device) < self.num_ffn
        eta = torch.where(ffn_expert, 1.0, self.config.tau)
        return load_balance_loss(routing.probs, routing.expert_idx, self.router.num_experts, weights=eta, group=self.ep_group)

    def expected_assignments(self, num_tokens: int) -> dict[str, int]:
        """On the meta device (the speed simulator: no values to route by), how many of the layer's k T
        assignments each kind of expert takes at the load the balance loss aims for (an FFN expert tau times
        a zero-computation expert's share; capacity drops left out): "ffn", "local" (copy + constant: computed
        here) and "constant"."""
        c = self.config
        assignments, denominator = c.num_experts_per_tok * num_tokens, c.tau * c.num_local_experts + c.num_zc_experts

        def share(experts: float) -> int:
            return round(assignments * experts / denominator)

        return {
            "ffn": share(c.tau * c.num_local_experts),
            "local": share(c.num_copy_experts + c.num_constant_experts),
            "constant": share(c.num_constant_experts),
        }

    def zero_computation(self, x: torch.Tensor, routing: Routing, local: torch.Tensor, expected=None) -> torch.Tensor:
        """sum of g_i E_i(x) over each token's copy and constant experts (the assignments where `local`),
        [T, d] in routing_dtype (fp32; fp64 in a float64 model: a copy expert's row is its input exactly).
        Summed per (token, slot) like the shared combine: no atomics, a fixed order.
        `expected`: the selections' sizes on the meta device (`expected_assignments`)."""
        k, expected = self.config.num_experts_per_tok, expected or {}
        n_local, n_constant = expected.get("local"), expected.get("constant")
        slot = take(torch.arange(local.shape[0], device=x.device), local, n_local) % k  # routing is token-major
        token_idx, expert_idx, gates = (take(t, local, n_local) for t in (routing.token_idx, routing.expert_idx, routing.gates))
        rows = x[token_idx]  # copy experts: E(x) = x
        is_constant = expert_idx >= self.first_constant
        constant = self.constant_experts(
            take(rows, is_constant, n_constant), take(expert_idx, is_constant, n_constant) - self.first_constant
        )
        rows = rows.masked_scatter(is_constant[:, None], constant)
        dtype = routing_dtype(x.dtype)
        slots = x.new_zeros(x.shape[0], k, x.shape[1], dtype=dtype)
        slots = slots.index_put((token_idx, slot), rows.to(dtype) * gates[:, None].to(dtype))
        return slots.sum(1)


    def zero_computation_dense(self, x: torch.Tensor, routing: Routing, local: torch.Tensor) -> torch.Tensor:
        """`zero_computation` without a selection (the padded dispatch's: every size fixed): the copy and
        constant experts computed for every assignment, those not `local` masked to 0. [T, d] in
        routing_dtype."""
        k, num_tokens = self.config.num_experts_per_tok, x.shape[0]
        rows = x[routing.token_idx]  # copy experts: E(x) = x
        n_constant = self.constant_experts.constant.shape[0]
        if n_constant:
            is_constant = routing.expert_idx >= self.first_constant
            which = (routing.expert_idx - self.first_constant).clamp(0, n_constant - 1)
            rows = torch.where(is_constant[:, None], self.constant_experts(rows, which), rows)
        dtype = routing_dtype(x.dtype)
        weighted = torch.where(local[:, None], rows.to(dtype) * routing.gates[:, None].to(dtype), 0.0)
        return weighted.view(num_tokens, k, -1).sum(1)  # token-major: the k slots of each token, in order


class MoeppInFlight:
    """An MoE++ layer's output whose combine all-to-all is in flight: `wait()` waits it and adds the
    zero-computation experts' output (computed on this rank), as x's dtype."""

    def __init__(self, pending, zc_out: torch.Tensor, dtype: torch.dtype, shape: torch.Size):
        self.pending, self.zc_out, self.dtype, self.shape = pending, zc_out, dtype, shape

    def wait(self) -> torch.Tensor:
        return (self.pending.combine().to(self.zc_out.dtype) + self.zc_out).to(self.dtype).view(self.shape)


class MoeppDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block with the MoE++ layer in place of the MLP; the router logits go in and out
    (the gating residual: `passes_down`, models/common/residual.py)."""

    passes_down = True

    def make_mlp(self, config: ZooMoeppConfig, layer_idx: int) -> MoePlusPlus:
        return MoePlusPlus(config, layer_idx)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache, previous_logits):
        """Returns (hidden states, aux dict, this layer's router logits)."""
        attn_out = self.attention_block(hidden_states, position_embeddings, attention_mask, cache)
        hidden_states = hidden_states + comm.all_reduce(attn_out, self.tp_group).wait()
        # The MoE++ layer is whole on every tp rank, so its output is complete: no all-reduce. Both all-to-alls
        # are waited inside.
        x = self.post_attention_layernorm(hidden_states)
        moe_out, logits, balance = self.mlp(x.flatten(0, 1), previous_logits)
        return hidden_states + moe_out.view_as(hidden_states), _aux(balance), logits

    def mlp_in_flight(self, hidden_states, previous_logits):
        """The MoE++ sub-block with its combine all-to-all in flight, for the ladder schedule: (pending, aux dict,
        router logits); `pending.wait()` gives the output, shaped as `hidden_states`."""
        x = self.post_attention_layernorm(hidden_states)
        pending, logits, balance = self.mlp.issue(x.flatten(0, 1), previous_logits, hidden_states.shape)
        return pending, _aux(balance), logits


def _aux(balance: torch.Tensor | None) -> dict:
    return {} if balance is None else {"load_balance": balance}


class ZooMoeppPreTrainedModel(MoeDispatchMixin, ZooPreTrainedModel):
    config_class = ZooMoeppConfig
    config: ZooMoeppConfig
    _no_split_modules = ["MoeppDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Stacked FFN experts: like a dense MLP's linears, down_proj scaled for the residual stream.
        init_moe_weights(module, self.config.initializer_range, 1 / math.sqrt(2 * self.config.num_hidden_layers))
        if isinstance(module, ConstantExperts):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.constant, mean=0.0, std=self.config.initializer_range)


class ZooMoeppModel(ZooMoeppPreTrainedModel, ResidualSchedule, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return MoeppDecoderLayer(config, layer_idx)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        # Each layer's router logits go down the stack to the next layer's gating residual (`passes_down`).
        auxes = []
        hidden_states = self.run_schedule(hidden_states, position_embeddings, attention_mask, cache, auxes)
        balance = [aux["load_balance"] for aux in auxes if "load_balance" in aux]
        if not balance:  # eval mode, or router_aux_loss_coef = 0
            return hidden_states
        return hidden_states, {"load_balance": self.config.router_aux_loss_coef * torch.stack(balance).mean()}


class ZooMoeppForCausalLM(ZooMoeppPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooMoeppModel
    shard_plan = PLAN
