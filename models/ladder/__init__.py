"""Ladder Residual (Zhang, Mishra et al. 2025): each sub-block reads the residual stream without the
previous sub-block's output, so that output's all-reduce overlaps the next sub-block's compute."""

from models.ladder.configuration import ZooLadderConfig
from models.ladder.modeling import ZooLadderForCausalLM, ZooLadderModel

__all__ = ["ZooLadderConfig", "ZooLadderForCausalLM", "ZooLadderModel"]
