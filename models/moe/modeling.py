"""Vanilla top-k MoE (Mixtral-style): pre-norm decoder layers whose MLP is, every `moe_layer_freq` layers,
a sparse block of routed SwiGLU experts.

    h   = x + Attn(LN1(x))                      all-reduce over tp, waited at once
    out = h + MoE(LN2(h))                       MoE layers: route, dispatch, experts, combine (over ep)
    out = h + MLP(LN2(h))                       other layers: the dense MLP, all-reduce over tp

The MoE block (models/common/moe.py `SparseMoE`) waits each of its two all-to-alls right after issuing
it: the vanilla schedule that ScMoE hides. In training mode every MoE layer adds its load-balance loss;
the model reports their mean, times `router_aux_loss_coef`, as `aux_losses["load_balance"]`, which the LM
head adds to the loss. With `router_aux_loss_style="hf"` it is transformers' loss instead (pooled over the
MoE layers, per token, the padding of `attention_mask` left out; models/common/moe.py).

Names: attention, norms, embeddings, LM head and dense layers (`model.layers.N.mlp.{gate,up,down}_proj`)
are HF Llama's (and Mixtral's). The MoE tensors are the zoo's own, NOT Mixtral's:
`model.layers.N.mlp.router.gate.weight` (the router linear; Mixtral: `mlp.gate.weight`, on the hub
`block_sparse_moe.gate.weight`) and `model.layers.N.mlp.experts.{gate,up,down}_proj` (stacked, [E, ...],
expert e's slice shaped like a dense layer's weight, so a Llama MLP copies in; transformers 5's Mixtral fuses
gate and up into `experts.gate_up_proj` [E, 2f, d], the hub's files keep `experts.N.w1 / w3 / w2`). So a
Mixtral checkpoint does not load by name: `models.moe.convert.mixtral_to_moe(dir)` (or `train.convert
converter=mixtral_to_moe`) renames it, exactly, and `models.stock_export.export_stock` writes a zoo moe back
as a MixtralForCausalLM checkpoint.

`from_pretrained` refuses a Mixtral checkpoint on every path, pointing to the converter. With
`ignore_mismatched_sizes=True` (transformers' own loading: what fits is loaded, the rest initialised) it also
refuses when router or expert tensors would be left random, naming them, unless the caller says so with
`allow_random_experts=True` (a checkpoint of another architecture loaded on purpose, say): random experts
change the model's output entirely and are never what a renamed checkpoint should give.
"""

import math
from dataclasses import replace

import torch
from torch import nn

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.decoder import Split, add_pending
from models.common.moe import (
    MoeDispatchMixin,
    SparseMoE,
    check_split_capacity,
    hf_load_balance_loss,
    init_moe_weights,
)
from models.common.pretrained import _checkpoint_model_type
from models.common.residual import ResidualSchedule
from models.moe.configuration import ZooMoeConfig
from models.moe.sharding import PLAN
from parallel import comm


class _Combine:
    """A split MoE layer's combine all-to-all of half 1, still in flight: `wait()` gives its output, shaped as the
    half's stream."""

    def __init__(self, pending, shape):
        self.pending, self.shape = pending, shape

    def wait(self):
        return self.pending.combine().view(self.shape)


class MoeDecoderLayer(PreNormDecoderLayer):
    """The shared pre-norm block; in an MoE layer its `mlp` is a `SparseMoE`."""

    def __init__(self, config: ZooMoeConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            # Under the dense MLP's attribute name, as HF Mixtral and Qwen-MoE do. It replaces the dense MLP
            # the shared layer built (rather than taking its place through `make_mlp`, as MoE++'s does): that
            # MLP's construction draws from the random generator, so the models a seed gives stay the same.
            self.mlp = SparseMoE.from_config(
                config,
                score_func=config.router_score_func,
                balance_bias=config.router_balance_bias,
                aux_loss_style=config.router_aux_loss_style,
            )
        self.token_mask = None  # [B, T] padding mask of the current forward, for the "hf" balance loss

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        attn_out = self.attention_block(hidden_states, position_embeddings, attention_mask, cache)
        hidden_states = hidden_states + comm.all_reduce(attn_out, self.tp_group).wait()
        if not self.is_moe:
            mlp_out = self.mlp_block(hidden_states)
            return hidden_states + comm.all_reduce(mlp_out, self.tp_group).wait(), {}
        # The experts are whole on every tp rank, so the output is complete: no all-reduce. The block
        # dispatches over ep and waits both all-to-alls inside (SparseMoE.forward).
        moe_out, aux = self.mlp(self.post_attention_layernorm(hidden_states), token_mask=self.token_mask)
        return hidden_states + moe_out, aux

    def split_layer(self, x0, x1, carried, split: Split):
        """The layer over the two halves of a split forward, in turn, the batch's (token_split) or the sequence's
        (seq_split) (models.common.decoder.run_split; DeepSeek's and SGLang's two-batch overlap): the previous
        layer's last collective of half 1 (`carried`) runs behind half 0's attention, half 0's TP all-reduce behind
        half 1's attention, half 1's dispatch all-to-all behind half 0's experts and half 0's combine behind half
        1's experts; half 1's combine is returned in flight, for the next layer. The router sees each token as in
        `forward`, and the balance loss is taken once over both halves' routing (in the unsplit layer's token
        order), so the loss is the unsplit layer's; a capacity (which depends on how many tokens a forward routes)
        is refused. A dense layer runs the shared block's split."""
        if not self.is_moe:
            return (*super().split_layer(x0, x1, carried, split), {})
        check_split_capacity(self.mlp, split.schedule)
        (pos0, mask0, cache0), (pos1, mask1, cache1) = split.halves
        attn0 = comm.all_reduce(self.attention_block(x0, pos0, mask0, cache0), self.tp_group)
        x1 = add_pending(x1, carried)  # the previous layer's last collective of half 1, behind half 0's attention
        attn1 = comm.all_reduce(self.attention_block(x1, pos1, mask1, cache1), self.tp_group)
        x0 = x0 + attn0.wait()  # behind half 1's attention
        moe0, routing0 = self.mlp.dispatch(self.post_attention_layernorm(x0).flatten(0, -2))  # all-to-all issued
        x1 = x1 + attn1.wait()
        moe1, routing1 = self.mlp.dispatch(self.post_attention_layernorm(x1).flatten(0, -2))  # all-to-all issued
        moe0.compute()  # waits half 0's dispatch; its experts; its combine issued
        moe1.compute()  # waits half 1's dispatch (behind half 0's experts); its experts; its combine issued
        x0 = x0 + moe0.combine().view(x0.shape)  # half 0's combine ran behind half 1's experts

        def join(t0, t1):  # both halves' token-major routing ([T, E] or [T * k]) in the unsplit layer's token order
            halves = [t.unflatten(0, (*x.shape[:2], -1)) for t, x in ((t0, x0), (t1, x1))]
            return torch.cat(halves, dim=split.dim).flatten(0, 2)

        whole = replace(routing0, probs=join(routing0.probs, routing1.probs),
                        expert_idx=join(routing0.expert_idx, routing1.expert_idx))  # fmt: skip
        return x0, x1, _Combine(moe1, x1.shape), self.mlp.aux(whole, token_mask=self.token_mask)

    def mlp_in_flight(self, hidden_states):
        """The MLP sub-block with its last collective still in flight, for the ladder schedule: a dense layer's
        TP all-reduce (the shared layer's), an MoE layer's combine all-to-all (the dispatch waited, this rank's
        experts run). Returns (pending, aux); `pending.wait()` gives the output to add to the stream."""
        if not self.is_moe:
            return super().mlp_in_flight(hidden_states)
        return self.mlp.issue(self.post_attention_layernorm(hidden_states), token_mask=self.token_mask)


class ZooMoePreTrainedModel(MoeDispatchMixin, ZooPreTrainedModel):
    config_class = ZooMoeConfig
    config: ZooMoeConfig
    _no_split_modules = ["MoeDecoderLayer"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, allow_random_experts: bool = False, **kwargs):
        """The zoo's `from_pretrained` (models/common/pretrained.py), plus: a Mixtral checkpoint is refused
        with the converter to use; with `ignore_mismatched_sizes=True`, router / expert tensors the checkpoint
        lacks are refused by name unless `allow_random_experts=True` (module docstring)."""
        path = pretrained_model_name_or_path
        if _checkpoint_model_type(path, kwargs) == "mixtral":
            raise ValueError(
                f"Checkpoint {path} is a Mixtral (model_type='mixtral'), whose router and expert tensors have other "
                "names and layouts than the zoo moe's, so it does not load by name (not even with "
                "ignore_mismatched_sizes=True: its experts would stay random). Convert it exactly with "
                f"models.moe.convert.mixtral_to_moe({str(path)!r}), or `python -m train.convert "
                f"converter=mixtral_to_moe source={path}`."
            )
        if not kwargs.get("ignore_mismatched_sizes") or allow_random_experts:
            return super().from_pretrained(path, *args, **kwargs)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(path, *args, output_loading_info=True, **kwargs)
        random_moe = sorted(k for k in info["missing_keys"] if ".mlp.router." in k or ".mlp.experts." in k)
        if random_moe:
            shown = ", ".join(random_moe[:6]) + (", ..." if len(random_moe) > 6 else "")
            raise ValueError(
                f"Checkpoint {path} lacks {len(random_moe)} router / expert tensors of {cls.__name__} ({shown}); "
                "ignore_mismatched_sizes=True would leave them randomly initialised, so the model would not compute "
                "the checkpoint's function. Load a zoo moe checkpoint, upcycle a Llama with "
                "models.moe.convert.llama_to_moe, or pass allow_random_experts=True if random experts are intended."
            )
        return (model, info) if want_info else model

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Stacked experts: like the dense MLP's linears, down_proj scaled for the residual stream.
        init_moe_weights(
            module, self.config.initializer_range, 1 / math.sqrt(2 * self.config.num_hidden_layers)
        )


class ZooMoeModel(ZooMoePreTrainedModel, ResidualSchedule, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return MoeDecoderLayer(config, layer_idx)

    def forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
        if not (self.training and self.config.router_aux_loss_style == "hf"):
            return super().forward(input_ids, attention_mask, *args, **kwargs)
        # The "hf" balance loss leaves padding out: the layers read this forward's [B, T] mask (the trunk
        # hands them only the 4-D attention mask). Its last T columns: the chunk's own tokens.
        q_len = (input_ids if input_ids is not None else kwargs["inputs_embeds"]).shape[1]
        mask = attention_mask[:, -q_len:] if attention_mask is not None and attention_mask.dim() == 2 else None
        for layer in self.layers:
            layer.token_mask = mask
        try:
            return super().forward(input_ids, attention_mask, *args, **kwargs)
        finally:
            for layer in self.layers:
                layer.token_mask = None

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        auxes = []  # each layer's aux dict, under the config's residual schedule
        hidden_states = self.run_schedule(hidden_states, position_embeddings, attention_mask, cache, auxes)
        balance = [aux["load_balance"] for aux in auxes if "load_balance" in aux]
        statistics = [aux["balance_statistics"] for aux in auxes if "balance_statistics" in aux]
        if statistics:  # router_aux_loss_style="hf": one loss pooled over the MoE layers
            loss = hf_load_balance_loss(statistics, self.config.num_local_experts)
            return hidden_states, {"load_balance": self.config.router_aux_loss_coef * loss}
        if not balance:  # eval mode, or router_aux_loss_coef = 0
            return hidden_states
        return hidden_states, {"load_balance": torch.stack(balance).mean()}


class ZooMoeForCausalLM(ZooMoePreTrainedModel, ZooForCausalLM):
    base_model_class = ZooMoeModel
    shard_plan = PLAN
    overlap_schedules = ("token_split", "seq_split")  # parallel/overlap.py: MoeDecoderLayer.split_layer
