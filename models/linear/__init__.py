"""Linear-Llama: causal linear attention (SiLU feature map, output norm and gate, optional decay) and
hybrids with softmax layers by a layer pattern; kernels with their references in ops.py."""

from models.linear.configuration import ZooLinearConfig
from models.linear.modeling import (
    LinearCache,
    ZooLinearForCausalLM,
    ZooLinearModel,
    ZooLinearPreTrainedModel,
)

__all__ = [
    "LinearCache",
    "ZooLinearConfig",
    "ZooLinearForCausalLM",
    "ZooLinearModel",
    "ZooLinearPreTrainedModel",
]
