"""Dense Llama: pre-norm decoder layers, attention then SwiGLU MLP, each added to the residual stream.

Parameter names are those of Hugging Face `LlamaForCausalLM` (`model.layers.N.self_attn.q_proj`, ...),
so `ZooLlamaForCausalLM.from_pretrained(hf_llama_dir)` loads an HF checkpoint unchanged. The layer is
the shared pre-norm block (models/common/decoder.py), which other architectures reuse too.
"""

from models.common import PreNormDecoderLayer, ZooDecoderModel, ZooForCausalLM, ZooPreTrainedModel
from models.llama.configuration import ZooLlamaConfig
from models.llama.sharding import PLAN


class ZooLlamaPreTrainedModel(ZooPreTrainedModel):
    config_class = ZooLlamaConfig
    config: ZooLlamaConfig
    _no_split_modules = ["PreNormDecoderLayer"]


class ZooLlamaModel(ZooLlamaPreTrainedModel, ZooDecoderModel):
    def make_layer(self, config, layer_idx):
        return PreNormDecoderLayer(config, layer_idx)


class ZooLlamaForCausalLM(ZooLlamaPreTrainedModel, ZooForCausalLM):
    base_model_class = ZooLlamaModel
    overlap_schedules = ("token_split", "seq_split", "collective_matmul")  # parallel/overlap.py: PreNormDecoderLayer
    shard_plan = PLAN
