"""Vanilla top-k MoE (Mixtral-style): pre-norm decoder layers whose MLP is, every `moe_layer_freq` layers,
a sparse block of routed SwiGLU experts.

    h   = x + Attn(LN1(x))                      all-reduce over tp, waited at once
    out = h + MoE(LN2(h))                       MoE layers: route, dispatch, experts, combine (over ep)
    out = h + MLP(LN2(h))                       other layers: the dense MLP, all-reduce over tp

The MoE block (models/common/moe.py `SparseMoE`) waits each of its two all-to-alls right after issuing
it: the vanilla schedule that ScMoE hides. In training mode every MoE layer adds its load-balance loss;
the model reports their mean, times `router_aux_loss_coef`, as `aux_losses["load_balance"]`, which the LM
head adds to the loss.

Names follow HF Llama / Mixtral: dense layers `model.layers.N.mlp.{gate,up,down}_proj`, MoE layers
`model.layers.N.mlp.router.gate` (the router linear) and `model.layers.N.mlp.experts.{gate,up,down}_proj`
(stacked, [E, ...], expert e's slice shaped like the dense layer's weight).
"""

import math

import torch
from torch import nn

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.moe import MoeDispatchMixin, SparseMoE, init_moe_weights
from models.moe.configuration import ZooMoeConfig
from models.moe.sharding import PLAN
from parallel import comm


class MoeDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block; in an MoE layer its `mlp` is a `SparseMoE`."""

    def __init__(self, config: ZooMoeConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            # Under the dense MLP's attribute name, as HF Mixtral and Qwen-MoE do. It replaces the dense MLP
            # the shared layer built (rather than taking its place through `make_mlp`, as MoE++'s does): that
            # MLP's construction draws from the random generator, so the models a seed gives stay the same.
            self.mlp = SparseMoE(
                config.hidden_size,
                config.intermediate_size,
                config.num_local_experts,
                config.num_experts_per_tok,
                score_func=config.router_score_func,
                balance_bias=config.router_balance_bias,
                aux_loss_coef=config.router_aux_loss_coef,
                capacity_factor=config.capacity_factor,
                impl=config.experts_impl,
                moe_dispatch=config.moe_dispatch,
                dispatch_capacity_factor=config.dispatch_capacity_factor,
            )

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        attn_out = self.attention_block(hidden_states, position_embeddings, attention_mask, cache)
        hidden_states = hidden_states + comm.all_reduce(attn_out, self.tp_group).wait()
        if not self.is_moe:
            mlp_out = self.mlp_block(hidden_states)
            return hidden_states + comm.all_reduce(mlp_out, self.tp_group).wait(), {}
        # The experts are whole on every tp rank, so the output is complete: no all-reduce. The block
        # dispatches over ep and waits both all-to-alls inside (SparseMoE.forward).
        moe_out, aux = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + moe_out, aux


class ZooMoePreTrainedModel(MoeDispatchMixin, ZooPreTrainedModel):
    config_class = ZooMoeConfig
    config: ZooMoeConfig
    _no_split_modules = ["MoeDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Stacked experts: like the dense MLP's linears, down_proj scaled for the residual stream.
        init_moe_weights(
            module, self.config.initializer_range, 1 / math.sqrt(2 * self.config.num_hidden_layers)
        )


class ZooMoeModel(ZooMoePreTrainedModel, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return MoeDecoderLayer(config, layer_idx)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        balance = []
        for layer in self.layers:
            hidden_states, aux = layer(hidden_states, position_embeddings, attention_mask, cache)
            if "load_balance" in aux:
                balance.append(aux["load_balance"])
        if not balance:  # eval mode, or router_aux_loss_coef = 0
            return hidden_states
        return hidden_states, {"load_balance": torch.stack(balance).mean()}


class ZooMoeForCausalLM(ZooMoePreTrainedModel, ZooForCausalLM):
    base_model_class = ZooMoeModel
    shard_plan = PLAN
