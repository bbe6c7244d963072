"""What shared code needs to know about the parallel block beyond its classes (see models/registry.py)."""

from models.parallel_block.configuration import ZooParallelConfig
from models.registry import Collectives


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooParallelConfig:
    """A bench shape is a Llama shape, and the parallel block has Llama's fields: taken as is."""
    return ZooParallelConfig(**{**shape, **overrides})


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """Attention and MLP partial outputs are summed first: ONE all-reduce of B x T x d per layer."""
    if degrees.get("tp", 1) == 1:
        return {}
    calls = config.num_hidden_layers
    return {"all_reduce": Collectives(calls, calls * config.hidden_size)}
