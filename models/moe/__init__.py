"""The vanilla top-k MoE (Mixtral-style), expert-parallel over ep: the baseline of scmoe and moepp."""

from models.moe.configuration import ZooMoeConfig
from models.moe.modeling import ZooMoeForCausalLM, ZooMoeModel, ZooMoePreTrainedModel

__all__ = ["ZooMoeConfig", "ZooMoeForCausalLM", "ZooMoeModel", "ZooMoePreTrainedModel"]
