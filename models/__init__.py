"""overlap-zoo models: `import models` registers every architecture; `models.ZOO[name]` gives its classes."""

from models.llama import ZooLlamaConfig, ZooLlamaForCausalLM, ZooLlamaModel
from models.registry import ZOO, ZooEntry, build_config, build_model, get, register

# Shapes shared by every tiny model, so tiny instances of different architectures compare fairly.
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

register("llama", ZooLlamaConfig, ZooLlamaForCausalLM, ZooLlamaModel, tiny_config=TINY_LLAMA)

__all__ = ["TINY_LLAMA", "ZOO", "ZooEntry", "build_config", "build_model", "get", "register"]
