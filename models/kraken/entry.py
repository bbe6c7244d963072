"""What shared code needs to know about Kraken beyond its classes (see models/registry.py)."""

from models.kraken.configuration import ZooKrakenConfig
from models.llama.configuration import ZooLlamaConfig
from models.registry import Collectives


def fit_degrees(degrees: dict[str, int]) -> dict:
    """Kraken runs one stream per TP rank (sharding.py): k = the TP degree."""
    return {"kraken_degree": degrees.get("tp", 1)}


def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> ZooKrakenConfig:
    """The Kraken with k = the TP degree whose stream width matches the parameter count of the Llama of
    the bench shape (`ZooKrakenConfig.from_llama`); `overrides` are Kraken config fields."""
    return ZooKrakenConfig.from_llama(ZooLlamaConfig(**shape), degrees.get("tp", 1), **overrides)


def collectives_per_forward(config, degrees: dict[str, int]) -> dict[str, Collectives]:
    """L - 1 all-reduces of the sum of streams (B x T x d', one per layer after the first, each overlapped
    with attention) and one of the row-split conjunction's partial products (B x T x d')."""
    if degrees.get("tp", 1) == 1:
        return {}
    calls = config.num_hidden_layers
    return {"all_reduce": Collectives(calls, calls * config.hidden_size)}
