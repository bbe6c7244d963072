"""The dense Llama baseline: weight-compatible with Hugging Face `LlamaForCausalLM`."""

from models.llama.configuration import ZooLlamaConfig
from models.llama.modeling import ZooLlamaForCausalLM, ZooLlamaModel, ZooLlamaPreTrainedModel

__all__ = ["ZooLlamaConfig", "ZooLlamaForCausalLM", "ZooLlamaModel", "ZooLlamaPreTrainedModel"]
