"""MoE++ (Jin et al., ICLR 2025): FFN experts plus zero / copy / constant experts and gating residuals;
under expert parallelism the zero-computation experts stay on every rank and never enter the all-to-all."""

from models.moepp.configuration import ZooMoeppConfig
from models.moepp.modeling import ZooMoeppForCausalLM, ZooMoeppModel, ZooMoeppPreTrainedModel

__all__ = ["ZooMoeppConfig", "ZooMoeppForCausalLM", "ZooMoeppModel", "ZooMoeppPreTrainedModel"]
