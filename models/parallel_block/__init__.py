"""GPT-J / PaLM parallel block: attention and MLP read the same normed input; one all-reduce per layer."""

from models.parallel_block.configuration import ZooParallelConfig
from models.parallel_block.modeling import ZooParallelForCausalLM, ZooParallelModel

__all__ = ["ZooParallelConfig", "ZooParallelForCausalLM", "ZooParallelModel"]
