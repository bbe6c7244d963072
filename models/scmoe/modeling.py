"""ScMoE: shortcut-connected expert parallelism (Cai et al., ICML 2025, arXiv 2404.05019).

Position 2 (the paper's recommended placement), one (dense block l, MoE block l+1) pair, with the
pre-norms of this implementation (N1, N2: the blocks' input / post-attention norms, Ns: the shortcut's
own norm, so that the routed experts see their input at a scale of its own):

    h1  = x  + Attn_l(N1_l(x))                                 dense block
    h2  = h1 + MLP_l(N2_l(h1))
    h3  = h2 + Attn_{l+1}(N1_{l+1}(h2))                        MoE block
    s   = N2_{l+1}(h3);   g = sigmoid(W_cg s)                  gate of the shared expert ("CG-1")
    r   = Ns_{l+1}(h1)                                         the shortcut
    out = h3 + g * SE(s) + sum_i G(r)_i E_i(r)                 top-1 routed experts on the shortcut

The routed experts read the dense block's post-attention stream h1, so their tokens can leave for the
expert-parallel ranks as soon as h1 exists, while the rest of the pair computes. The schedule, in
`ZooScMoeModel._pair` (one all-to-all each way per pair):

    after Attn_l        router(r); dispatch all-to-all ISSUED
    MLP_l               runs while the dispatch is in flight
    after MLP_l         dispatch WAITED; local expert compute; combine all-to-all ISSUED
    Attn_{l+1}, SE      run while the combine is in flight
    final add           combine WAITED

Expert compute sits after MLP_l. The spec's rule picks the slot minimising |compute before - T_dispatch|
+ |compute after - T_combine|; the two all-to-alls carry the same bytes, so the best slot splits the
pair's remaining compute evenly: MLP_l (about 3 d f per token) before, Attn_{l+1} + SE (4 d^2 + attention
+ 3 d f_s) after. The other slot (after Attn_{l+1}) would leave only SE to hide the combine.
`moe_overlap=False` waits each all-to-all at once: the serial schedule, the same operations on the same
values, added in the same order.

Position 1 (every layer an MoE block): the routed experts read the layer's input (the preceding block's
output); dispatch is issued before the layer's attention, expert compute follows it, and the combine is
hidden behind the shared expert only.

Routing: softmax over the experts, top `num_experts_per_tok` (1); the gate is the softmax probability,
not renormalised (with one expert a renormalised gate is always 1, and the language-model loss would
never reach the router: Switch Transformer's choice). Names: the routed part is the block's `mlp`, a
`SparseMoE` (router + experts, as in `moe`), whose steps `_pair` calls one by one; the shared expert is
`shared_expert` with its gate `shared_expert_gate` (Qwen-MoE's names).
"""

import math

import torch
from torch import nn

from models.common import (
    Attention,
    PreNormDecoderLayer,
    RMSNorm,
    SwiGLUMLP,
    ZooDecoderModel,
    ZooForCausalLM,
    ZooPreTrainedModel,
)
from models.common.decoder import PreNormAttention
from models.common.moe import MoeDispatchMixin, SparseMoE, init_moe_weights
from models.scmoe.configuration import ZooScMoeConfig
from models.scmoe.sharding import PLAN
from parallel import comm


class ScMoeBlock(PreNormAttention, nn.Module):
    """The MoE block of a pair: attention, a gated shared expert on the block's own stream, and top-k routed
    experts on the shortcut (the preceding block's representation, which the trunk passes in).

    It shares the pre-norm attention sub-block (`attention_block`), not the whole `PreNormDecoderLayer`:
    it has no forward of its own (the trunk interleaves its parts with the dense block's, `_pair`), its
    post-attention norm feeds the shared expert while `mlp` (the routed experts) reads the shortcut through
    `shortcut_layernorm`, so the layer's `mlp_block` and `forward` would be wrong for it; and its modules
    come in another order (`mlp` last), which fixes its state-dict and parameter order (optimizer state in
    saved training checkpoints is kept by parameter position) and what a seed initialises."""

    checkpoint_methods = ("dispatch_shortcut", "mlp.experts.forward")  # called by the trunk: AC units too

    def __init__(self, config: ZooScMoeConfig, layer_idx: int):
        super().__init__()
        d = config.hidden_size
        self.self_attn = Attention.from_config(config, layer_idx)
        self.input_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)  # the shared expert's and W_cg's
        self.shared_expert = SwiGLUMLP(d, config.shared_expert_intermediate_size, bias=config.mlp_bias)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)  # W_cg
        self.shortcut_layernorm = RMSNorm(d, eps=config.rms_norm_eps)  # the routed experts'
        self.mlp = SparseMoE.from_config(config, renormalize=False)
        self.tp_group = None  # set by parallel.parallelize; None = single device

    def dispatch_shortcut(self, shortcut: torch.Tensor):
        """Route the shortcut's tokens and ISSUE their dispatch all-to-all (over `mlp.ep_group`).

        Returns (pending, balance loss or None outside training): `pending.compute()` waits the dispatch,
        runs this rank's experts and issues the combine; `pending.combine()` waits the combine and gives
        sum_i G(r)_i E_i(r), [T, d]."""
        pending, routing = self.mlp.dispatch(self.shortcut_layernorm(shortcut).flatten(0, 1))
        return pending, self.mlp.balance_loss(routing)

    def shared_expert_block(self, hidden_states):
        """(g, SE(s)), s the normed stream. SE's output is a partial sum under tensor parallelism: the gate
        multiplies it after the all-reduce (the trunk's), or W_cg would get a partial gradient."""
        s = self.post_attention_layernorm(hidden_states)
        return torch.sigmoid(self.shared_expert_gate(s)), self.shared_expert(s)


class ZooScMoePreTrainedModel(MoeDispatchMixin, ZooPreTrainedModel):
    config_class = ZooScMoeConfig
    config: ZooScMoeConfig
    _no_split_modules = ["PreNormDecoderLayer", "ScMoeBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Stacked experts: like the dense MLP's linears, down_proj scaled for the residual stream.
        init_moe_weights(module, self.config.initializer_range, 1 / math.sqrt(2 * self.config.num_hidden_layers))


class ZooScMoeModel(ZooScMoePreTrainedModel, ZooDecoderModel):
    runs_layers_whole = False  # run_layers calls the layers' sub-blocks itself

    def make_layer(self, config, layer_idx):
        if config.is_moe_layer(layer_idx):
            return ScMoeBlock(config, layer_idx)
        return PreNormDecoderLayer(config, layer_idx)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        args = (position_embeddings, attention_mask, cache)
        x, balance = hidden_states, []
        if not self.config.shortcut:
            for layer in self.layers:
                if isinstance(layer, ScMoeBlock):
                    x, loss = self._without_shortcut(layer, x, *args)
                    balance.append(loss)
                else:
                    x = layer(x, *args)
        elif self.config.shortcut_position == 2:
            for dense, moe in zip(self.layers[0::2], self.layers[1::2], strict=True):
                x, loss = self._pair(dense, moe, x, *args)
                balance.append(loss)
        else:
            for moe in self.layers:
                x, loss = self._every_layer(moe, x, *args)
                balance.append(loss)
        balance = [loss for loss in balance if loss is not None]
        if not balance:  # eval mode, or router_aux_loss_coef = 0
            return x
        return x, {"load_balance": self.config.router_aux_loss_coef * torch.stack(balance).mean()}

    def _pair(self, dense: PreNormDecoderLayer, moe: ScMoeBlock, x, *args):
        """Position 2: dense block l, MoE block l+1; the all-to-alls overlap MLP_l, Attn_{l+1} and SE."""
        serial = not self.config.moe_overlap
        tp = dense.tp_group
        h1 = x + comm.all_reduce(dense.attention_block(x, *args), tp).wait()
        # h1 exists: gate its tokens and issue their dispatch now.
        pending, balance = moe.dispatch_shortcut(h1)
        if serial:  # wait both all-to-alls at once: nothing hidden
            pending.compute()
            routed = pending.combine()
        h2 = h1 + comm.all_reduce(dense.mlp_block(h1), tp).wait()  # the dispatch is in flight
        if not serial:
            pending.compute()  # dispatch waited; this rank's experts; combine issued
        h3 = h2 + comm.all_reduce(moe.attention_block(h2, *args), tp).wait()  # the combine is in flight ...
        g, shared = moe.shared_expert_block(h3)  # ... and behind the shared expert too
        shared = comm.all_reduce(shared, tp).wait()
        if not serial:
            routed = pending.combine()  # the combine is waited only here, at the final add
        return h3 + g * shared + routed.view_as(h3), balance

    def _every_layer(self, moe: ScMoeBlock, x, *args):
        """Position 1: the routed experts read the layer's input; the dispatch overlaps the attention."""
        serial = not self.config.moe_overlap
        tp = moe.tp_group
        pending, balance = moe.dispatch_shortcut(x)
        if serial:
            pending.compute()
            routed = pending.combine()
        h = x + comm.all_reduce(moe.attention_block(x, *args), tp).wait()  # the dispatch is in flight
        if not serial:
            pending.compute()
        g, shared = moe.shared_expert_block(h)  # the combine is in flight
        shared = comm.all_reduce(shared, tp).wait()
        if not serial:
            routed = pending.combine()
        return h + g * shared + routed.view_as(h), balance

    def _without_shortcut(self, moe: ScMoeBlock, x, *args):
        """`shortcut=False`: the routed experts read the block's own post-attention stream, as a standard
        MoE block with a gated shared expert; only the shared expert is left to overlap the dispatch."""
        tp = moe.tp_group
        h = x + comm.all_reduce(moe.attention_block(x, *args), tp).wait()
        pending, balance = moe.dispatch_shortcut(h)
        g, shared = moe.shared_expert_block(h)  # the dispatch is in flight
        shared = comm.all_reduce(shared, tp).wait()
        pending.compute()
        return h + g * shared + pending.combine().view_as(h), balance


class ZooScMoeForCausalLM(ZooScMoePreTrainedModel, ZooForCausalLM):
    base_model_class = ZooScMoeModel
    shard_plan = PLAN
