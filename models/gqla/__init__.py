"""GQLA (group-query latent attention): a shared latent and one RoPE key, group-indexed up-projections; two
exact decode paths over the same weights (MQA-absorb with a latent cache, GQA with a per-group cache), TP
over groups on the gqa path."""

# Registers converter=deepseek_to_gqla (models.CONVERTERS) with `import models`.
from models.gqla import deepseek  # noqa: F401
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
