"""Parallel attention + MLP block (GPT-J, PaLM): x = x + Attn(LN(x)) + MLP(LN(x))."""

import torch
from torch import nn

from models.common import Attention, RMSNorm, SwiGLUMLP, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.common.decoder import runs_split, split_inputs
from models.parallel_block.configuration import ZooParallelConfig
from models.parallel_block.sharding import PLAN
from parallel import comm


class ParallelDecoderLayer(nn.Module):
    def __init__(self, config: ZooParallelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention.from_config(config, layer_idx)
        self.mlp = SwiGLUMLP.from_config(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.tp_group = None
        self.overlap = "none"  # set by parallel.set_overlap: "token_split" / "seq_split" run `split_forward`

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        if runs_split(self.overlap, hidden_states):
            return self.split_forward(hidden_states, position_embeddings, attention_mask, cache)
        h = self.input_layernorm(hidden_states)
        partial = self.self_attn(h, position_embeddings, attention_mask, cache) + self.mlp(h)
        return hidden_states + comm.all_reduce(partial, self.tp_group).wait()

    def split_forward(self, hidden_states, position_embeddings, attention_mask, cache):
        """The block over two halves of the batch or two chunks of the sequence (parallel/overlap.py): the first
        half's all-reduce runs behind the second half's attention and MLP; the second half's is waited at the end
        of the layer."""
        halves, dim = split_inputs(self.overlap, hidden_states, position_embeddings, attention_mask, cache)
        pending = []
        for x, pos, mask, half_cache in halves:
            h = self.input_layernorm(x)
            pending.append(comm.all_reduce(self.self_attn(h, pos, mask, half_cache) + self.mlp(h), self.tp_group))
        return torch.cat([x + p.wait() for (x, *_), p in zip(halves, pending, strict=True)], dim=dim)


class ZooParallelPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooParallelConfig
    config: ZooParallelConfig
    _no_split_modules = ["ParallelDecoderLayer"]


class ZooParallelModel(ZooParallelPreTrainedModel, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return ParallelDecoderLayer(config, layer_idx)


class ZooParallelForCausalLM(ZooParallelPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooParallelModel
    overlap_schedules = ("token_split", "seq_split")  # parallel/overlap.py
    shard_plan = PLAN
