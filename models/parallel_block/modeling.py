"""Parallel attention + MLP block (GPT-J, PaLM): x = x + Attn(LN(x)) + MLP(LN(x))."""

from torch import nn

from models.common import Attention, RMSNorm, SwiGLUMLP, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
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

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        h = self.input_layernorm(hidden_states)
        partial = self.self_attn(h, position_embeddings, attention_mask, cache) + self.mlp(h)
        return hidden_states + comm.all_reduce(partial, self.tp_group).wait()


class ZooParallelPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooParallelConfig
    config: ZooParallelConfig
    _no_split_modules = ["ParallelDecoderLayer"]


class ZooParallelModel(ZooParallelPreTrainedModel, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return ParallelDecoderLayer(config, layer_idx)


class ZooParallelForCausalLM(ZooParallelPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooParallelModel
    shard_plan = PLAN
