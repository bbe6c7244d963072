"""Shared layers: every architecture in the zoo builds from these, none keeps its own copy."""

from models.common.attention import Attention, make_causal_mask
from models.common.causal_lm import ZooCausalLMOutput, ZooDecoderModel, ZooForCausalLM, ZooModelOutput
from models.common.decoder import PreNormDecoderLayer
from models.common.mlp import SwiGLUMLP
from models.common.moe import (
    GroupedExperts,
    MoEDispatch,
    PaddedDispatch,
    Routing,
    SparseMoE,
    TopKRouter,
    capacity,
    dispatch,
    dispatch_padded,
    dropped_assignments,
    init_moe_weights,
    load_balance_loss,
    set_moe_dispatch,
    update_balance_biases,
)
from models.common.norm import RMSNorm
from models.common.pretrained import ZooPreTrainedModel
from models.common.rotary import RotaryEmbedding, apply_rotary_pos_emb, rope_inv_freq

__all__ = [
    "Attention",
    "GroupedExperts",
    "MoEDispatch",
    "PaddedDispatch",
    "PreNormDecoderLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "Routing",
    "SparseMoE",
    "SwiGLUMLP",
    "TopKRouter",
    "ZooCausalLMOutput",
    "ZooDecoderModel",
    "ZooForCausalLM",
    "ZooModelOutput",
    "ZooPreTrainedModel",
    "apply_rotary_pos_emb",
    "capacity",
    "dispatch",
    "dispatch_padded",
    "dropped_assignments",
    "init_moe_weights",
    "load_balance_loss",
    "make_causal_mask",
    "rope_inv_freq",
    "set_moe_dispatch",
    "update_balance_biases",
]
