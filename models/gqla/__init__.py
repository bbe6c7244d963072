"""GQLA (group-query latent attention): a shared latent and one RoPE key, group-indexed up-projections; two
exact decode paths over the same weights (MQA-absorb with a latent cache, GQA with a per-group cache), TP
over groups on the gqa path."""

from models.gqla.configuration import ZooGQLAConfig
from models.gqla.modeling import (
    GroupedKVCache,
    GroupQueryLatentAttention,
    LatentCache,
    LatentLayer,
    ZooGQLAForCausalLM,
    ZooGQLAModel,
    ZooGQLAPreTrainedModel,
)

__all__ = [
    "GroupQueryLatentAttention",
    "GroupedKVCache",
    "LatentCache",
    "LatentLayer",
    "ZooGQLAConfig",
    "ZooGQLAForCausalLM",
    "ZooGQLAModel",
    "ZooGQLAPreTrainedModel",
]
