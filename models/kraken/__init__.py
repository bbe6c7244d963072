"""Kraken (Prabhakar et al., NeurIPS 2024): k independent streams per layer, whose one all-reduce per
layer overlaps attention; it runs at TP degree k, rank i holding stream i."""

from models.kraken.configuration import ZooKrakenConfig, match_llama_parameters
from models.kraken.modeling import ZooKrakenForCausalLM, ZooKrakenModel, ZooKrakenPreTrainedModel

__all__ = [
    "ZooKrakenConfig",
    "ZooKrakenForCausalLM",
    "ZooKrakenModel",
    "ZooKrakenPreTrainedModel",
    "match_llama_parameters",
]
