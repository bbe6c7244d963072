"""Dense Llama: pre-norm decoder layers, attention then SwiGLU MLP, each added to the residual stream.

Parameter names are those of Hugging Face `LlamaForCausalLM` (`model.layers.N.self_attn.q_proj`, ...),
so `ZooLlamaForCausalLM.from_pretrained(hf_llama_dir)` loads an HF checkpoint unchanged.
"""

from torch import nn

from models.common import Attention, RMSNorm, SwiGLUMLP, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.llama.configuration import ZooLlamaConfig
from models.llama.sharding import PLAN, check_layout
from parallel import comm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ZooLlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention.from_config(config, layer_idx)
        self.mlp = SwiGLUMLP.from_config(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.tp_group = None  # set by parallel.parallelize; None = single device

    # The two sub-blocks, each returning its (under TP: partial, un-reduced) output. Architectures
    # that rewire the residual stream (Ladder) call these and keep the weights and names.
    def attention_block(self, hidden_states, position_embeddings, attention_mask, cache):
        return self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)

    def mlp_block(self, hidden_states):
        return self.mlp(self.post_attention_layernorm(hidden_states))

    def forward(self, hidden_states, position_embeddings, attention_mask, cache):
        attn_out = self.attention_block(hidden_states, position_embeddings, attention_mask, cache)
        # Standard block: the next sub-block reads this output, so the all-reduce is waited at once.
        hidden_states = hidden_states + comm.all_reduce(attn_out, self.tp_group).wait()
        mlp_out = self.mlp_block(hidden_states)
        return hidden_states + comm.all_reduce(mlp_out, self.tp_group).wait()


class ZooLlamaPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooLlamaConfig
    config: ZooLlamaConfig
    _no_split_modules = ["LlamaDecoderLayer"]

    def check_layout(self, degrees: dict[str, int]) -> None:
        """One clear error unless the mesh degrees fit the shard layout (`parallel.parallelize` asks first)."""
        check_layout(self.config, degrees)


class ZooLlamaModel(ZooLlamaPreTrainedModel, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return LlamaDecoderLayer(config, layer_idx)


class ZooLlamaForCausalLM(ZooLlamaPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooLlamaModel
    shard_plan = PLAN
