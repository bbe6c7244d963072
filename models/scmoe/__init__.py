"""ScMoE (Cai et al., ICML 2025): shortcut-connected MoE whose routed experts read the preceding block, so
the expert-parallel all-to-alls overlap the dense block and the shared expert."""

from models.scmoe.configuration import ZooScMoeConfig
from models.scmoe.modeling import ZooScMoeForCausalLM, ZooScMoeModel, ZooScMoePreTrainedModel

__all__ = ["ZooScMoeConfig", "ZooScMoeForCausalLM", "ZooScMoeModel", "ZooScMoePreTrainedModel"]
