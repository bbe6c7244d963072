"""What shared code needs to know about Ladder Residual beyond its classes (see models/registry.py)."""

from models.ladder.configuration import ZooLadderConfig

# Llama's collectives: the same two all-reduces per layer; only where they are waited differs (modeling.py).
from models.llama.entry import collectives_per_forward


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooLadderConfig:
    """The Llama of the bench shape with every layer laddered, as in the paper's speed benchmark;
    `ladder_layers=N` in `overrides` ladders the last N only."""
    return ZooLadderConfig(**{**shape, "ladder_layers": shape["num_hidden_layers"], **overrides})


__all__ = ["bench_config", "collectives_per_forward"]
