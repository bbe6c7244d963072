"""overlap-zoo models: `import models` registers every architecture; `models.ZOO[name]` gives its classes."""

from models.checkpoint import apply_special_tokens, save_checkpoint
from models.kraken import ZooKrakenConfig, ZooKrakenForCausalLM, ZooKrakenModel
from models.ladder import ZooLadderConfig, ZooLadderForCausalLM, ZooLadderModel
from models.llama import ZooLlamaConfig, ZooLlamaForCausalLM, ZooLlamaModel
from models.parallel_block import ZooParallelConfig, ZooParallelForCausalLM, ZooParallelModel
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
register("parallel", ZooParallelConfig, ZooParallelForCausalLM, ZooParallelModel, tiny_config=TINY_LLAMA)
# Tiny ladder: the paper's hybrid, the upper half of the layers laddered.
register("ladder", ZooLadderConfig, ZooLadderForCausalLM, ZooLadderModel, tiny_config={**TINY_LLAMA, "ladder_layers": 2})
# Tiny Kraken: two streams, each of the tiny llama's layer shapes (so TP 2 fits; tests use k = TP degree).
register("kraken", ZooKrakenConfig, ZooKrakenForCausalLM, ZooKrakenModel, tiny_config={**TINY_LLAMA, "kraken_degree": 2})

__all__ = [
    "TINY_LLAMA",
    "ZOO",
    "ZooEntry",
    "apply_special_tokens",
    "build_config",
    "build_model",
    "get",
    "register",
    "save_checkpoint",
]
