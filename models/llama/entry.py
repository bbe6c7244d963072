"""What shared code needs to know about the dense Llama beyond its classes (see models/registry.py)."""

from models.llama.configuration import ZooLlamaConfig
from models.registry import Collectives


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooLlamaConfig:
    """A bench shape is a Llama shape: taken as is."""
    return ZooLlamaConfig(**{**shape, **overrides})


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """Megatron TP (sharding.py): an all-reduce of B x T x d after attention and one after the MLP, per layer."""
    if degrees.get("tp", 1) == 1:
        return {}
    calls = 2 * config.num_hidden_layers
    return {"all_reduce": Collectives(calls, calls * config.hidden_size)}
